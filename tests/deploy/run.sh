#!/usr/bin/env bash
# The deployment tests: the CPU image built and run for real, three replicas behind the
# balancer (docker/compose.replicas.yaml), and the Kubernetes manifests validated offline.
# Needs a Docker Engine (no registry: docker/local-base.sh makes the Debian base) and the
# release binary (scripts/test.sh builds it first; the image takes it with PREBUILT=1).
#
#   tests/deploy/run.sh [pytest args]
#   tests/deploy/run.sh --prepare     (only the Debian base, the balancer's and the job store's
#                                      images and the pytest venv: what needs no lipsync binary;
#                                      scripts/test.sh makes them while cargo builds)
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
lap() { echo "deploy tests: $1 ($(( $(date +%s) - t0 )) s)"; }

if ! docker info >/dev/null 2>&1; then
  echo "tests/deploy/run.sh: the deployment tests need a running Docker Engine (docker info failed)" >&2
  exit 1
fi
# docker-compose runs the replicas; ffprobe (ffmpeg) checks the videos the containers render.
missing=()
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then missing+=(docker-compose); fi
if ! command -v ffprobe >/dev/null; then missing+=(ffmpeg); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "tests/deploy/run.sh: installing ${missing[*]}" >&2
  sudo=""; if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
docker/local-base.sh
lap "bases ready"
venv=target/deploy-venv
if ! "$venv/bin/python" -c 'import pytest, websockets' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "pytest==8.3.4" "websockets==17.4"
fi
if [ "${1:-}" = --prepare ]; then
  # The images of the replica tests' balancer and job store (the tests' own builds of them
  # are then cached); names as in tests/deploy/test_replicas.py.
  docker build -q -t lipsync-balancer docker/balancer >/dev/null
  docker build -q -t lipsync-postgres docker/postgres >/dev/null
  lap "prepared (base, balancer and job store images, venv)"
  exit 0
fi

# Always: it only relinks when the tests' build (with the fault hooks) was the last one.
cargo build --release --locked
docker build -q -f docker/Dockerfile.cpu --build-arg PREBUILT=1 -t lipsync:cpu . >/dev/null
lap "lipsync:cpu built ($(docker image inspect -f '{{.Size}}' lipsync:cpu | awk '{printf "%.0f MB", $1/1e6}'))"

PYTHONDONTWRITEBYTECODE=1 timeout 1800 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --durations=0 tests/deploy "$@"
lap "container and replica tests passed"

deploy/k8s/validate.sh
lap "Kubernetes manifests valid"
