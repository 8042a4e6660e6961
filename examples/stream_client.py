#!/usr/bin/env python3
"""A live lipsync session from Python: the shape a voice agent's TTS loop takes.

    pip install websockets
    curl -F image=@avatar.png http://127.0.0.1:8080/v1/avatars      # -> {"id": ...}
    python3 examples/stream_client.py ws://127.0.0.1:8080 AVATAR_ID speech.wav out.mp4 [MIN_DRAW_FPS]

Sends a 16-bit mono WAV in 20 ms chunks paced in real time (as text-to-speech audio arrives),
writes the fragmented MP4 that comes back (the bytes can also go straight into a browser's
MediaSource with the `mime` of the `ready` message), and prints the session's events. To
interrupt (the user starts talking), send `{"type": "clear"}`; the avatar idles within a batch.
`ready` says how many faces a second the server expects to draw (`draw_fps`; the other speaking
frames repeat the last face); MIN_DRAW_FPS (the server's default: 5) is the least the session
accepts, below which the server refuses it (`over_capacity`).
Add `?api_key=KEY` to the URL (or an Authorization header) when the server has an API key.
"""

import asyncio
import json
import sys
import wave

import websockets


async def session(url, avatar_id, wav_path, out_path, min_draw_fps=None):
    with wave.open(wav_path, "rb") as w:
        if w.getsampwidth() != 2:
            raise SystemExit("this example sends 16-bit PCM WAV")
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = w.readframes(w.getnframes())
    chunk = rate // 50 * 2 * channels  # 20 ms

    async with websockets.connect(url.rstrip("/") + "/v1/stream", max_size=None) as ws:
        opening = {
            "avatar_id": avatar_id,
            "fps": 25,
            "audio": {"format": "s16le", "sample_rate": rate, "channels": channels},
            "output": "fmp4",
        }
        if min_draw_fps is not None:
            opening["min_draw_fps"] = float(min_draw_fps)
        await ws.send(json.dumps(opening))
        ready = json.loads(await ws.recv())
        if ready.get("type") != "ready":
            raise SystemExit(f"refused: {ready}")
        print("ready:", ready)

        async def speak():
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(0, len(pcm), chunk):
                await asyncio.sleep(max(0.0, t0 + i / chunk * 0.02 - loop.time()))
                await ws.send(pcm[i:i + chunk])
            await ws.send(json.dumps({"type": "end"}))

        sender = asyncio.create_task(speak())
        with open(out_path, "wb") as out:
            async for msg in ws:  # ends when the server closes (1000 after `end`)
                if isinstance(msg, bytes):
                    out.write(msg)  # the init segment, then one fragment per message
                else:
                    event = json.loads(msg)
                    print(event)
                    if event["type"] == "error":
                        break
        await sender


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        raise SystemExit(__doc__)
    asyncio.run(session(*sys.argv[1:]))
