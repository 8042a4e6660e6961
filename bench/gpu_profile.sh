#!/usr/bin/env bash
# The model path's one-call comparison (docs/GPU-RUN.md, "The model-speed comparison"): on the
# GPU machine, in one call, with what bench/gpu_pack.sh packed (lipsync, gpu-test):
#
#   bench/gpu_profile.sh              the parts below, into $OUT/profile.md and profile.log.gz
#   bench/gpu_profile.sh --rehearse   the same script with the CPU build and tiny sizes into a
#                                     temporary $OUT, then the output rules checked (CI runs it)
#
# 1. tests/gpu.rs, the tests LIPSYNC_PROFILE_TESTS names [planned_generator_in_f16_auto
#    planned_generator_in_bf16_auto generator_in_f16_nhwc] (filters), batches 2 and 512: the
#    paths' accuracy before any speed is believed;
# 2. ONE bench process, `lipsync bench --sections memory,compare` in f16 at
#    LIPSYNC_PROFILE_BATCHES [64,256,512] over the configurations LIPSYNC_PROFILE_CONFIGS
#    [the bench's default: subpixel:separate:none:on (the old default), auto:auto:8:on, and
#    the ablations auto:own:8:on and auto:auto:none:on], each UPSAMPLING:EPILOGUE:INPUT_PAD:
#    ARENA: every upsampling form timed per layer in the first `auto` warm-up, then per
#    configuration frames/s, peak device memory, PSNR against the exact f32 and each layer's
#    time (CUDA events); plus the planned arena per batch size;
# 3. with serve's settings set to LIPSYNC_PROFILE_DEFAULTS [best: the accepted configuration
#    with the most frames/s at the largest batch, else the old default] (the LIPSYNC_CONV_*
#    variables, also written to $LIPSYNC_WORK/defaults.env for a gpu_run.sh stage later in the
#    same call), the bench sections LIPSYNC_PROFILE_MORE names [instances: 1 and 3 instances at
#    batch LIPSYNC_PROFILE_INSTANCE_BATCH (512) each, frames/s and device memory after
#    warm-up, contexts included], and for each instance count in LIPSYNC_PROFILE_E2E_INSTANCES
#    [none; e.g. "1 3"] whole requests of 10 and 40 s of speech (bench --sections e2e);
# 4. PyTorch on the same init-weights file, f16, the same batches, eager NCHW and channels
#    last, and torch.compile (channels last, cudnn.benchmark on, largest batch first) while its
#    limit allows: the reference of this run (LIPSYNC_PROFILE_TORCH=0 skips it).
#
# Each part has a time limit (LIPSYNC_PROFILE_SECONDS for the bench [180], tests [100], torch
# [120], more [90]); a part stopped by its limit says so and the script goes on. Writes
# $OUT/profile.md (everything, Markdown) and $OUT/profile.log.gz (stderr of every part), and
# nothing else to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [ "${1:-}" = --rehearse ]; then
  # The CPU build through the same paths: no tests (the GPU test needs CUDA), batches 1 and
  # 2, the torch part on the CPU without torch.compile. Then the rules the device sets.
  set -e
  [ "${LIPSYNC_REHEARSE_BUILD:-1}" = 0 ] || cargo build --release --locked --quiet
  [ -x target/release/lipsync ] || {
    echo "gpu_profile.sh --rehearse: target/release/lipsync is missing (cargo build --release)" >&2
    exit 1
  }
  python=${LIPSYNC_TORCH_PYTHON:-$(scripts/torch-venv.sh)}
  # The device's limit is on the call, not on building here.
  t0=$SECONDS
  tmp=$(mktemp -d)
  set +e
  # MORE=memory: a bench part run with the LIPSYNC_CONV_* values the comparison picked.
  OUT=$tmp/out LIPSYNC_WORK=$tmp/work LIPSYNC_CARRY_DIR=$tmp/no-carry \
    LIPSYNC_BIN=target/release/lipsync LIPSYNC_PROFILE_TESTS= LIPSYNC_PROFILE_BATCHES=1,2 \
    LIPSYNC_PROFILE_MORE=memory LIPSYNC_PROFILE_TORCH_DEVICE=cpu LIPSYNC_PROFILE_COMPILE=0 \
    LIPSYNC_PROFILE_TORCH_DTYPES=f32 \
    LIPSYNC_PYTHON="$python" LIPSYNC_PROFILE_SECONDS=120 LIPSYNC_PROFILE_TORCH_SECONDS=120 \
    "$0"
  rc=$?
  problems=()
  [ $rc = 0 ] || problems+=("the script exited with status $rc")
  files=$(cd "$tmp/out" && ls -A | sort | tr '\n' ' ')
  [ "$files" = "profile.log.gz profile.md " ] || problems+=("\$OUT holds '$files', not profile.log.gz and profile.md")
  md=$tmp/out/profile.md
  n='[0-9]+(\.[0-9]+)?'
  grep -qE '^\*\*(Stopped by its limit|Exited with status)' "$md" && problems+=("a part stopped or failed")
  grep -qE '^1\. `subpixel:separate:none:on`: --conv-upsampling subpixel --conv-epilogue separate' "$md" \
    || problems+=("the compare section's configurations are missing")
  grep -qE "^\| phases \| f16 \| [a-z0-9 ,]+ \| $n \| $n \| $n \| $n \|" "$md" \
    || problems+=("the planned memory rows are missing")
  grep -qE "^\| f32 \| (nchw|channels_last) \| eager \| 1 \| $n \|" "$md" \
    || problems+=("the PyTorch rows are missing")
  grep -qE "^## PyTorch eager: its CPU operators" "$md" && grep -qE "^\| all \| \| $n \| 100 % \|" "$md" \
    || problems+=("the PyTorch kernel profile is missing")
  grep -qE '^Chosen for serve.s settings below: `subpixel:separate:none:on`' "$md" \
    || problems+=("no configuration was chosen for serve's settings")
  grep -qE '^## serve.s settings subpixel:separate:none:on: `lipsync bench --sections memory' "$md" \
    && grep -qE "^\| subpixel \| f16 \|" "$md" \
    || problems+=("the part with serve's settings did not run")
  [ -s "$tmp/work/defaults.env" ] || problems+=("defaults.env was not written")
  for f in "$tmp/out"/*; do
    [ "$(stat -c %s "$f")" -le $((16 << 20)) ] || problems+=("$(basename "$f") is over 16 MiB")
  done
  took=$((SECONDS - t0))
  [ $took -le 540 ] || problems+=("the rehearsal took $took s (a device call may take 540)")
  echo "----- profile.md -----"
  cat "$md"
  echo "gpu_profile.sh rehearsal: $took s, ${#problems[@]} problem(s)"
  if [ ${#problems[@]} -gt 0 ]; then
    printf '  %s\n' "${problems[@]}" >&2
    echo "files kept in $tmp" >&2
    exit 1
  fi
  rm -rf "$tmp"
  exit 0
fi

OUT=${OUT:-/tmp/lipsync-gpu-out}
WORK=${LIPSYNC_WORK:-/tmp/lipsync-gpu}
CARRY=${LIPSYNC_CARRY_DIR:-target/gpu-carry}
BATCHES=${LIPSYNC_PROFILE_BATCHES:-64,256,512}
TESTS=${LIPSYNC_PROFILE_TESTS-planned_generator_in_f16_auto planned_generator_in_bf16_auto generator_in_f16_nhwc}
CONFIGS=${LIPSYNC_PROFILE_CONFIGS:-}
DEFAULTS=${LIPSYNC_PROFILE_DEFAULTS:-best}
MORE=${LIPSYNC_PROFILE_MORE-instances}
PYTHON=${LIPSYNC_PYTHON:-python3}
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
[ ! -d "$CARRY" ] || python3 bench/gpu_stage.py unpack "$CARRY" "$WORK/bin" >> "$LOG" 2>&1
BIN=${LIPSYNC_BIN:-$WORK/bin/lipsync}
GPU_TEST=${LIPSYNC_GPU_TEST:-$WORK/bin/gpu-test}
[ -x "$BIN" ] || BIN=target/release/lipsync

md "# lipsync GPU run: the model path's comparison" "" "| | |" "|---|---|"
md "| command | \`bench/gpu_profile.sh\` |"
md "| device | $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no GPU') |"
md "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
md "| binaries | $(cat "$CARRY/commit" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown) |" ""

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

configs=()
[ -z "$CONFIGS" ] || configs=(--compare-configs "$CONFIGS")
md "## The configurations in one process: \`lipsync bench --sections memory,compare --dtypes f16 --batches $BATCHES --seconds 1 --conv-upsampling auto --conv-input-pad 8 ${configs[*]}\`" ""
part "${LIPSYNC_PROFILE_SECONDS:-180}" "bench compare" "${RUN[@]}" "$BIN" bench \
  --checkpoint "$WEIGHTS" --sections memory,compare --dtypes f16 --batches "$BATCHES" \
  --seconds 1 --conv-upsampling auto --conv-input-pad 8 \
  "${configs[@]}"
md ""

if [ "$DEFAULTS" = best ]; then
  # The accepted configuration with the most frames/s at the largest batch measured, read
  # from the compare table's rows (written as they are measured, so a part stopped by its
  # limit still counts what it finished).
  DEFAULTS=$(python3 - "$MD" <<'PY' 2>> "$LOG"
import re, sys
rows = []
for line in open(sys.argv[1]):
    m = re.match(r"^\| `([^`]+)` \| (\d+) \| (\d+) \| [^|]* \| [^|]* \| ([^|]*) \|", line)
    if m:
        rows.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip()))
largest = max((r[1] for r in rows), default=0)
ok = [r for r in rows if r[1] == largest and re.match(r"^[0-9.]+$", r[3])]
print(max(ok, key=lambda r: r[2])[0] if ok else "subpixel:separate:none:on")
PY
)
  md "Chosen for serve's settings below: \`$DEFAULTS\` (the accepted configuration with the most frames/s at the largest batch; the old default if none)." ""
fi

# serve's settings for the instance and end-to-end parts: the candidate defaults.
IFS=: read -r up epi pad arena <<< "$DEFAULTS"
export LIPSYNC_CONV_UPSAMPLING=$up LIPSYNC_CONV_EPILOGUE=$epi LIPSYNC_CONV_INPUT_PAD=$pad \
  LIPSYNC_CONV_ARENA=$arena
printf 'export LIPSYNC_CONV_UPSAMPLING=%s LIPSYNC_CONV_EPILOGUE=%s LIPSYNC_CONV_INPUT_PAD=%s LIPSYNC_CONV_ARENA=%s\n' \
  "$up" "$epi" "$pad" "$arena" > "$WORK/defaults.env"
if [ -n "$MORE" ]; then
  ib=${LIPSYNC_PROFILE_INSTANCE_BATCH:-512}
  md "## serve's settings $DEFAULTS: \`lipsync bench --sections $MORE --dtypes f16 --instances 1,3 --instance-batch $((3 * ib))\`" ""
  case ",$MORE," in
    *,instances,*) md "(three instances at batch $ib each, one at $((3 * ib)); device memory in use after every instance has warmed up, contexts included)" "" ;;
  esac
  part "${LIPSYNC_PROFILE_MORE_SECONDS:-90}" "bench $MORE" "${RUN[@]}" "$BIN" bench \
    --checkpoint "$WEIGHTS" --sections "$MORE" --dtypes f16 --instances 1,3 \
    --instance-batch "$((3 * ib))" --seconds 1
  md ""
fi

[ ! -x "$WORK/bin/ffmpeg" ] || export LIPSYNC_FFMPEG=$WORK/bin/ffmpeg
for n in ${LIPSYNC_PROFILE_E2E_INSTANCES:-}; do
  md "## End to end with --instances $n, serve's settings $DEFAULTS: \`lipsync bench --sections e2e --e2e 10,40 --encode-frames 0\`" ""
  LIPSYNC_INSTANCES=$n part "${LIPSYNC_PROFILE_MORE_SECONDS:-90}" "e2e, $n instance(s)" "${RUN[@]}" \
    "$BIN" bench --checkpoint "$WEIGHTS" --sections e2e --e2e 10,40 --encode-frames 0
  md ""
done

if [ "${LIPSYNC_PROFILE_TORCH:-1}" != 0 ] && "$PYTHON" -c 'import torch' 2>/dev/null; then
  device=${LIPSYNC_PROFILE_TORCH_DEVICE:-cuda}
  dtypes=${LIPSYNC_PROFILE_TORCH_DTYPES:-f16}
  tbatches=${LIPSYNC_PROFILE_TORCH_BATCHES:-$BATCHES}
  tlayouts=${LIPSYNC_PROFILE_TORCH_LAYOUTS:-nchw,channels_last}
  compile=(--compile --compile-dtypes f16 --compile-layouts channels_last --budget "${LIPSYNC_PROFILE_TORCH_BUDGET:-75}")
  [ "${LIPSYNC_PROFILE_COMPILE:-1}" != 0 ] || compile=()
  # The kernels of compile at the largest batch (of eager there without compile).
  compile+=(--profile)
  md "## PyTorch ($device), the same weights: \`bench/pytorch_reference.py --dtypes $dtypes --batches $tbatches --layouts $tlayouts ${compile[*]}\`" ""
  part "${LIPSYNC_PROFILE_TORCH_SECONDS:-120}" "pytorch" "$PYTHON" bench/pytorch_reference.py \
    --checkpoint "$WEIGHTS" --device "$device" --dtypes "$dtypes" --batches "$tbatches" --seconds 1 \
    --layouts "$tlayouts" "${compile[@]}"
fi
say "done"
