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
