#!/usr/bin/env bash
# Runs lipsync's test suite. Installs what the tests need when it is missing, so a fresh
# machine needs only this command (and a Rust toolchain).
#
#   ./scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "test.sh: cargo is missing; install Rust from https://rustup.rs" >&2
  exit 1
fi

# Test dependencies are built with optimisation (see [profile.dev.package."*"] in Cargo.toml):
# tensor code is far too slow unoptimised.
cargo test --locked "$@"
