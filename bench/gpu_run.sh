#!/usr/bin/env bash
# The GPU benchmark, for an H100/H200 machine (see ../.library/device/README.md): run from the
# repository root there, with the CUDA binary built here by scripts/build-cuda.sh and carried
# compressed (the machine has PyTorch, CUDA 13 and nvcc, but no Rust, no ffmpeg and no network):
#
#   here:  scripts/build-cuda.sh && xz -T0 -k -9 target/release/lipsync
#          pip download --no-deps imageio-ffmpeg -d target/wheels   (a static ffmpeg with libx264)
#   there: bench/gpu_run.sh            (writes everything under $OUT)
#
# It runs lipsync bench (model frames/s by batch, dtype, convolution path and instances; f16/bf16
# and cuDNN-vs-candle accuracy on a real photo and speech; encoder; end to end) and
# bench/pytorch_reference.py (eager f16 with cudnn.benchmark, and torch.compile) on the same GPU
# in the same run; then the autotune cache across two renders and the forced-OOM request.
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

# The GPU test (tests/gpu.rs), when carried. Here:
#   scripts/build-cuda.sh test --release --locked --features cuda --test gpu --no-run
#   cp "$(ls -t target/release/deps/gpu-* | grep -v '[.]d$' | head -1)" target/release/gpu-test
#   xz -T0 -k -9 target/release/gpu-test
# Then once under compute-sanitizer's memcheck at batch 2 (some device runtimes refuse it: the
# refusal is kept in $OUT/memcheck.log).
gpu_test=target/release/gpu-test
if [ ! -x "$gpu_test" ] && [ -f "$gpu_test.xz" ]; then xz -dk "$gpu_test.xz"; chmod +x "$gpu_test"; fi
if [ -x "$gpu_test" ]; then
  run "$gpu_test" --test-threads=1 --nocapture > "$OUT/gpu-test.log" 2>&1 \
    && echo "gpu test: passed" || echo "gpu test: FAILED (see $OUT/gpu-test.log)"
  if command -v compute-sanitizer >/dev/null; then
    LIPSYNC_GPU_TEST_BATCHES=2 run compute-sanitizer --tool memcheck "$gpu_test" \
      --test-threads=1 --nocapture generator_in_f16 > "$OUT/memcheck.log" 2>&1 \
      && echo "memcheck: clean" || echo "memcheck: failed or refused (see $OUT/memcheck.log)"
  else
    echo "memcheck: compute-sanitizer not installed" | tee "$OUT/memcheck.log"
  fi
fi
run "$bin" init-weights "$OUT/weights.safetensors"
run "$bin" bench --checkpoint "$OUT/weights.safetensors" --json "$OUT/lipsync.json" | tee "$OUT/lipsync.md"
python3 bench/pytorch_reference.py --checkpoint "$OUT/weights.safetensors" --device cuda \
  --dtypes f32,f16,bf16 --batches 1,16,64,128,256,512 --compile --json "$OUT/pytorch.json" | tee "$OUT/pytorch.md"

# The autotune cache: the first render searches and writes it, the second loads it.
for i in 1 2; do
  LIPSYNC_LOG=info run "$bin" render --checkpoint "$OUT/weights.safetensors" \
    --audio tests/media/arctic_a0007.wav --image tests/media/astronaut.png \
    --autotune-cache "$OUT/autotune.json" --out "$OUT/render$i.mp4" 2>&1 | tee "$OUT/render$i.log" | tail -3
done
grep -h "autotune cache\|exact f32 reference" "$OUT"/render*.log || true

# Forced out of memory: a 1 GiB limit makes 512-frame batches split; the request completes.
LIPSYNC_LOG=info run "$bin" serve --checkpoint "$OUT/weights.safetensors" --port 8099 \
  --gpu-memory-limit 1G > "$OUT/oom-serve.log" 2>&1 &
srv=$!
for _ in $(seq 120); do curl -sf localhost:8099/ready >/dev/null && break; sleep 1; done
curl -s -F audio=@tests/media/arctic_a0007.wav -F image=@tests/media/astronaut.png \
  localhost:8099/v1/lipsync -o "$OUT/oom.mp4" -w "oom request: HTTP %{http_code}, %{size_download} bytes\n" | tee "$OUT/oom.txt"
curl -s localhost:8099/info > "$OUT/oom-info.json"
curl -s localhost:8099/metrics | grep -E "^lipsync_(frames_total|requests_total)" >> "$OUT/oom.txt"
kill "$srv" || true
