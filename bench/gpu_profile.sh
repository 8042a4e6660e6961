#!/usr/bin/env bash
# The model-speed profile of the GPU-proof issue (docs/GPU-RUN.md, "Profiling the own path"):
# on the GPU machine, in one call, with what bench/gpu_pack.sh packed (lipsync, gpu-test):
#
#   bench/gpu_profile.sh [CONFIG...]     CONFIG: LAYOUT:WORKSPACE[:UPSAMPLING], e.g. nchw:256M
#                                        nhwc:4G:transposed [default: nhwc:256M:subpixel
#                                        nhwc:256M:transposed nchw:256M:transposed]
#
# 1. tests/gpu.rs, the tests LIPSYNC_PROFILE_TESTS names [nhwc generator_in_f16] (filters), batches 2
#    and 512: the layouts' accuracy before any speed is believed;
# 2. for each CONFIG, `lipsync bench --sections model,layers` in f16 at LIPSYNC_PROFILE_BATCHES
#    [64,256,512] with --conv-layout, --cudnn-workspace and --conv-upsampling [subpixel] set
#    by their environment variables: frames/s and memory, then each layer's time (CUDA events)
#    with its algorithm, workspace and fusion; then, with serve's defaults, the bench sections
#    LIPSYNC_PROFILE_MORE names [accuracy,instances] (accuracy in f16 and bf16; instances
#    LIPSYNC_PROFILE_INSTANCES [1,3] sharing LIPSYNC_PROFILE_INSTANCE_BATCH [384] frames in
#    flight); then, for each instance count in LIPSYNC_PROFILE_E2E_INSTANCES [none; e.g.
#    "1 3"], whole requests of 10 and 40 s of speech through the engine (bench --sections e2e,
#    with the carried ffmpeg);
# 3. PyTorch on the same init-weights file, f16, the same batches, eager NCHW and channels
#    last, and torch.compile (channels last, largest batch first, while 60 s allow): the reference of this run
#    (skipped with LIPSYNC_PROFILE_TORCH=0).
#
# Each part has a time limit (LIPSYNC_PROFILE_SECONDS per bench configuration [75], tests
# [100], torch [90]); a part stopped by its limit says so and the script goes on. Writes
# $OUT/profile.md (everything, Markdown) and $OUT/profile.log.gz (stderr of every part).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/lipsync-gpu-out}
WORK=${LIPSYNC_WORK:-/tmp/lipsync-gpu}
CARRY=${LIPSYNC_CARRY_DIR:-target/gpu-carry}
BATCHES=${LIPSYNC_PROFILE_BATCHES:-64,256,512}
TESTS=${LIPSYNC_PROFILE_TESTS:-nhwc generator_in_f16}
SECONDS_EACH=${LIPSYNC_PROFILE_SECONDS:-75}
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(nhwc:256M:subpixel nhwc:256M:transposed nchw:256M:transposed)
[ "${CONFIGS[*]}" != - ] || CONFIGS=()  # "-": no configuration runs
MORE=${LIPSYNC_PROFILE_MORE-accuracy,instances}
mkdir -p "$OUT" "$WORK/bin"
MD=$OUT/profile.md
LOG=$WORK/profile.log
: > "$MD"
: > "$LOG"
md() { printf '%s\n' "$@" >> "$MD"; }
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
finish() { gzip -c "$LOG" > "$OUT/profile.log.gz"; }
trap finish EXIT

RUN=(scripts/run-on-gpu.sh)
command -v nvidia-smi >/dev/null || RUN=()
python3 bench/gpu_stage.py unpack "$CARRY" "$WORK/bin" >> "$LOG" 2>&1
BIN=${LIPSYNC_BIN:-$WORK/bin/lipsync}
GPU_TEST=${LIPSYNC_GPU_TEST:-$WORK/bin/gpu-test}
[ -x "$BIN" ] || BIN=target/release/lipsync

md "# lipsync GPU run: the own path's profile" "" "| | |" "|---|---|"
md "| command | \`bench/gpu_profile.sh ${CONFIGS[*]}\` |"
md "| device | $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no GPU') |"
md "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
md "| binaries | $(cat "$CARRY/commit" 2>/dev/null || echo unknown) |" ""

# A part with a time limit: its stdout into the Markdown, its stderr into the log.
part() {
  local limit=$1 title=$2 rc t0=$SECONDS
  shift 2
  say "$title"
  timeout "$limit" "$@" >> "$MD" 2>> "$LOG"
  rc=$?
  case $rc in
    0) ;;
    124) md "" "**Stopped by its limit after $limit s.**" ;;
    *) md "" "**Exited with status $rc** (its stderr is in profile.log.gz)." ;;
  esac
  say "$title: status $rc after $((SECONDS - t0)) s"
}

WEIGHTS=$WORK/weights-seed7.safetensors
if [ ! -s "$WEIGHTS" ]; then
  "${RUN[@]}" "$BIN" init-weights "$WEIGHTS.part" --seed 7 >> "$LOG" 2>&1 && mv "$WEIGHTS.part" "$WEIGHTS"
fi

if [ -x "$GPU_TEST" ] && [ -n "$TESTS" ]; then
  md "## tests/gpu.rs \`$TESTS\` (batches 2 and 512)" "" '```'
  part "${LIPSYNC_PROFILE_TEST_SECONDS:-100}" "gpu-test $TESTS" \
    "${RUN[@]}" "$GPU_TEST" --test-threads=1 $TESTS
  md '```' ""
fi

for cfg in "${CONFIGS[@]+"${CONFIGS[@]}"}"; do
  IFS=: read -r layout workspace upsampling <<< "$cfg"
  upsampling=${upsampling:-subpixel}
  md "## --conv-layout $layout --cudnn-workspace $workspace --conv-upsampling $upsampling" "" \
    "\`lipsync bench --sections model,layers --dtypes f16 --batches $BATCHES --seconds 1 --candle-max-batch 1\`" ""
  LIPSYNC_CONV_LAYOUT=$layout LIPSYNC_CUDNN_WORKSPACE=$workspace LIPSYNC_CONV_UPSAMPLING=$upsampling \
    part "$SECONDS_EACH" "bench $cfg" "${RUN[@]}" "$BIN" bench --checkpoint "$WEIGHTS" \
    --sections model,layers --dtypes f16 --batches "$BATCHES" --seconds 1 --candle-max-batch 1
  md ""
done

if [ -n "$MORE" ]; then
  inst=${LIPSYNC_PROFILE_INSTANCES:-1,3}
  ib=${LIPSYNC_PROFILE_INSTANCE_BATCH:-384}
  md "## serve's defaults: \`lipsync bench --sections $MORE --dtypes f16,bf16 --instances $inst --instance-batch $ib\`" ""
  part "$SECONDS_EACH" "bench $MORE" "${RUN[@]}" "$BIN" bench --checkpoint "$WEIGHTS" \
    --sections "$MORE" --dtypes f16,bf16 --instances "$inst" --instance-batch "$ib" --seconds 1 \
    --accuracy-inputs "$WORK/accuracy-inputs.safetensors"
  md ""
fi

[ ! -x "$WORK/bin/ffmpeg" ] || export LIPSYNC_FFMPEG=$WORK/bin/ffmpeg
for n in ${LIPSYNC_PROFILE_E2E_INSTANCES:-}; do
  md "## End to end with --instances $n: \`lipsync bench --sections e2e --e2e 10,40 --encode-frames 0\`" ""
  LIPSYNC_INSTANCES=$n part "$SECONDS_EACH" "e2e, $n instance(s)" "${RUN[@]}" "$BIN" bench \
    --checkpoint "$WEIGHTS" --sections e2e --e2e 10,40 --encode-frames 0
  md ""
done

if [ "${LIPSYNC_PROFILE_TORCH:-1}" != 0 ] && python3 -c 'import torch' 2>/dev/null; then
  md "## PyTorch, the same weights" ""
  inputs=()
  [ -s "$WORK/accuracy-inputs.safetensors" ] && inputs=(--inputs "$WORK/accuracy-inputs.safetensors")
  part "${LIPSYNC_PROFILE_TORCH_SECONDS:-90}" "pytorch" python3 bench/pytorch_reference.py \
    --checkpoint "$WEIGHTS" --device cuda --dtypes f16 --batches "$BATCHES" --seconds 1 "${inputs[@]}" \
    --layouts nchw,channels_last --compile --compile-dtypes f16 --compile-layouts channels_last \
    --budget 60
fi
say "done"
