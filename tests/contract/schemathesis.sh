#!/usr/bin/env bash
# Contract test: schemathesis (from PyPI) generates requests from openapi.yaml against a running
# `lipsync serve` with the test weights and checks every response against the spec (status
# codes, content types, JSON schemas, headers) and that nothing returns a 5xx.
#
# One check is excluded: positive_data_acceptance expects every schema-valid request to
# succeed, but "schema-valid" here means any bytes in the audio and image fields, and random
# bytes are not speech or a photo: those correctly get 4xx answers.
#
#   tests/contract/schemathesis.sh        (scripts/test.sh runs it after cargo test)
#   tests/contract/schemathesis.sh --prepare   (only installs schemathesis)
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=target/contract-venv
if [ ! -x "$venv/bin/schemathesis" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==4.32.5"
fi
if [ "${1:-}" = --prepare ]; then exit 0; fi

cargo build --release --locked --quiet --bin lipsync
log=$(mktemp)
# Batch jobs' files and store in a directory of this run's, never the user's data directory.
data=$(mktemp -d)
target/release/lipsync serve --checkpoint tests/fixtures/checkpoints/zip_bare.pt \
  --port 0 --max-batch 8 --first-batch 2 --max-audio-seconds 30 --data-dir "$data" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$log" "$data"' EXIT

port=""
for _ in $(seq 1 300); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" | head -1 | sed 's/.*://') || true
  [ -n "$port" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "contract: the server exited" >&2; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { cat "$log"; echo "contract: the server never listened" >&2; exit 1; }
python3 - "$port" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/ready"
for _ in range(600):
    try:
        if urllib.request.urlopen(url, timeout=5).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
sys.exit("contract: the server never became ready")
PY

"$venv/bin/schemathesis" run "http://127.0.0.1:$port/openapi.yaml" \
  --checks all --exclude-checks positive_data_acceptance \
  --max-examples 50 --request-timeout 120 --seed 20261121
