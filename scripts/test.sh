#!/usr/bin/env bash
# Runs lipsync's test suite. Installs what the tests need when it is missing (ffmpeg with
# libx264 and ffprobe, from Debian/Ubuntu packages), so a fresh machine needs only this command
# and a Rust toolchain.
#
#   ./scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "test.sh: cargo is missing; install Rust from https://rustup.rs" >&2
  exit 1
fi

if ! command -v ffmpeg >/dev/null || ! command -v ffprobe >/dev/null; then
  echo "test.sh: installing ffmpeg (the render and service tests encode and probe video)" >&2
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq ffmpeg >/dev/null
fi

# Test dependencies are built with optimisation (see [profile.dev.package."*"] in Cargo.toml):
# tensor code is far too slow unoptimised.
cargo test --locked "$@"
