#!/usr/bin/env bash
# The full in-image builds: compiles lipsync inside Docker, as a user with a registry does
# with `docker build -f docker/Dockerfile.cpu -t lipsync:cpu .` (and docker/Dockerfile for
# lipsync:cuda), and prints how long each took. Not part of CI (about 20 minutes for the CPU
# image and more for CUDA on two cores); CI builds the CPU image with PREBUILT=1.
#
#   docker/build-full.sh [cpu] [cuda]      # default: both
#
# On a machine with no image registry, the Debian bases come from docker/local-base.sh, and the
# Rust build stage from a local image named for what it is, lipsync-local/rust:1.95-bookworm:
# the Debian stand-in plus this machine's Rust 1.95 toolchain (rustc, cargo, the standard
# library) and gcc. When `rust:1.95-bookworm` itself is available (pulled), it is used instead.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(cpu cuda)

RUST_VERSION=1.95
rust_image=rust:$RUST_VERSION-bookworm
docker/local-base.sh
if ! docker image inspect "$rust_image" >/dev/null 2>&1 && ! docker pull -q "$rust_image" >/dev/null 2>&1; then
  rust_image=lipsync-local/rust:$RUST_VERSION-bookworm
  if ! docker image inspect "$rust_image" >/dev/null 2>&1; then
    sysroot=$(rustc --print sysroot)
    case "$(rustc --version)" in
      "rustc $RUST_VERSION."*) ;;
      *) echo "build-full: this machine's rustc is $(rustc --version), not $RUST_VERSION" >&2; exit 1 ;;
    esac
    ctx=$(mktemp -d "${TMPDIR:-/tmp}/lipsync-rust.XXXXXX")
    trap 'rm -rf "$ctx"' EXIT
    mkdir -p "$ctx/rust"
    # The toolchain without its documentation.
    cp -a "$sysroot/bin" "$sysroot/lib" "$ctx/rust/"
    cat >"$ctx/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev pkg-config make \
    && rm -rf /var/lib/apt/lists/*
COPY rust /usr/local/rust
ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN rustc --version && cargo --version
EOF
    echo "build-full: making $rust_image from $sysroot" >&2
    docker build -q -t "$rust_image" "$ctx" >/dev/null
  fi
fi

for t in "${targets[@]}"; do
  case "$t" in
    cpu) file=docker/Dockerfile.cpu ;;
    cuda) file=docker/Dockerfile ;;
    *) echo "build-full: unknown target $t (cpu, cuda)" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  docker build -f "$file" --build-arg RUST_IMAGE="$rust_image" -t "lipsync:$t" . \
    >"target/build-full-$t.log" 2>&1 || { tail -40 "target/build-full-$t.log" >&2; exit 1; }
  secs=$(( $(date +%s) - start ))
  size=$(docker image inspect -f '{{.Size}}' "lipsync:$t" | awk '{printf "%.0f MB", $1/1e6}')
  echo "build-full: lipsync:$t built from source in ${secs} s ($size; log target/build-full-$t.log)"
done
