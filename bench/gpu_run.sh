#!/usr/bin/env bash
# The GPU benchmark, for an H100/H200 machine (see ../.library/device/README.md): run from the
# repository root there, with the CUDA binary built here by scripts/build-cuda.sh and carried
# compressed (the machine has PyTorch, CUDA 13 and nvcc, but no Rust, no ffmpeg and no network):
#
#   here:  scripts/build-cuda.sh && xz -T0 -k -9 target/release/lipsync
#          pip download --no-deps imageio-ffmpeg -d target/wheels   (a static ffmpeg with libx264)
#   there: bench/gpu_run.sh            (writes everything under $OUT)
#
# It runs lipsync bench (model frames/s by batch, dtype and instances; encoder; end to end) and
# bench/pytorch_reference.py (eager f16 with cudnn.benchmark, and torch.compile) on the same GPU
# in the same run.
set -euo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
bin=target/release/lipsync
[ -x "$bin" ] || { xz -dk "$bin.xz"; chmod +x "$bin"; }
wheel=$(ls target/wheels/imageio_ffmpeg-*.whl | head -1)
python3 -m zipfile -e "$wheel" "$OUT/ffmpeg-wheel" >/dev/null
export LIPSYNC_FFMPEG=$(ls "$OUT"/ffmpeg-wheel/imageio_ffmpeg/binaries/ffmpeg-* | head -1)
chmod +x "$LIPSYNC_FFMPEG"
run() { scripts/run-on-gpu.sh "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run "$bin" init-weights "$OUT/weights.safetensors"
run "$bin" bench --checkpoint "$OUT/weights.safetensors" --json "$OUT/lipsync.json" | tee "$OUT/lipsync.md"
python3 bench/pytorch_reference.py --checkpoint "$OUT/weights.safetensors" --device cuda \
  --dtypes f32,f16,bf16 --batches 1,16,64,128,256,512 --compile --json "$OUT/pytorch.json" | tee "$OUT/pytorch.md"
