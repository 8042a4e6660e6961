#!/usr/bin/env bash
# Makes (once) a venv under target/torch-venv with PyTorch and numpy, for the tests that run the
# PyTorch yardstick (tests/bench.rs) and the rehearsal of the GPU run's torch stage
# (bench/gpu_run.sh --rehearse). Prints the venv's python on stdout; progress goes to stderr.
# PyTorch's CPU-only index is tried first (a 200 MB wheel); where it cannot be reached, PyPI's
# wheel (CUDA libraries included, about 5 GB installed) is used: both compute on the CPU here.
#
#   LIPSYNC_TORCH_PYTHON=$(scripts/torch-venv.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$PWD/target/torch-venv
if ! "$venv/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  echo "torch-venv: installing PyTorch and numpy into $venv" >&2
  python3 -m venv "$venv"
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu --timeout 20 torch numpy >&2 2>/dev/null \
    || "${pip[@]}" torch numpy >&2
  "$venv/bin/python" -c 'import torch, numpy' >&2
fi
echo "$venv/bin/python"
