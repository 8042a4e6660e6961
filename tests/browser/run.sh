#!/usr/bin/env bash
# Browser tests: the try-it page (`GET /`) in Debian's headless Chromium (/usr/bin/chromium,
# `apt-get install chromium`; LIPSYNC_CHROMIUM overrides the path), driven by Playwright for
# Python from PyPI, installed into target/ (the system browser only: nothing downloads one),
# against the release server ($CARGO_TARGET_DIR/release/lipsync, built by scripts/test.sh).
# Screenshots of each state go to target/browser/.
# Also here: examples/stream_client.py run against that server (test_stream_example.py).
#
#   tests/browser/run.sh [pytest args, e.g. -k avatars]     (scripts/test.sh runs it)
#   tests/browser/run.sh --prepare                          (only installs Playwright)
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=target/browser-venv
# websockets: examples/stream_client.py, which test_stream_example.py runs.
if ! "$venv/bin/python" -c 'import playwright, pytest, websockets' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "playwright==1.65.2" "pytest==8.3.4" \
    "websockets==17.4"
fi
if [ "${1:-}" = --prepare ]; then exit 0; fi
# Every wait in the tests has its own deadline; this bounds the whole run.
PYTHONDONTWRITEBYTECODE=1 exec timeout 900 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/browser "$@"
