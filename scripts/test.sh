#!/usr/bin/env bash
# Runs lipsync's test suite: `cargo test --release --features test-faults` (after a release build, which the load suite
# tests/load.rs and the browser tests run), then the OpenAPI contract test (schemathesis
# against a running server), then the browser tests (the page at / in headless Chromium),
# then the deployment tests (tests/deploy/run.sh: images, replicas, Kubernetes manifests).
# Installs what the tests need when it is missing (ffmpeg with libx264 and ffprobe,
# python3-venv, apache2-utils for ab, chromium, from Debian/Ubuntu packages; schemathesis,
# Playwright and PyTorch from PyPI into target/), so a fresh machine needs only this command and a Rust
# toolchain.
#
#   ./scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "test.sh: cargo is missing; install Rust from https://rustup.rs" >&2
  exit 1
fi

missing=()
if ! command -v ffmpeg >/dev/null || ! command -v ffprobe >/dev/null; then missing+=(ffmpeg); fi
if ! command -v python3 >/dev/null; then missing+=(python3); fi
# ApacheBench (ab), the load generator of the load suite (tests/load.rs).
if ! command -v ab >/dev/null; then missing+=(apache2-utils); fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
# Headless Chromium for the browser tests (tests/browser/run.sh), Debian's build: it plays
# H.264/AAC through Media Source Extensions.
if [ ! -x "${LIPSYNC_CHROMIUM:-/usr/bin/chromium}" ]; then missing+=(chromium); fi
# PostgreSQL for the job store's tests (tests/job_store.rs): they start throwaway clusters
# from its binaries (the system service need not run) and fail when it is missing.
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then missing+=(postgresql); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "test.sh: installing ${missing[*]}" >&2
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# What the later stages install mostly waits on the network: PyTorch (scripts/torch-venv.sh),
# the contract, browser and client tests' venvs, and the deployment tests' Debian base and
# balancer and job store images. It is made in the background while cargo builds (two
# chains: the Python venvs, and Docker), and waited for before any test runs, so the tests
# never share the CPU with it. Its output goes to target/test-prepare-*.log, shown if it fails.
mkdir -p target
prepare() {
  local name=$1; shift
  ( set -e; "$@" ) >"target/test-prepare-$name.log" 2>&1
}
torch=(true)
if [ -z "${LIPSYNC_TORCH_PYTHON:-}" ]; then
  torch=(scripts/torch-venv.sh)
  LIPSYNC_TORCH_PYTHON=$PWD/target/torch-venv/bin/python
fi
# PyTorch for the tests that run the PyTorch yardstick (tests/bench.rs): with the variable set,
# they fail rather than skip when torch is missing.
export LIPSYNC_TORCH_PYTHON
prepare_venvs() {
  "${torch[@]}" >/dev/null
  tests/contract/schemathesis.sh --prepare
  tests/browser/run.sh --prepare
  tests/clients/run.sh --prepare
}
prepare venvs prepare_venvs &
venvs=$!
prepare docker tests/deploy/run.sh --prepare &
images=$!
prepared() {
  local ok=0
  wait $venvs || { echo "test.sh: preparing the Python venvs failed:" >&2; cat target/test-prepare-venvs.log >&2; ok=1; }
  wait $images || { echo "test.sh: preparing the deployment tests failed:" >&2; cat target/test-prepare-docker.log >&2; ok=1; }
  return $ok
}

# The load and fault suite (tests/load.rs) runs against the release server binary.
cargo build --release --locked
# The tests are built in the release profile too, so they reuse the dependencies just built
# (a second, dev-profile build of them took 8.7 min on 2 cores). Integer overflow checks and
# debug assertions are therefore off in the tests, as in the binary users run; the feature
# test-faults keeps the fault hooks (LIPSYNC_TEST_FAULTS) that the reliability tests use.
# That build's server binary carries the hooks; the release binary users run (which the stages
# below test, and the deploy tests put in the image) has none: it is put back after the tests,
# pass or fail (cargo keeps both, so this only relinks the file).
trap 'cargo build --release --locked --quiet' EXIT
cargo test --release --locked --features test-faults --no-run "$@"
prepared
cargo test --release --locked --features test-faults "$@"
cargo build --release --locked
tests/contract/schemathesis.sh
# The page at / in headless Chromium against the release server (built above).
tests/browser/run.sh
# The images built and run for real (the CPU image from the release binary above), three
# replicas behind the balancer, the Kubernetes manifests validated: needs a Docker Engine.
tests/deploy/run.sh
tests/clients/run.sh  # The Python client and its Pipecat and LiveKit Agents plugins against the release server (clients/python).
