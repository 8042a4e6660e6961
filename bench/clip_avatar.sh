#!/usr/bin/env bash
# Clip avatars (issue 12): preparing a 10 s 1280x720 25 fps clip (decode, face detection in
# every frame, smoothing, crops, JPEG frames), its prepared size, and the per-frame cost of a
# request on it (JPEG decode + paste + encode) vs a prepared photo vs x264 alone encoding the
# same looped clip at the same settings (veryfast, crf 20, one x264 process). No model: the
# model's share is the same for a photo and a clip.
#
#   bench/clip_avatar.sh [out_dir]      (release build of lipsync; ffmpeg with libx264)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/bench-clip}
mkdir -p "$out"
cargo build --release --locked >/dev/null
clip="$out/hd.mp4"
if [ ! -f "$clip" ]; then
  # A slow pan over the astronaut photo with film grain (grain makes the stored JPEG frames
  # larger than a typical camera clip's), H.264 as a phone would record it.
  ffmpeg -v error -y -loop 1 -i tests/media/astronaut.png \
    -vf "scale=1280:1280,crop=1280:720:0:'200+100*sin(t)',noise=alls=6:allf=t,format=yuv420p" \
    -t 10 -r 25 -c:v libx264 -preset medium -crf 20 "$clip"
fi
target/release/lipsync bench --video "$clip" --json "$out/hd.json"
echo
target/release/lipsync bench --video tests/media/carphone.mp4 --json "$out/carphone.json"

# Whole requests through the service (model included: random weights on this device), same
# speech, on the prepared clip avatar and on a prepared photo avatar (the clip's first frame).
weights="$out/random.safetensors"
[ -f "$weights" ] || target/release/lipsync init-weights "$weights" >/dev/null 2>&1
ffmpeg -v error -y -i "$clip" -frames:v 1 "$out/first.png"
log="$out/serve.log"
target/release/lipsync serve --checkpoint "$weights" --port 0 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
port=""
for _ in $(seq 1 600); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" | head -1 | sed 's/.*://') || true
  [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
  sleep 0.2
done
base="http://127.0.0.1:$port"
box=$(python3 -c "import json; print(','.join(map(str, json.load(open('$out/hd.json'))['box'])))")
video_id=$(curl -sf -F video=@"$clip" -F box="$box" "$base/v1/avatars" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
photo_id=$(curl -sf -F image=@"$out/first.png" -F box="$box" "$base/v1/avatars" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
echo
echo "| request (4.0 s speech, 100 video frames at 25 fps, 1280x720) | run 1 | run 2 | run 3 |"
echo "|---|---|---|---|"
for kind in photo video; do
  id=$photo_id; [ $kind = video ] && id=$video_id
  row="| prepared $kind avatar |"
  for _ in 1 2 3; do
    t=$(curl -sf -o /dev/null -w '%{time_total}' -F audio=@tests/media/arctic_a0007.wav -F avatar_id="$id" "$base/v1/lipsync")
    row="$row $t s |"
  done
  echo "$row"
done
