#!/usr/bin/env bash
# The Python client, clients/python (the lipsync-client package, its Pipecat and LiveKit
# Agents plugins and its README's examples), against the release server
# ($CARGO_TARGET_DIR/release/lipsync, built by scripts/test.sh), which the tests start on
# 127.0.0.1 with random weights. Pipecat's own test utilities run the Pipecat service; no
# LiveKit server exists here, so the LiveKit generator runs without a room.
#
# Makes target/clients-venv with the versions pinned in tests/clients/constraints.txt
# (pipecat-ai 1.14.0, livekit-agents 1.8.9, pytest, ...; made again when the pins change) and
# installs the package from the tree into it on every run. Starts nothing global.
#
#   tests/clients/run.sh [pytest args, e.g. -k pipecat]     (scripts/test.sh runs it)
#   tests/clients/run.sh --prepare                          (only makes the venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)

# Pipecat 1.14 needs Python 3.11 or newer.
py=${LIPSYNC_CLIENTS_PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "tests/clients/run.sh: $py is $("$py" --version 2>&1); Pipecat needs Python 3.11 or newer (set LIPSYNC_CLIENTS_PYTHON)" >&2
  exit 1
fi
venv=target/clients-venv
pins=tests/clients/constraints.txt
if ! cmp -s "$pins" "$venv/.constraints.txt" || ! "$venv/bin/python" -c 'import pytest_timeout' 2>/dev/null; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -c "$pins" \
    "./clients/python[pipecat,livekit]" pytest pytest-timeout mypy setuptools
  cp "$pins" "$venv/.constraints.txt"
fi
if [ "${1:-}" = --prepare ]; then exit 0; fi
# The package as the tree has it now, built from a copy (the build leaves files behind).
rm -rf "$venv/client-src" && mkdir "$venv/client-src"
cp -r clients/python/pyproject.toml clients/python/README.md clients/python/src "$venv/client-src"
rm -rf "$venv"/client-src/src/*.egg-info
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation \
  --force-reinstall "$venv/client-src"
echo "tests/clients: environment ready in $(( $(date +%s) - t0 )) s"

# Every test has its own deadline (pytest-timeout); this bounds the whole run.
PYTHONDONTWRITEBYTECODE=1 timeout 900 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -o timeout=180 --durations=8 tests/clients "$@"
echo "tests/clients: passed in $(( $(date +%s) - t0 )) s"
