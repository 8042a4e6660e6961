#!/usr/bin/env python3
"""Live sessions at a frame rate the server may not be able to draw: do they keep their clock?

    python3 bench/live_sessions.py --url http://127.0.0.1:8080 --audio SPEECH.wav --image PHOTO \
        [--sessions 1,2,4] [--fps 25] [--output jpeg|fmp4] [--min-draw-fps 1] [--json OUT]

For each level, that many sessions open at once (one shared avatar), take 1 s of idle video,
then send the speech (16-bit PCM WAV) in 20 ms messages paced in real time, then `end`. Per
session it reports what `ready` promised (`draw_fps`), what the `end` stats say (drawn and held
frames, the server's latency p50/p95: chunk arrival -> the frame holding its first drawn frame
sent, after encoding for fmp4), and with `--output jpeg` what arrived here: frames against the
frames due from the first frame to the close (none missing, none extra), indices contiguous,
the speech's audio complete in the frames, and drawn frames against the promise
(drawn / (draw_fps x speaking seconds); the sessions that opened first were promised more, and
give way as the others open, so the level's share, the last one's promise, is shown too). Needs the `websockets` package (the client venv
`target/clients-venv` has it). Markdown rows go to stdout.
"""

import argparse
import array
import asyncio
import json
import struct
import sys
import time
import urllib.request
import wave

import websockets


def upload(url, image):
    data = open(image, "rb").read()
    b = "----lipsync-bench"
    body = (
        f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"avatar\"\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + data + f"\r\n--{b}--\r\n".encode()
    req = urllib.request.Request(f"{url}/v1/avatars", data=body,
                                 headers={"Content-Type": f"multipart/form-data; boundary={b}"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["id"]


async def session(url, avatar, pcm, rate, args, t_open):
    await asyncio.sleep(t_open)
    out = {"frames": [], "events": [], "ready": None, "end": None, "error": None}
    ws_url = url.replace("http://", "ws://", 1) + "/v1/stream"
    async with websockets.connect(ws_url, max_size=None) as ws:
        opening = {"avatar_id": avatar, "fps": args.fps, "output": args.output,
                   "audio": {"format": "s16le", "sample_rate": rate, "channels": 1}}
        if args.min_draw_fps is not None:
            opening["min_draw_fps"] = args.min_draw_fps
        await ws.send(json.dumps(opening))

        async def reader():
            try:
                await read(ws)
            except websockets.exceptions.ConnectionClosed as e:
                out["closed_with"] = e.rcvd.code if e.rcvd else None
            out["closed"] = time.monotonic()

        async def read(ws):
            async for m in ws:
                now = time.monotonic()
                if isinstance(m, str):
                    d = json.loads(m)
                    if d["type"] == "ready":
                        out["ready"] = d
                    elif d["type"] == "end":
                        out["end"] = d["stats"]
                    elif d["type"] == "error":
                        out["error"] = d
                    else:
                        out["events"].append(d)
                elif args.output == "jpeg":
                    index, pts, n = struct.unpack_from("<IdI", m, 0)
                    out["frames"].append((index, now, m[16 + n:]))
                else:
                    out["frames"].append((None, now, b""))

        task = asyncio.create_task(reader())
        while out["ready"] is None and out["error"] is None and not task.done():
            await asyncio.sleep(0.01)
        if out["error"] is not None or task.done():
            await task
            return out
        await asyncio.sleep(1.0)
        step = rate * 2 // 50  # 20 ms
        t0 = time.monotonic()
        for i in range(0, len(pcm), step):
            await ws.send(pcm[i:i + step])
            await asyncio.sleep(max(0.0, t0 + (i + step) / (2 * rate) - time.monotonic()))
        await ws.send(json.dumps({"type": "end"}))
        await asyncio.wait_for(task, 120)
    return out


def audio_check(s, speech):
    """The speech (16 kHz s16le) against the frames' audio from the first speaking frame on:
    the largest sample difference, or what is missing."""
    first = next((e["frame"] for e in s["events"] if e["type"] == "speaking"), None)
    if first is None:
        return "no speaking event"
    by_index = {f[0]: f[2] for f in s["frames"]}
    got = b"".join(by_index.get(k, b"") for k in range(first, max(by_index) + 1))
    want = array.array("h", speech)
    have = array.array("h", got[: len(speech) - len(speech) % 2])
    if len(have) < len(want):
        return f"MISSING {len(want) - len(have)} samples"
    return f"complete, max diff {max((abs(a - b) for a, b in zip(want, have)), default=0)}"


def row(label, s, speech, fps, level_share):
    if s["error"]:
        e = s["error"]
        return (f"| {label} | refused: {e.get('error_type')}, could get {e.get('draw_fps')} "
                f"(close {s.get('closed_with')}) |" + " |" * 9)
    st = s["end"] or {}
    promised = s["ready"].get("draw_fps")
    speaking_s = st.get("speaking_frames", 0) / fps
    drawn = st.get("drawn_frames", 0)
    share = drawn / (promised * speaking_s) if promised and speaking_s else float("nan")
    frames = s["frames"]
    fair = drawn / (level_share * speaking_s) if level_share and speaking_s else float("nan")
    cells = [label, f"{promised}", f"{drawn}", f"{st.get('held_frames')}",
             f"{share:.0%}", f"{fair:.0%}", f"{st.get('latency_ms_p50') or 0:.0f}", f"{st.get('latency_ms_p95') or 0:.0f}",
             f"{st.get('max_lateness_ms', 0):.0f}"]
    if frames and frames[0][0] is not None:
        idx = [f[0] for f in frames]
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        due = (frames[-1][1] - frames[0][1]) * fps + 1
        cells += [f"{len(frames)} / {due:.0f} ({len(frames) / due - 1:+.1%}){'' if contiguous else ' GAPS'}",
                  audio_check(s, speech) if speech is not None else "(not 16 kHz)"]
    else:
        cells += [f"{len(frames)} fragments", "(fmp4)"]
    return "| " + " | ".join(cells) + " |"


async def level(args, avatar, pcm, rate, n):
    return await asyncio.gather(*[session(args.url, avatar, pcm, rate, args, i * 0.2) for i in range(n)])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--audio", required=True, help="16-bit PCM mono WAV")
    ap.add_argument("--image", required=True)
    ap.add_argument("--sessions", default="1,2,4")
    ap.add_argument("--fps", type=float, default=25)
    ap.add_argument("--output", choices=["jpeg", "fmp4"], default="jpeg")
    ap.add_argument("--min-draw-fps", type=float)
    ap.add_argument("--json")
    args = ap.parse_args()
    w = wave.open(args.audio)
    if w.getsampwidth() != 2 or w.getnchannels() != 1:
        sys.exit("--audio: a 16-bit mono WAV, please")
    rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    speech = pcm if rate == 16000 else None
    avatar = upload(args.url, args.image)
    print(f"Speech {len(pcm) / 2 / rate:.2f} s at {rate} Hz, {args.fps:g} fps, output {args.output}"
          f"{'' if args.min_draw_fps is None else f', min_draw_fps {args.min_draw_fps:g}'}\n")
    print("| sessions: session | draw_fps promised | drawn | held | drawn / promised | drawn / level's share | "
          "latency p50 ms | p95 ms | most late ms | frames / due | speech in the frames' audio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for n in [int(x) for x in args.sessions.split(",")]:
        out = asyncio.run(level(args, avatar, pcm, rate, n))
        results[n] = [{k: v for k, v in s.items() if k != "frames"} | {"frame_count": len(s["frames"])}
                      for s in out]
        # The level's fair share: what the last session to open was promised (the earlier ones
        # were promised more, alone, and gave way as the others opened).
        promised = [s["ready"]["draw_fps"] for s in out if s["ready"] and s["ready"].get("draw_fps")]
        level_share = min(promised) if promised else None
        for i, s in enumerate(out):
            print(row(f"{n}: {i + 1}", s, speech, args.fps, level_share), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
