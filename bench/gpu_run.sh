#!/usr/bin/env bash
# The GPU run, in stages that fit the GPU machine's limits (../.library/device/README.md: at
# most 10 minutes a command, 64 MiB carried, 8 files of at most 16 MiB back from $OUT; python3
# with PyTorch, CUDA 13 and nvidia-smi there, but no Rust, ffmpeg, curl, xz or network).
# docs/GPU-RUN.md is the recipe: what to build and pack here (bench/gpu_pack.sh), what to
# carry, and the calls in order.
#
#   bench/gpu_run.sh STAGE...                 run the stages in order (at most 4 per command)
#   bench/gpu_run.sh --rehearse STAGE...|all  the same stages with the CPU build, tiny sizes and
#                                             a temporary $OUT, then the output rules checked
#
# Stages and their time budgets (LIPSYNC_STAGE_SECONDS overrides every budget):
#   check    60 s  GPU, driver, tools, library resolution, the binary starts and reports its device
#   test    240 s  tests/gpu.rs (carried, prebuilt), then compute-sanitizer memcheck at batch 2
#   model   300 s  lipsync bench, part by part (--sections)
#   torch   240 s  bench/pytorch_reference.py on the same init-weights file
#   service 300 s  the release server, default settings: single requests cold and warm, stage
#                  times (LIPSYNC_SERVICE_LENGTHS, "10 40"; empty skips them), 1/4/16/64
#                  concurrent requests, the same on `serve --device echo` (LIPSYNC_SERVICE_ECHO,
#                  1; empty skips it), the forced out-of-memory request
#                  (LIPSYNC_SERVICE_OOM_LIMIT, 1G; empty skips it)
#   live    240 s  live sessions at 25 fps: 1, 10, 50, 100 (LIPSYNC_LIVE_SESSIONS; or the most
#                  the server takes)
#   media   300 s  `lipsync bench --sections media` with the model (--media-device cuda), then
#                  on the echo device on the same host: 40 s requests by avatar_id on the
#                  512x512 photo, a 1280x720 photo and a 720p clip beside one ffmpeg's encode of
#                  the same video; live sessions speaking half the time (LIPSYNC_MEDIA_SESSIONS,
#                  64,128,192), with the GPU's utilisation sampled during the model's run
#   enhancers 300 s  the enhancers: random checkpoints in the four published Real-ESRGAN layouts
#                  and GFPGANv1.4's (bench/enhancer_checkpoints.py, PyTorch), `lipsync bench
#                  --sections enhancers` on the device: faces/s at batches 1, 16, 64 (GFPGAN:
#                  1 and 4, what a pass takes) and what each adds to 40 s of speech
#                  (tests/gpu.rs checks their passes in the test stage)
#
# Each stage writes exactly two files, $OUT/<stage>.md (Markdown tables: command, device, date,
# results) and $OUT/<stage>.log.gz ($OUT: the device tool sets it; /tmp/lipsync-gpu-out if
# unset); everything else (weights, unpacked binaries, speech, videos) lives under
# $LIPSYNC_WORK (/tmp/lipsync-gpu). A stage runs in its own process group; when
# its budget is spent the whole group (servers and clients included) is killed, the stage
# counts as done (exit 0) and its .md begins with "Stopped by the time guard after N s" and
# keeps what it had measured. A required tool that is missing fails its stage at once with a
# line saying so; the script goes on with the next stage and exits 1 at the end.
#
# Carried files are looked for in $LIPSYNC_CARRY_DIR (target/gpu-carry): NAME.xz, NAME.tar.xz
# and ffmpeg wheels are unpacked into $LIPSYNC_WORK/bin with python3's lzma/tarfile/zipfile:
#   lipsync       the CUDA build (bench/gpu_pack.sh)       LIPSYNC_BIN overrides
#   gpu-test      tests/gpu.rs built with --features cuda  LIPSYNC_GPU_TEST overrides
#   service_load  examples/service_load.rs (CPU build)     LIPSYNC_LOAD_CLIENT overrides
#   ffmpeg, ffprobe  static builds                         LIPSYNC_FFMPEG overrides; else PATH
# shellcheck disable=SC2317 # the stages are called as "stage_$name"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
SELF="$ROOT/bench/gpu_run.sh"
HELPER="$ROOT/bench/gpu_stage.py"
ALL_STAGES=(check test model torch service live media enhancers)
MAX_STAGES=4
CALL_SECONDS=540

budget_of() {
  case $1 in
    check) echo 60 ;;
    test) echo 240 ;;
    model) echo 300 ;;
    torch) echo 240 ;;
    service) echo 300 ;;
    live) echo 240 ;;
    media) echo 300 ;;
    enhancers) echo 300 ;;
    *) return 1 ;;
  esac
}

usage() {
  sed -n '2,/^# shellcheck/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'
}

say() { echo "[$(date -u +%H:%M:%S)] $*"; }

# ---------------------------------------------------------------------------------------------
# Inside a stage (its own process group; stdout and stderr are its log).

# Appends lines to the stage's Markdown.
md() { printf '%s\n' "$@" >> "$BODY"; }

# Seconds left of the stage's budget.
left() { echo $(( STAGE_BUDGET - ($(date +%s) - STAGE_START) )); }

# Marks the stage failed (it goes on where it can) with a line in its Markdown.
fail_line() {
  md "" "**FAILED:** $*"
  say "FAILED: $*"
  STAGE_FAILED=1
}

find_tools() {
  say "unpacking what was carried in $CARRY into $WORK/bin"
  python3 "$HELPER" unpack "$CARRY" "$WORK/bin" || say "unpacking failed (see above)"
  pick() { # first executable of the arguments
    local c
    for c in "$@"; do
      if [ -n "$c" ] && [ -f "$c" ] && [ -x "$c" ]; then
        echo "$c"
        return
      fi
    done
  }
  BIN=$(pick "${LIPSYNC_BIN:-}" "$WORK/bin/lipsync" "$ROOT/target/release/lipsync")
  GPU_TEST=$(pick "${LIPSYNC_GPU_TEST:-}" "$WORK/bin/gpu-test" "$ROOT/target/release/gpu-test")
  CLIENT=$(pick "${LIPSYNC_LOAD_CLIENT:-}" "$WORK/bin/service_load" \
    "$ROOT/target/release/examples/service_load")
  local wheel_ffmpeg
  wheel_ffmpeg=$(find "$WORK/bin" -maxdepth 1 -name 'ffmpeg*' ! -name '*.part' 2>/dev/null | sort | head -1)
  FFMPEG=$(pick "${LIPSYNC_FFMPEG:-}" "$wheel_ffmpeg" "$(command -v ffmpeg 2>/dev/null)")
  FFPROBE=""
  if [ -n "$FFMPEG" ]; then
    local d b
    d=$(dirname "$FFMPEG")
    b=$(basename "$FFMPEG")
    # lipsync looks for ffprobe beside ffmpeg, named alike, else on the PATH.
    FFPROBE=$(pick "$d/${b/ffmpeg/ffprobe}" "$(command -v ffprobe 2>/dev/null)")
    export LIPSYNC_FFMPEG=$FFMPEG
  else
    unset LIPSYNC_FFMPEG
  fi
  say "lipsync: ${BIN:-none}; gpu test: ${GPU_TEST:-none}; load client: ${CLIENT:-none};" \
    "ffmpeg: ${FFMPEG:-none}; ffprobe: ${FFPROBE:-none}"
}

# A required tool: fails the stage at once when it is missing.
require() {
  local what=$1 path=$2 how=$3
  if [ -z "$path" ]; then
    fail_line "$what is required by the $STAGE stage and was not found: $how"
    exit 3
  fi
}

require_ffmpeg() {
  require ffmpeg "$FFMPEG" "carry target/gpu-carry/ffmpeg.tar.xz (bench/gpu_pack.sh) or an \
ffmpeg wheel, set LIPSYNC_FFMPEG, or put ffmpeg on the PATH"
}

# The deterministic random weights every stage measures (and the PyTorch yardstick loads).
ensure_weights() {
  WEIGHTS=$WORK/weights-seed${WEIGHT_SEED}.safetensors
  if [ ! -s "$WEIGHTS" ]; then
    "${RUN[@]}" "$BIN" init-weights "$WEIGHTS.part" --seed "$WEIGHT_SEED" || {
      fail_line "lipsync init-weights failed"
      exit 4
    }
    mv "$WEIGHTS.part" "$WEIGHTS"
  fi
}

# Starts `lipsync serve` (extra flags as arguments) and waits for /ready: sets SRV_PID, URL,
# READY_S. Started directly (no subshell or pipe between), so SRV_PID is the server itself.
start_server() {
  local port
  port=$(python3 "$HELPER" free-port)
  URL=http://127.0.0.1:$port
  "${RUN[@]}" "$BIN" serve --checkpoint "$WEIGHTS" --port "$port" --no-ui "$@" &
  SRV_PID=$!
  echo "$SRV_PID" >> "$STAGE_DIR/server.pids"
  say "server pid $SRV_PID on $URL: serve $*"
  # Waits past the stage's budget: a server still loading when the budget is spent is the
  # time guard's to stop (a stage stopped by its guard, with its files), not a failure that
  # races the guard at the same second. A server that exits fails the wait at once.
  if ! READY_S=$(python3 "$HELPER" wait-ready "$URL" "$(( $(left) + 5 ))" "$SRV_PID"); then
    fail_line "the server (serve $*) did not become ready; its log is in $STAGE.log.gz"
    return 1
  fi
  say "ready after $READY_S s"
}

stop_server() {
  [ -n "${SRV_PID:-}" ] || return 0
  kill -TERM "$SRV_PID" 2>/dev/null
  local i
  for i in $(seq 40); do
    kill -0 "$SRV_PID" 2>/dev/null || break
    sleep 0.25
  done
  kill -KILL "$SRV_PID" 2>/dev/null
  wait "$SRV_PID" 2>/dev/null
  SRV_PID=""
}

# Samples GPU memory and utilisation (nvidia-smi), and the resident memory and process-tree
# CPU of $2 (the server, $SRV_PID, unless given) until stop_mem; $1 tags the sample file.
start_mem() {
  MEM_FILE=$STAGE_DIR/mem-$1.json
  rm -f "$MEM_FILE"
  python3 "$HELPER" sample-mem "${2:-$SRV_PID}" "$MEM_FILE" &
  MEM_PID=$!
}

stop_mem() {
  kill "$MEM_PID" 2>/dev/null
  wait "$MEM_PID" 2>/dev/null
  python3 "$HELPER" mem-md "$MEM_FILE"
}

# Rows printed by service_load (a header and its rule first): into the stage's Markdown,
# the header only for the first rows after new_table.
new_table() { TABLE_OPEN=0; }
add_rows() {
  if [ "$TABLE_OPEN" = 0 ]; then
    printf '%s\n' "$1" >> "$BODY"
    TABLE_OPEN=1
  else
    printf '%s\n' "$1" | tail -n +3 >> "$BODY"
  fi
}

# Speech of N seconds (the arctic sentence looped), under $WORK.
speech() {
  local f=$WORK/speech-$1s.wav
  [ -s "$f" ] || python3 "$HELPER" wav "$1" tests/media/arctic_a0007.wav "$f"
  echo "$f"
}

# ---------------------------------------------------------------------------------------------
# The stages.

stage_check() {
  md "## GPU" ""
  if command -v nvidia-smi >/dev/null; then
    local q
    if q=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1); then
      md "| name | driver | memory | compute capability |" "|---|---|---|---|"
    elif q=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
      md "| name | driver | memory |" "|---|---|---|"
    else
      fail_line "nvidia-smi failed: $q"
      q=""
    fi
    [ -z "$q" ] || printf '%s\n' "$q" | sed 's/, / | /g; s/^/| /; s/$/ |/' >> "$BODY"
  else
    md "| nvidia-smi | |" "|---|---|" "| not found | no NVIDIA driver here${LIPSYNC_REHEARSE:+ (CPU rehearsal)} |"
  fi
  md "" "## Tools" "" "| tool | found |" "|---|---|"
  local t v
  for t in python3 nvcc compute-sanitizer ncu nvidia-smi; do
    if command -v "$t" >/dev/null; then
      v=$(timeout 20 "$t" --version 2>&1 | grep -v '^\s*$' | tail -1)
      md "| $t | $(command -v "$t"): ${v//|//} |"
    else
      md "| $t | not installed |"
    fi
  done
  v=$(timeout 60 "$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda,
"cudnn", torch.backends.cudnn.version(), "gpu", torch.cuda.is_available())' 2>&1 | tail -1)
  md "| torch ($PYTHON) | ${v//|//} |"
  md "| ffmpeg | ${FFMPEG:-not found}${FFMPEG:+: $("$FFMPEG" -hide_banner -version 2>&1 | head -1)} |"
  md "| ffprobe | ${FFPROBE:-not found} |"
  md "| lipsync | ${BIN:-not found} |" "| gpu test | ${GPU_TEST:-not found} |"
  md "| load client | ${CLIENT:-not found} |"
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"

  md "" "## Libraries" ""
  if [ ${#RUN[@]} -gt 0 ]; then
    local libpath
    # shellcheck disable=SC2016 # expanded by the inner shell
    libpath=$("${RUN[@]}" sh -c 'echo "$LD_LIBRARY_PATH"' 2>&1) \
      || fail_line "${RUN[*]} cannot find PyTorch's CUDA libraries: $libpath"
    md "\`${RUN[*]}\` sets LD_LIBRARY_PATH=\`$libpath\`" ""
  fi
  local ldd_out
  if ! command -v ldd > /dev/null; then
    md "ldd is not installed: library resolution not shown (the binary's start below tells)."
  else
    ldd_out=$("${RUN[@]}" ldd "$BIN" 2>&1)
    printf '%s\n' "$ldd_out"
    printf '%s\n' "$ldd_out" | python3 "$HELPER" ldd-md >> "$BODY"
    if grep -q '=> not found' <<< "$ldd_out"; then
      fail_line "libraries not found: $(grep '=> not found' <<< "$ldd_out" | awk '{print $1}' | xargs)"
    fi
  fi

  md "" "## The binary starts and reports its device" ""
  md "\`$(basename "$BIN") --version\`: $("${RUN[@]}" "$BIN" --version 2>&1 | head -1)" ""
  ensure_weights
  if start_server --instances 1 --max-batch 2 --first-batch 1; then
    md "\`serve --instances 1 --max-batch 2 --first-batch 1\`: ready after $READY_S s" ""
    python3 "$HELPER" info-md "$URL" >> "$BODY" || fail_line "GET /info failed"
    local device
    device=$(python3 "$HELPER" get "$URL/info" | python3 -c 'import json, sys; print(json.load(sys.stdin)["device"])')
    if [ -z "${LIPSYNC_REHEARSE:-}" ] && [ "$device" != cuda ]; then
      fail_line "the binary runs on '$device', not cuda: it sees no GPU (a CPU build, or no driver)"
    fi
    stop_server
  fi
}

stage_test() {
  require "the GPU test binary" "$GPU_TEST" "carry target/gpu-carry/gpu-test.xz (bench/gpu_pack.sh)"
  local out=$STAGE_DIR/test.out rc
  md "## $TEST_TITLE" "" "\`$(basename "$GPU_TEST") --test-threads=1 --nocapture\`" ""
  local t0=$SECONDS
  "${RUN[@]}" "$GPU_TEST" --test-threads=1 --nocapture 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  python3 "$HELPER" test-md "$out" >> "$BODY"
  md "" "Exit status $rc after $((SECONDS - t0)) s."
  [ "$rc" = 0 ] || fail_line "the test binary exited with status $rc"

  md "" "## compute-sanitizer memcheck, batch 2 (\`$MEMCHECK_FILTER\`)" ""
  if ! command -v compute-sanitizer >/dev/null; then
    md "| memcheck | |" "|---|---|" "| not run | compute-sanitizer is not installed here |"
  elif [ "$(left)" -lt 45 ]; then
    md "| memcheck | |" "|---|---|" "| not run | $(left) s of the budget left |"
  else
    # At most LIPSYNC_MEMCHECK_SECONDS (120), so that the first call stays short.
    local limit=$(( $(left) - 15 )) mout=$STAGE_DIR/memcheck.out
    [ "$limit" -le "${LIPSYNC_MEMCHECK_SECONDS:-120}" ] || limit=${LIPSYNC_MEMCHECK_SECONDS:-120}
    t0=$SECONDS
    LIPSYNC_GPU_TEST_BATCHES=2 timeout "$limit" "${RUN[@]}" compute-sanitizer --tool memcheck \
      "$GPU_TEST" --test-threads=1 --nocapture "$MEMCHECK_FILTER" 2>&1 | tee "$mout"
    rc=${PIPESTATUS[0]}
    local summary
    summary=$(grep -E 'ERROR SUMMARY|not supported|error' "$mout" | tail -1)
    md "| memcheck | exit status | seconds | summary |" "|---|---|---|---|"
    md "| $MEMCHECK_FILTER | $rc$([ "$rc" = 124 ] && echo ' (stopped at the budget)') | $((SECONDS - t0)) | ${summary//|//} |"
  fi
  if command -v ncu >/dev/null; then
    md "" "ncu: $(command -v ncu) (not used by this stage)."
  else
    md "" "ncu: not installed."
  fi
}

stage_model() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  local sections=${LIPSYNC_BENCH_SECTIONS:-model,instances,accuracy,autotune,encoder,e2e}
  case ",$sections," in
    *,encoder,* | *,e2e,*) require_ffmpeg ;;
  esac
  ensure_weights
  local s rc
  for s in ${sections//,/ }; do
    local args=()
    case $s in
      model) args=(--dtypes "$DTYPES" --batches "$BATCHES" --seconds "$BENCH_SECONDS") ;;
      instances) args=(--instances "$INSTANCES" --instance-batch "$INSTANCE_BATCH" --seconds "$BENCH_SECONDS") ;;
      accuracy) args=(--dtypes "$DTYPES" --accuracy-inputs "$WORK/accuracy-inputs.safetensors") ;;
      autotune) args=(--batches "$BATCHES") ;;
      encoder)
        args=(--encode-frames "$ENCODE_FRAMES")
        [ -z "$ENCODER_WORKERS" ] || args+=(--encoder-workers "$ENCODER_WORKERS")
        ;;
      e2e) args=(--e2e "$E2E" --encode-frames 0) ;;
    esac
    md "" "\`lipsync bench --sections $s ${args[*]}\`" ""
    say "bench --sections $s ${args[*]}"
    "${RUN[@]}" "$BIN" bench --checkpoint "$WEIGHTS" --sections "$s" "${args[@]}" \
      --json "$STAGE_DIR/bench-$s.json" >> "$BODY"
    rc=$?
    [ "$rc" = 0 ] || fail_line "\`lipsync bench --sections $s\` exited with status $rc (its stderr is in $STAGE.log.gz)"
  done
}

stage_torch() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    fail_line "PyTorch is required by the torch stage: \`$PYTHON -c 'import torch'\` failed"
    exit 3
  fi
  ensure_weights
  local args=(--checkpoint "$WEIGHTS" --device "$TORCH_DEVICE" --dtypes "$TORCH_DTYPES"
    --batches "$TORCH_BATCHES" --seconds "$BENCH_SECONDS" --json "$STAGE_DIR/pytorch.json")
  # The bench's accuracy inputs, when the model stage ran before in this call.
  if [ -s "$WORK/accuracy-inputs.safetensors" ]; then
    args+=(--inputs "$WORK/accuracy-inputs.safetensors")
  fi
  # The compile runs (minutes) only where their start fits the budget.
  args+=("${TORCH_EXTRA[@]}" --budget "$(( $(left) - 60 ))")
  md "\`python3 bench/pytorch_reference.py ${args[*]}\`" ""
  local rc
  PYTHONUNBUFFERED=1 "$PYTHON" bench/pytorch_reference.py "${args[@]}" >> "$BODY"
  rc=$?
  [ "$rc" = 0 ] || fail_line "bench/pytorch_reference.py exited with status $rc"
}

stage_enhancers() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  require_ffmpeg
  if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    fail_line "PyTorch is required by the enhancers stage: \`$PYTHON -c 'import torch'\` failed"
    exit 3
  fi
  local dir=$WORK/enhancers rc
  md "\`python3 bench/enhancer_checkpoints.py --out enhancers --only ${ENHANCERS}\`" ""
  # shellcheck disable=SC2086 # a list of stems
  "$PYTHON" bench/enhancer_checkpoints.py --out "$dir" --only $ENHANCERS \
    || { fail_line "bench/enhancer_checkpoints.py failed"; exit 4; }
  local args=(--device "$ENHANCE_DEVICE" --sections enhancers --enhance-seconds "$ENHANCE_SECONDS"
    --audio tests/media/arctic_a0007.wav --image tests/media/astronaut.png "${ENHANCE_EXTRA[@]}") e
  for e in $ENHANCERS; do args+=(--enhancer-checkpoint "$dir/$e.pth"); done
  md "\`lipsync bench ${args[*]//$dir\//}\`" ""
  say "bench ${args[*]}"
  "${RUN[@]}" "$BIN" bench "${args[@]}" --json "$STAGE_DIR/bench-enhancers.json" >> "$BODY"
  rc=$?
  [ "$rc" = 0 ] || fail_line "\`lipsync bench --sections enhancers\` exited with status $rc (its stderr is in $STAGE.log.gz)"
}

# `service_load` output rows, with two more cells: the memory sampled meanwhile.
client_rows_with_mem() {
  local tag=$1
  shift
  start_mem "$tag"
  local rows rc
  rows=$("$CLIENT" "$@")
  rc=$?
  local mem
  mem=$(stop_mem)
  while IFS= read -r r; do
    case $r in
      "| label"*) echo "$r max GPU MiB | GPU util mean / max % | server CPU cores | max server RSS MiB |" ;;
      "|---"*) echo "$r---|---|---|---|" ;;
      "|"*) echo "$r $mem |" ;;
    esac
  done <<< "$rows"
  return "$rc"
}

# The levels of $CONCURRENCY on the running server, one table; $2 (e.g. echo) labels the rows.
concurrent_levels() {
  local photo=$1 tag=${2:+$2, } c rows
  new_table
  for c in $CONCURRENCY; do
    rows=$(client_rows_with_mem "${2:+$2-}c$c" http --url "$URL" --audio "$(speech "$CONC_SECONDS")" \
      --image "$photo" --concurrency "$c" --retry-429 --label "$tag$c at once") \
      || fail_line "service_load http${2:+ on $2} at concurrency $c failed"
    add_rows "$rows"
  done
}

stage_service() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  require "the load client" "$CLIENT" "carry target/gpu-carry/service_load.xz (bench/gpu_pack.sh)"
  require_ffmpeg
  ensure_weights
  local photo=tests/media/astronaut.png wide=$WORK/astronaut-1280x720.png clip=tests/media/carphone.mp4
  if [ ! -s "$wide" ]; then
    "$FFMPEG" -hide_banner -loglevel error -y -i "$photo" \
      -vf 'scale=-2:720,pad=1280:720:(ow-iw)/2:0' "$wide" || fail_line "ffmpeg could not make the 1280x720 photo"
  fi
  local avatars=("image:$photo:512x512 photo" "image:$wide:1280x720 photo")
  if [ -n "$FFPROBE" ]; then
    avatars+=("video:$clip:clip (carphone.mp4)")
  else
    md "Clip rows not run: ffprobe was not found beside ffmpeg (carry ffmpeg.tar.xz, which holds both)." ""
  fi
  local cache=cold
  [ -s "$WORK/autotune.json" ] && cache="written by an earlier stage on this machine"
  start_server --autotune-cache "$WORK/autotune.json" || return 1
  md "## Server" "" "\`lipsync serve --autotune-cache FILE\`, otherwise its defaults (the Docker image" \
    "sets the cache file too)$(conv_env): ready (loaded and warmed up) after $READY_S s; autotune cache" \
    "$cache." ""
  python3 "$HELPER" info-md "$URL" >> "$BODY"
  python3 "$HELPER" metrics-md "$URL" --save "$STAGE_DIR/m0.json" > /dev/null

  local a kind file name len rows
  if [ -n "$LENGTHS" ]; then
    md "" "## Single requests, one at a time" ""
    md "Each request sends the speech and the photo or clip, so each prepares its avatar (face" \
      "detection; for the clip, every frame). Run 1 is the first request of its row on this" \
      "server (the very first row's is the server's first request: cold), run 2 the same again." ""
    new_table
    for a in "${avatars[@]}"; do
      kind=${a%%:*}
      file=${a#*:}
      file=${file%%:*}
      name=${a##*:}
      for len in $LENGTHS; do
        rows=$("$CLIENT" http --url "$URL" --audio "$(speech "$len")" "--$kind" "$file" \
          --concurrency 1 --repeat 2 --label "$name, $len s") \
          || fail_line "service_load http ($name, $len s) failed"
        add_rows "$rows"
      done
    done
    md "" "### Stage times from /metrics (these requests)" ""
  fi
  python3 "$HELPER" metrics-md "$URL" --since "$STAGE_DIR/m0.json" --save "$STAGE_DIR/m1.json" > "$STAGE_DIR/m1.md"
  [ -z "$LENGTHS" ] || cat "$STAGE_DIR/m1.md" >> "$BODY"

  md "" "## Concurrent requests ($CONC_SECONDS s of speech, 512x512 photo)" ""
  md "All requests of a level start at once; 429 answers are retried after Retry-After." ""
  concurrent_levels "$photo" ""
  md "" "### Stage times from /metrics (the concurrent requests)" ""
  python3 "$HELPER" metrics-md "$URL" --since "$STAGE_DIR/m1.json" >> "$BODY"
  stop_server

  if [ -n "$SERVICE_ECHO" ]; then
    # The same levels with the model stand-in: the media side's share of the rows above.
    start_server --device echo || return 1
    md "" "## The same concurrent requests on \`serve --device echo\` (the media side alone)" "" \
      "Ready after $READY_S s." ""
    concurrent_levels "$photo" echo
    stop_server
  fi

  [ -n "$OOM_LIMIT" ] || return 0
  md "" "## Forced out of memory: \`--gpu-memory-limit $OOM_LIMIT\`" ""
  md "A batch estimated over the limit is out of memory: warm-up lowers the instance's batch" \
    "limit, a request's batch is split and retried smaller; the request completes." ""
  start_server --gpu-memory-limit "$OOM_LIMIT" --autotune-cache "$WORK/autotune.json" || return 1
  md "Ready after $READY_S s." ""
  python3 "$HELPER" metrics-md "$URL" --save "$STAGE_DIR/m2.json" > /dev/null
  "$CLIENT" http --url "$URL" --audio "$(speech "$CONC_SECONDS")" --image "$photo" \
    --label "limit $OOM_LIMIT" >> "$BODY" || fail_line "the out-of-memory request failed"
  md "" "The server's out-of-memory lines:" "" '```'
  sed 's/\x1b\[[0-9;]*m//g' "$STAGE_DIR/log" | grep -aE 'out of (device )?memory' | tail -n 8 | cut -c1-240 >> "$BODY"
  md '```' ""
  python3 "$HELPER" metrics-md "$URL" --since "$STAGE_DIR/m2.json" --only \
    lipsync_oom,lipsync_requests_total,lipsync_frames_total,lipsync_precision,lipsync_batch_frames >> "$BODY"
  stop_server
}

stage_live() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  require "the load client" "$CLIENT" "carry target/gpu-carry/service_load.xz (bench/gpu_pack.sh)"
  require_ffmpeg
  ensure_weights
  start_server --autotune-cache "$WORK/autotune.json" || return 1
  local max
  max=$(python3 "$HELPER" get "$URL/info" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sessions"]["max_sessions"])')
  md "## Live sessions" "" "\`lipsync serve --autotune-cache FILE\`, otherwise its defaults$(conv_env) (ready after $READY_S s):" \
    "--max-sessions is $max (from the warm-up's batch times). Each session: 1 s of idle video," \
    "then $LIVE_SECONDS s of speech in 20 ms messages paced in real time, fMP4 back; a level's" \
    "sessions open over 1 s. Latency: an audio chunk sent → the fragment holding its first" \
    "drawn frame received, all chunks of all sessions pooled." ""
  local levels=() n
  for n in $SESSIONS; do
    if [ "$n" -ge "$max" ]; then
      levels+=("$max")
      break
    fi
    levels+=("$n")
  done
  python3 "$HELPER" metrics-md "$URL" --save "$STAGE_DIR/m0.json" > /dev/null
  local rows
  new_table
  for n in "${levels[@]}"; do
    rows=$(client_rows_with_mem "s$n" live --url "$URL" --audio "$(speech "$LIVE_SECONDS")" \
      --image tests/media/astronaut.png --sessions "$n" "${LIVE_EXTRA[@]}" --label "$n session$([ "$n" = 1 ] || echo s)") \
      || fail_line "service_load live with $n sessions failed"
    add_rows "$rows"
  done
  md "" "### From /metrics (all levels)" ""
  python3 "$HELPER" metrics-md "$URL" --since "$STAGE_DIR/m0.json" >> "$BODY"
  stop_server
}

# `lipsync bench --sections media` on a device, its Markdown into the stage's; the GPU's
# utilisation and memory sampled meanwhile (the bench's process tree holds the servers).
media_bench() {
  local device=$1
  shift
  local args=(bench --sections media --media-device "$device" --ffmpeg "$FFMPEG"
    --media-seconds "$MEDIA_SECONDS" --media-repeats "$MEDIA_REPEATS" --media-parts "$MEDIA_PARTS"
    --live-sessions "$MEDIA_SESSIONS" --live-seconds "$MEDIA_LIVE_SECONDS"
    --live-avatars "$MEDIA_LIVE_AVATARS" --live-outputs "$MEDIA_LIVE_OUTPUTS" "$@")
  say "lipsync ${args[*]}"
  "${RUN[@]}" "$BIN" "${args[@]}" > "$STAGE_DIR/media-$device.md" &
  local pid=$!
  start_mem "media-$device" "$pid"
  wait "$pid"
  local rc=$?
  local mem
  mem=$(stop_mem)
  md "\`lipsync ${args[*]}\`" ""
  sed 's/\x1b\[[0-9;]*m//g' "$STAGE_DIR/media-$device.md" >> "$BODY"
  md "" "Sampled during this run (the bench and its servers): max GPU MiB | GPU util mean / max % |" \
    "CPU cores | max RSS MiB of the bench itself: $mem" ""
  [ "$rc" = 0 ] || fail_line "lipsync bench --sections media --media-device $device exited with status $rc"
}

stage_media() {
  require lipsync "$BIN" "carry target/gpu-carry/lipsync.xz (bench/gpu_pack.sh)"
  require_ffmpeg
  [ -n "$FFPROBE" ] || fail_line "ffprobe was not found beside ffmpeg (carry ffmpeg.tar.xz, which holds both)"
  ensure_weights
  local cache=cold
  [ -s "$WORK/autotune.json" ] && cache="written by an earlier stage on this machine"
  md "## The service with its model, then on the echo device (same host, same client)" "" \
    "Each server is \`lipsync serve\` with its defaults$(conv_env) and, with the model," \
    "\`--autotune-cache FILE\` (autotune cache $cache); the bench starts a fresh one for the" \
    "requests and for each live level. Requests name their avatar by \`avatar_id\`." ""
  media_bench "$MEDIA_DEVICE" --checkpoint "$WEIGHTS" \
    "--media-serve-arg=--autotune-cache=$WORK/autotune.json" "${MEDIA_MODEL_EXTRA[@]}"
  md "" "## The same on the echo device (the media side alone)" ""
  media_bench echo
}

# ---------------------------------------------------------------------------------------------
# The driver.

# Sizes: the GPU run's, or the rehearsal's tiny ones.
set_sizes() {
  WEIGHT_SEED=7
  if [ -n "${LIPSYNC_REHEARSE:-}" ]; then
    RUN=()
    DTYPES=f32 BATCHES=1,2 BENCH_SECONDS=0.3 INSTANCES=1,2 INSTANCE_BATCH=2
    ENCODE_FRAMES=50 ENCODER_WORKERS=1,2 E2E=1
    TORCH_DEVICE=cpu TORCH_DTYPES=f32 TORCH_BATCHES=1 TORCH_EXTRA=(--layouts nchw)
    # 950M: the estimate (src/engine/pool.rs, cuDNN's workspace counted) fits f32 batches of
    # 4 and not 8 or 16, so the warm-up meets the limit and lowers the batches.
    # One length: each is six single requests on the CPU model (2 s of speech added 25 s).
    LENGTHS="1" CONCURRENCY="1 2" CONC_SECONDS=1 OOM_LIMIT=950M SERVICE_ECHO=1
    SESSIONS="1 2" LIVE_SECONDS=2
    MEDIA_DEVICE=cpu MEDIA_SECONDS=1 MEDIA_REPEATS=1 MEDIA_PARTS=requests,live MEDIA_SESSIONS=1
    MEDIA_LIVE_SECONDS=4 MEDIA_LIVE_AVATARS=photo MEDIA_LIVE_OUTPUTS=fmp4
    # Any drawing rate: the CPU draws fewer faces than two sessions' default minimum (5 each),
    # and on a slow 2-core machine fewer than one session's.
    LIVE_EXTRA=(--min-draw-fps 0)
    MEDIA_MODEL_EXTRA=(--live-min-draw-fps 0)
    TEST_TITLE="CPU tests of the same layers (tests/model.rs; the GPU test needs a GPU)"
    MEMCHECK_FILTER=${LIPSYNC_MEMCHECK_FILTER:-f16_on_cpu_stays_close_to_f32}
    # The compact networks only: RRDBNet takes seconds per face on two cores.
    # GFPGAN takes 2.5-5 s a face on two cores: batch 1 only (4 faces; 1 and 4 took 20 faces,
    # 100 s of a 175 s stage in CI's rehearsal), and 0.2 s of speech (2 drawn frames).
    ENHANCERS="realesr-animevideov3 GFPGANv1.4" ENHANCE_SECONDS=0.2 ENHANCE_DEVICE=cpu
    ENHANCE_EXTRA=(--batches 1)
  else
    RUN=("$ROOT/scripts/run-on-gpu.sh")
    DTYPES=f32,f16,bf16 BATCHES=1,16,64,256,512 BENCH_SECONDS=1.5 INSTANCES=1,3 INSTANCE_BATCH=384
    ENCODE_FRAMES=500 ENCODER_WORKERS="" E2E=10,40
    TORCH_DEVICE=cuda TORCH_DTYPES=f32,f16,bf16 TORCH_BATCHES=1,16,64,256,512
    TORCH_EXTRA=(--layouts "nchw,channels_last" --compile --compile-dtypes f16
      --compile-layouts channels_last --max-autotune)
    LENGTHS=${LIPSYNC_SERVICE_LENGTHS-10 40} CONCURRENCY="1 4 16 64" CONC_SECONDS=10
    OOM_LIMIT=${LIPSYNC_SERVICE_OOM_LIMIT-1G} SERVICE_ECHO=${LIPSYNC_SERVICE_ECHO-1}
    SESSIONS=${LIPSYNC_LIVE_SESSIONS:-1 10 50 100} LIVE_SECONDS=8
    LIVE_EXTRA=()
    MEDIA_MODEL_EXTRA=()
    MEDIA_DEVICE=cuda MEDIA_SECONDS=40 MEDIA_REPEATS=${LIPSYNC_MEDIA_REPEATS:-1}
    MEDIA_PARTS=${LIPSYNC_MEDIA_PARTS:-requests,live} MEDIA_SESSIONS=${LIPSYNC_MEDIA_SESSIONS:-64,128,192}
    MEDIA_LIVE_SECONDS=12 MEDIA_LIVE_AVATARS=${LIPSYNC_MEDIA_LIVE_AVATARS:-photo}
    MEDIA_LIVE_OUTPUTS=${LIPSYNC_MEDIA_LIVE_OUTPUTS:-fmp4}
    TEST_TITLE="GPU test (tests/gpu.rs)"
    MEMCHECK_FILTER=${LIPSYNC_MEMCHECK_FILTER:-generator_in_f16}
    ENHANCERS="realesr-general-x4v3 realesr-animevideov3 RealESRGAN_x4plus RealESRGAN_x2plus GFPGANv1.4"
    ENHANCE_SECONDS=40 ENHANCE_DEVICE=cuda ENHANCE_EXTRA=()
  fi
  PYTHON=${LIPSYNC_PYTHON:-python3}
}

device_line() {
  local g
  if command -v nvidia-smi >/dev/null \
    && g=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1) \
    && [ -n "$g" ]; then
    echo "$g (driver); $(nproc) CPU cores"
  else
    local why="nvidia-smi found none"
    [ -z "${LIPSYNC_REHEARSE:-}" ] || why="CPU rehearsal"
    echo "no GPU ($why): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
  fi
}

# Runs one stage under its budget; writes $OUT/<stage>.md and $OUT/<stage>.log.gz.
run_stage() {
  local stage=$1 budget
  budget=${LIPSYNC_STAGE_SECONDS:-$(budget_of "$stage")}
  STAGE_DIR=$WORK/stage-$stage
  rm -rf "$STAGE_DIR"
  mkdir -p "$STAGE_DIR"
  local log=$STAGE_DIR/log body=$STAGE_DIR/body.md
  : > "$body"
  local start
  start=$(date +%s)
  say "stage $stage: budget $budget s"
  set -m
  (
    set +m
    export STAGE=$stage STAGE_DIR BODY=$body STAGE_START=$start STAGE_BUDGET=$budget
    STAGE_FAILED=0
    find_tools
    "stage_$stage"
    rc=$?
    [ "$rc" = 0 ] || [ "$STAGE_FAILED" = 1 ] || fail_line "the stage ended with status $rc"
    [ "$STAGE_FAILED" = 0 ]
  ) > "$log" 2>&1 < /dev/null &
  local pid=$!
  set +m
  local guarded=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(( $(date +%s) - start )) -ge "$budget" ]; then
      guarded=1
      echo "[$(date -u +%H:%M:%S)] time guard: $budget s spent, killing the stage's process group" >> "$log"
      kill -TERM -- "-$pid" 2>/dev/null
      sleep 2
      kill -KILL -- "-$pid" 2>/dev/null
      break
    fi
    sleep 0.5
  done
  wait "$pid"
  local rc=$?
  # Whatever the stage left running (a server, a sampler) goes with it.
  kill -KILL -- "-$pid" 2>/dev/null
  local took=$(( $(date +%s) - start ))
  local md=$OUT/$stage.md status
  if [ $guarded = 1 ]; then
    status="stopped by the time guard after $budget s"
    rc=0
  elif [ $rc = 0 ]; then
    status="done in $took s"
  else
    status="FAILED after $took s (exit status $rc)"
  fi
  {
    if [ $guarded = 1 ]; then
      echo "Stopped by the time guard after $budget s"
      echo
    fi
    echo "# lipsync GPU run: stage \`$stage\`"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| command | \`bench/gpu_run.sh ${STAGE_LIST[*]}\`${LIPSYNC_REHEARSE:+ (rehearsal: CPU build, tiny sizes)} |"
    echo "| device | $(device_line) |"
    echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
    echo "| commit | tree $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)");" \
      "binaries $(cat "$CARRY/commit" 2>/dev/null || echo "built from this checkout") |"
    echo "| stage | $status; budget $budget s |"
    echo
    cat "$body"
    if [ $guarded = 1 ]; then
      echo
      echo "## The log's last lines when the guard stopped the stage"
      echo
      echo '```'
      tail -n 25 "$log" | cut -c1-300
      echo '```'
    fi
  } > "$md"
  python3 "$HELPER" gz "$log" "$OUT/$stage.log.gz"
  say "stage $stage: $status -> $md, $OUT/$stage.log.gz"
  return $rc
}

main() {
  case "${1:-}" in
    "" | -h | --help)
      usage
      [ -n "${1:-}" ]
      exit $?
      ;;
    --rehearse)
      shift
      rehearse "$@"
      exit $?
      ;;
  esac
  STAGE_LIST=("$@")
  local s total=0
  for s in "${STAGE_LIST[@]}"; do
    if ! budget_of "$s" > /dev/null; then
      echo "gpu_run.sh: unknown stage '$s' (stages: ${ALL_STAGES[*]})" >&2
      exit 1
    fi
    total=$(( total + ${LIPSYNC_STAGE_SECONDS:-$(budget_of "$s")} ))
  done
  if [ ${#STAGE_LIST[@]} -gt $MAX_STAGES ]; then
    echo "gpu_run.sh: ${#STAGE_LIST[@]} stages in one command: at most $MAX_STAGES (8 files" \
      "come back from one command); split them over several calls (docs/GPU-RUN.md)" >&2
    exit 1
  fi
  if [ $total -gt $CALL_SECONDS ]; then
    echo "gpu_run.sh: warning: these budgets add up to $total s, over the $CALL_SECONDS s a" \
      "command should take (10 minutes at most per call)" >&2
  fi
  OUT=${OUT:-/tmp/lipsync-gpu-out}
  WORK=${LIPSYNC_WORK:-/tmp/lipsync-gpu}
  CARRY=${LIPSYNC_CARRY_DIR:-$ROOT/target/gpu-carry}
  mkdir -p "$OUT" "$WORK"
  OUT=$(cd "$OUT" && pwd)
  WORK=$(cd "$WORK" && pwd)
  export OUT WORK CARRY
  set_sizes
  local failed=0
  for s in "${STAGE_LIST[@]}"; do
    run_stage "$s" || failed=1
  done
  exit $failed
}

# ---------------------------------------------------------------------------------------------
# The rehearsal: every stage with the CPU build, tiny sizes, a temporary $OUT, in the groups
# docs/GPU-RUN.md runs them, then the output rules and the time guard checked.
rehearse() {
  local t_start=$SECONDS
  local want=("$@")
  if [ ${#want[@]} = 0 ] || [ "${want[0]}" = all ]; then want=("${ALL_STAGES[@]}"); fi
  local s
  for s in "${want[@]}"; do
    budget_of "$s" > /dev/null || { echo "gpu_run.sh: unknown stage '$s'" >&2; return 1; }
  done
  has() { local x; for x in "${want[@]}"; do [ "$x" = "$1" ] && return 0; done; return 1; }
  local tmp
  tmp=$(mktemp -d /tmp/lipsync-rehearsal.XXXXXX)
  local errors=0
  bad() { echo "REHEARSAL: $*" >&2; errors=$((errors + 1)); }
  say "rehearsal in $tmp: ${want[*]}"

  # What the GPU run carries, built for the CPU and packed the same way (xz, tar.xz): the
  # release binary, the load client and the CPU test binary, in the release profile without the
  # fault hooks (on top of the dependencies scripts/test.sh built: about a minute on 2 cores).
  # LIPSYNC_REHEARSE_BUILD=0 takes the binaries already built (to rehearse script changes).
  say "building the CPU release binary, the load client and the CPU test binary"
  local build=${LIPSYNC_REHEARSE_BUILD:-1}
  [ "$build" = 0 ] || cargo build --release --locked || return 1
  local carry=$tmp/carry
  mkdir -p "$carry"
  python3 "$HELPER" xz target/release/lipsync "$carry/lipsync.xz" || return 1
  if has service || has live; then
    local client=target/release/examples/service_load
    [ "$build" = 0 ] || cargo build --release --locked --example service_load || return 1
    python3 "$HELPER" xz "$client" "$carry/service_load.xz" || return 1
  fi
  if has test; then
    local test_bin
    if [ "$build" = 0 ]; then
      # shellcheck disable=SC2010,SC2012 # file names of cargo's own making
      test_bin=$(ls -t target/release/deps/model-* | grep -v '[.]d$' | head -1)
    else
      test_bin=$(cargo test --release --locked --test model --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "model" and m.get("executable"):
        print(m["executable"])' | tail -1)
    fi
    [ -x "$test_bin" ] || { bad "the CPU test binary (tests/model.rs) was not built"; return 1; }
    python3 "$HELPER" xz "$test_bin" "$carry/gpu-test.xz" || return 1
  fi
  if has model || has service || has live || has media || has enhancers; then
    local ff fp
    ff=$(command -v ffmpeg) fp=$(command -v ffprobe)
    if [ -z "$ff" ] || [ -z "$fp" ]; then
      bad "ffmpeg and ffprobe are needed on the PATH (scripts/test.sh installs them)"
      return 1
    fi
    python3 "$HELPER" tar-xz "$carry/ffmpeg.tar.xz" "$ff" "$fp" || return 1
  fi
  # CPU PyTorch for the torch stage: the venv scripts/test.sh made (scripts/torch-venv.sh makes
  # it when missing), or LIPSYNC_TORCH_PYTHON.
  local python=python3
  if has torch || has enhancers; then
    python=${LIPSYNC_TORCH_PYTHON:-$(scripts/torch-venv.sh)} \
      || { bad "no CPU PyTorch for the torch and enhancers stages (scripts/torch-venv.sh failed)"; return 1; }
  fi
  local t_built=$SECONDS
  say "built and packed in $((t_built - t_start)) s"

  local env=(LIPSYNC_REHEARSE=1 LIPSYNC_CARRY_DIR="$carry" LIPSYNC_WORK="$tmp/work"
    LIPSYNC_PYTHON="$python" LIPSYNC_BIN= LIPSYNC_GPU_TEST= LIPSYNC_LOAD_CLIENT= LIPSYNC_FFMPEG=
    LIPSYNC_STAGE_SECONDS= )
  local groups=("check test" "model torch" "service live media" "enhancers") g i=0
  for g in "${groups[@]}"; do
    local stages=() x
    for x in $g; do has "$x" && stages+=("$x"); done
    [ ${#stages[@]} -gt 0 ] || continue
    i=$((i + 1))
    local out=$tmp/out$i t0=$SECONDS rc
    mkdir -p "$out"
    say "call $i: bench/gpu_run.sh ${stages[*]}"
    env "${env[@]}" OUT="$out" "$SELF" "${stages[@]}"
    rc=$?
    say "call $i took $((SECONDS - t0)) s, exit status $rc"
    [ $rc = 0 ] || bad "bench/gpu_run.sh ${stages[*]} exited with status $rc"
    python3 "$HELPER" check-out "$out" "${stages[@]}" || bad "output rules broken in call $i"
    for x in "${stages[@]}"; do
      if grep -q 'FAILED' "$out/$x.md"; then
        bad "$x.md reports a failure:"
        grep 'FAILED' "$out/$x.md" >&2
      fi
      if grep -q '^Stopped by the time guard' "$out/$x.md"; then
        bad "$x was stopped by its time guard in the rehearsal"
      fi
      measured "$x" "$out/$x.md" || bad "$x.md: the rows measured by the CPU build are missing"
      echo "----- $x.md -----"
      cat "$out/$x.md"
    done
  done

  # The time guard: a stage that takes longer than 5 s is stopped, exits 0, keeps two files
  # whose .md begins with the guard's line, and its server is gone.
  if has service; then
    local out=$tmp/guard
    mkdir -p "$out"
    say "time guard: LIPSYNC_STAGE_SECONDS=5 bench/gpu_run.sh service"
    env "${env[@]}" LIPSYNC_STAGE_SECONDS=5 OUT="$out" "$SELF" service
    local rc=$?
    [ $rc = 0 ] || bad "a stage stopped by the guard exited with status $rc"
    python3 "$HELPER" check-out "$out" service || bad "output rules broken by the guarded stage"
    head -1 "$out/service.md" | grep -qx 'Stopped by the time guard after 5 s' \
      || bad "service.md does not begin with 'Stopped by the time guard after 5 s': $(head -1 "$out/service.md")"
    local p
    sleep 1
    while read -r p; do
      if alive "$p"; then
        bad "the guarded stage's server (pid $p) is still running"
        kill -KILL "$p" 2>/dev/null
      fi
    done < <(cat "$tmp/work/stage-service/server.pids" 2>/dev/null)
    [ -s "$tmp/work/stage-service/server.pids" ] || bad "the guarded stage started no server in 5 s (nothing to check)"
  fi
  # More than 4 stages in one command are refused.
  if env "${env[@]}" OUT="$tmp/five" "$SELF" check check check check check > /dev/null 2>&1; then
    bad "five stages in one command were not refused"
  fi

  say "rehearsal: $((SECONDS - t_start)) s in all ($((SECONDS - t_built)) s running stages)," \
    "$errors problem(s)"
  if [ $errors = 0 ]; then
    rm -rf "$tmp"
    return 0
  fi
  echo "rehearsal files kept in $tmp" >&2
  return 1
}

# Rows that only a real run on the CPU build writes, per stage (the rehearsal's sizes).
measured() {
  local n='[0-9]+(\.[0-9]+)?' f=$2
  case $1 in
    check) grep -qE "ready after $n s" "$f" && grep -qE '^\| device \| cpu \|' "$f" ;;
    test) grep -qE '^\| [a-z0-9_]+ \| ok \|' "$f" && ! grep -qE '^\| [a-z0-9_]+ \| (FAILED|did not finish) \|' "$f" ;;
    model)
      grep -qE "^\| f32 \| cpu \| $n \| $n \|" "$f" \
        && grep -qE "^\| 2 \| 1 \| 2 \| $n \|" "$f" \
        && grep -qE "^\| f32 \| cpu \| $n dB \|" "$f" \
        && grep -qE "^\| cold \|" "$f" && grep -q '^## Encoder only' "$f" \
        && grep -qE "^\| 2 \| 1 \| $n \| $n \|" "$f" \
        && grep -qE "^\| 1 s \| [0-9]+ \| 25 \| $n s \| $n s \|" "$f"
      ;;
    torch) grep -qE "^\| f32 \| nchw \| eager \| 1 \| $n \|" "$f" ;;
    service)
      grep -qE '^\| 512x512 photo, 1 s \| 1 \| 1 \| 1 \| 0 \|' "$f" \
        && grep -qE '^\| 1280x720 photo, 1 s \| 1 \| 2 \| 1 \| 0 \|' "$f" \
        && grep -qE '^\| clip \(carphone.mp4\), 1 s \| 1 \| 2 \| 1 \| 0 \|' "$f" \
        && grep -qE "^\| inference \| [0-9]+ \| $n \|" "$f" \
        && grep -qE "^\| 2 at once \| 2 \| 1 \| 2 \| 0 \| 0 \| 0 \| 50 \| $n \|.* \| $n \|$" "$f" \
        && grep -qE "^\| echo, 2 at once \| 2 \| 1 \| 2 \| 0 \| 0 \| 0 \| 50 \| $n \|.* \| $n \|$" "$f" \
        && grep -qE '^\| limit [0-9]+[MG] \| 1 \| 1 \| 1 \| 0 \|' "$f" \
        && grep -qE '^\| lipsync_oom_splits_total \| [0-9]' "$f" \
        && grep -qE 'out of memory; batches limited to [0-9]+ frames' "$f"
      ;;
    live) grep -qE "^\| 1 session \| 1 \| 1 \| 0 \| 0 \| [1-9][0-9]* \| $n \|" "$f" ;;
    media)
      [ "$(grep -cE "^\| photo 512x512 \| $n s \| $n s \| $n s \| $n s \| $n s \| $n× \| yes" "$f")" = 2 ] \
        && [ "$(grep -cE "^\| clip 1280x720 \| $n s \|" "$f")" = 2 ] \
        && [ "$(grep -cE "^\| photo 512x512 \| fmp4 \| 1 \| (yes|no[^|]*) \| [1-9][0-9]* / [0-9]+" "$f")" = 2 ] \
        && grep -q '^## Media side on the cpu device' "$f" && grep -q '^## Media side on the echo device' "$f"
      ;;
    enhancers)
      grep -qE "^\| realesr-animevideov3 \| SRVGGNetCompact \(16 body convolutions, 64 features, x4\) \| 96x96 \| $n G( \| $n)+ \|" "$f" \
        && grep -qE "^\| realesr-animevideov3 \| [0-9]+ \| $n s \| -?$n s \| -?$n s \|" "$f"
      ;;
  esac
}

# The convolution settings given to the server through the environment, if any (", with
# LIPSYNC_CONV_EPILOGUE=auto ...").
conv_env() {
  local v
  v=$(env | grep -E '^LIPSYNC_(CONV|CUDNN)_' | sort | tr '\n' ' ' | sed 's/ $//')
  [ -z "$v" ] || printf ', with %s' "$v"
}

# Whether a process runs (a zombie waiting for its reaper does not).
alive() {
  local st
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

main "$@"
