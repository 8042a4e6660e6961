"""Live sessions through `AsyncClient.live` against the release server: the JPEG frames
decoded, in order, with the speech coming back as their audio; paced output; clear; the
session's refusals as errors."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from conftest import API_KEY, PHOTO, Server, read_speech
from lipsync_client import (
    AUDIO_RATE,
    AsyncClient,
    BadRequest,
    Client,
    LipsyncError,
    LiveEvent,
    LiveFrame,
    NotFound,
    Overloaded,
    Unauthorized,
)

FPS = 25


def run(coro, timeout: float):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def speak(live, pcm: bytes, *, realtime: bool = True, chunk_s: float = 0.02, rate: int = 16000, channels: int = 1):
    """Sends `pcm` in `chunk_s` pieces, paced in real time (or all at once)."""
    loop = asyncio.get_running_loop()
    step = int(rate * chunk_s) * 2 * channels
    t0 = loop.time()
    for n, i in enumerate(range(0, len(pcm), step)):
        if realtime:
            await asyncio.sleep(max(0.0, t0 + n * chunk_s - loop.time()))
        await live.send_audio(pcm[i : i + step])


def mouth(frame: LiveFrame, box) -> np.ndarray:
    """The lower half of the face box (where the model draws the mouth), as an array."""
    img = np.frombuffer(frame.rgb, np.uint8).reshape(frame.height, frame.width, 3)
    x1, y1, x2, y2 = box
    return img[(y1 + y2) // 2 : y2, x1:x2].astype(np.int16)


def test_a_session_idles_speaks_and_ends_with_the_speech_back(server, avatar, live_opts):
    pcm = read_speech(seconds=2.0)

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            async with c.live(avatar["id"], fps=FPS, **live_opts) as live:
                assert (live.width, live.height, live.fps) == (avatar["width"], avatar["height"], FPS)
                assert live.ready["mime"] == "image/jpeg"
                assert live.draw_fps is None or live.draw_fps >= 0
                loop = asyncio.get_running_loop()

                async def talk():
                    await asyncio.sleep(0.5)  # some idle frames first
                    await speak(live, pcm)
                    await live.end()

                sender = asyncio.create_task(talk())
                items = [(loop.time(), x) async for x in live]
                await sender
                return live, items

    live, items = run(go(), 60)
    events = [x.type for _, x in items if isinstance(x, LiveEvent)]
    assert events == ["ready", "idle", "speaking", "idle", "end"], events
    frames = [x for _, x in items if isinstance(x, LiveFrame)]
    # Every frame, in order, at k / fps, the whole picture and 40 ms of 16 kHz audio each.
    assert [f.index for f in frames] == list(range(len(frames)))
    assert all(abs(f.pts - f.index / FPS) < 1e-9 for f in frames)
    assert all(len(f.rgb) == f.width * f.height * 3 for f in frames)
    assert all(len(f.audio) == 2 * AUDIO_RATE // FPS for f in frames)
    speaking = [f for f in frames if f.speaking]
    idle = [f for f in frames if not f.speaking]
    # 2 s of speech: the file rule's frames (2 s × 25 fps, less the last few windows).
    assert 46 <= len(speaking) <= 50, len(speaking)
    first = frames.index(speaking[0])
    assert all(f.speaking for f in frames[first : first + len(speaking)]), "one run of speech"
    # The speech comes back as the speaking frames' audio, sample for sample; idle is silent.
    back = b"".join(f.audio for f in speaking)
    a, b = np.frombuffer(back, np.int16), np.frombuffer(pcm[: len(back)], np.int16)
    # (all of it but the last few frames' worth, which the file rule leaves out)
    assert len(back) >= len(pcm) - 4 * 2 * AUDIO_RATE // FPS and np.abs(a.astype(int) - b).max() <= 1
    assert all(not any(f.audio) for f in idle)
    # Idle frames show one face; speaking frames a mouth drawn from the speech.
    assert all(f.rgb == idle[0].rgb for f in idle)
    box = avatar["box"]
    diffs = [np.abs(mouth(f, box) - mouth(idle[0], box)).mean() for f in speaking]
    assert max(diffs) > 5, diffs
    # The server counted what came.
    stats = live.stats
    assert stats["frames"] == len(frames) and stats["speaking_frames"] == len(speaking), stats
    assert stats["idle_frames"] == len(idle) and stats["utterances"] == 1, stats
    assert stats["interrupted"] == 0, stats
    print(f"\nlive: {len(frames)} frames, {len(speaking)} speaking for 2.00 s of speech; stats {stats}")


def test_paced_output_shows_each_frame_at_its_time(server, avatar, live_opts):
    pcm = read_speech(seconds=3.0)

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            async with c.live(avatar["id"], **live_opts) as live:
                loop = asyncio.get_running_loop()
                arrived: dict[int, float] = {}
                shown: list[tuple[float, LiveFrame]] = []
                parse = live._parse

                async def noting_arrivals(msg):
                    item = await parse(msg)
                    if isinstance(item, LiveFrame):
                        arrived[item.index] = loop.time()
                    return item

                live._parse = noting_arrivals  # type: ignore[method-assign]

                async def talk():
                    await asyncio.sleep(0.3)
                    await speak(live, pcm, realtime=False)  # a TTS far ahead of real time
                    await asyncio.sleep(0.5)
                    await live.end()

                sender = asyncio.create_task(talk())
                async for x in live.paced():
                    if isinstance(x, LiveFrame):
                        shown.append((loop.time(), x))
                await sender
                return shown, arrived, live

    shown, arrived, live = run(go(), 60)
    frames = [f for _, f in shown]
    assert [f.index for f in frames] == list(range(len(frames)))
    speaking = [(t, f) for t, f in shown if f.speaking]
    assert 71 <= len(speaking) <= 75, len(speaking)
    assert live.stats["speaking_frames"] == len(speaking)
    # The speech came at once, and its frames as fast as the server drew them. Each is shown
    # at its time on the session's clock (taken from the idle frames, which the server sends
    # when due), or when it comes if it comes late (a CPU server may draw more slowly than
    # real time): never early, never in a burst.
    origin = min(arrived[f.index] - f.pts for f in frames if not f.speaking)
    target = {f.index: max(arrived[f.index], origin + f.pts) for f in frames}
    errors = sorted(t - target[f.index] for t, f in shown)
    assert errors[0] > -0.005, f"a frame shown {-errors[0] * 1e3:.0f} ms early"
    assert errors[int(0.9 * len(errors))] < 0.04, f"90% within {errors[int(0.9 * len(errors))] * 1e3:.0f} ms"
    span = speaking[-1][0] - speaking[0][0]
    want = (len(speaking) - 1) / FPS
    assert span >= 0.95 * want, (span, want)
    held_back = sum(1 for f in frames if f.speaking and arrived[f.index] < origin + f.pts - 0.02)
    print(f"\npaced: {len(speaking)} speaking frames shown over {span:.2f} s (their time {want:.2f} s); "
          f"{held_back} came early and were held to their time; 90% shown within "
          f"{errors[int(0.9 * len(errors))] * 1e3:.0f} ms of it")


def test_clear_interrupts_and_new_speech_follows(server, avatar, live_opts):
    pcm = read_speech()  # 4 s

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            async with c.live(avatar["id"], **live_opts) as live:
                loop = asyncio.get_running_loop()
                shown: list[tuple[float, object]] = []
                cleared = asyncio.Event()
                marks: dict[str, float] = {}

                async def talk():
                    await asyncio.sleep(0.3)
                    await speak(live, pcm, realtime=False)
                    # Interrupt once the face has spoken for a second.
                    while sum(1 for _, x in shown if isinstance(x, LiveFrame) and x.speaking) < FPS:
                        await asyncio.sleep(0.01)
                    await live.clear()
                    marks["clear"] = loop.time()
                    cleared.set()
                    await asyncio.sleep(1.0)
                    marks["again"] = loop.time()
                    await speak(live, read_speech(seconds=1.0))
                    await asyncio.sleep(0.5)
                    await live.end()

                sender = asyncio.create_task(talk())
                async for x in live.paced():
                    shown.append((loop.time(), x))
                await sender
                return shown, marks, live

    shown, marks, live = run(go(), 90)
    frames = [(t, x) for t, x in shown if isinstance(x, LiveFrame)]
    # The video stays continuous: the frames the clear dropped are filled with the idle face.
    assert [x.index for _, x in frames] == list(range(len(frames)))
    before = [x for t, x in frames if t < marks["clear"]]
    between = [x for t, x in frames if marks["clear"] <= t < marks["again"]]
    assert sum(x.speaking for x in before) >= FPS
    # At most the frame being shown when it was cleared; then idle at once, one frame every
    # 40 ms: the server's, or (for frames it had drawn ahead, which the clear dropped) the
    # idle face filled in, silent.
    late = [x for x in between if x.speaking]
    assert len(late) <= 1, [(x.index, x.pts) for x in late]
    assert len(between) >= 0.8 * FPS, len(between)
    assert all(not any(x.audio) for x in between if x.filled)
    # Speech sent after the clear is spoken.
    after = [x for t, x in frames if t >= marks["again"] and x.speaking]
    assert 20 <= len(after) <= 25, len(after)
    stats = live.stats
    assert stats["interrupted"] == 1 and stats["utterances"] == 2, stats
    events = [x.type for _, x in shown if isinstance(x, LiveEvent)]
    assert events == ["ready", "idle", "speaking", "idle", "speaking", "idle", "end"], events
    first_idle = next(t for t, x in frames if t >= marks["clear"] and not x.speaking)
    print(f"\nclear: {len(late)} speaking frame after it; idle shown {1e3 * (first_idle - marks['clear']):.0f} ms "
          f"after; {sum(x.filled for x in between)} frames filled; {len(after)} speaking frames after")


def test_audio_at_another_rate_and_in_stereo_is_resampled_by_the_server(server, avatar, live_opts):
    import soxr

    mono = np.frombuffer(read_speech(seconds=2.0), np.int16)
    up = soxr.resample(mono, 16000, 48000).astype(np.int16)
    stereo = np.stack([up, up], axis=1).reshape(-1).tobytes()

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            async with c.live(avatar["id"], sample_rate=48000, channels=2, **live_opts) as live:
                sender = asyncio.create_task(speak(live, stereo, rate=48000, channels=2))
                await sender
                await live.end()
                return [x async for x in live if isinstance(x, LiveFrame) and x.speaking]

    speaking = run(go(), 60)
    assert 46 <= len(speaking) <= 50, len(speaking)
    back = np.frombuffer(b"".join(f.audio for f in speaking), np.int16).astype(float)
    ref = mono[: len(back)].astype(float)
    corr = float(np.dot(back, ref) / (np.linalg.norm(back) * np.linalg.norm(ref)))
    assert corr > 0.95, corr


def test_refusals_raise_their_errors(server, avatar, live_opts):
    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            with pytest.raises(NotFound) as e:
                async with c.live("0" * 64):
                    pass
            assert (e.value.error_type, e.value.close_code) == ("avatar_not_found", 4404), repr(e.value)
            with pytest.raises(BadRequest) as e:
                async with c.live(avatar["id"], fps=1000):
                    pass
            assert (e.value.error_type, e.value.close_code) == ("bad_fps", 1008), repr(e.value)
            async with AsyncClient(server.url, api_key="wrong") as bad:
                with pytest.raises(Unauthorized) as e:
                    async with bad.live(avatar["id"]):
                        pass
                assert e.value.status == 401, repr(e.value)
            # One session at a time (--max-sessions 1): a second is refused, with a delay.
            async with c.live(avatar["id"], **live_opts) as first:
                with pytest.raises(Overloaded) as e:
                    async with c.live(avatar["id"], **live_opts):
                        pass
                assert e.value.status == 429 and e.value.retry_after == 5, repr(e.value)
                await first.end()
                assert [x.type async for x in first if isinstance(x, LiveEvent)][-1] == "end"

    run(go(), 60)
    # Every session above is closed.
    deadline = time.monotonic() + 10
    while server.metric("lipsync_stream_sessions") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("lipsync_stream_sessions") == 0


def test_an_echo_server_admits_sessions_up_to_its_cpu_capacity_and_refuses_over_it():
    """On the echo device the model costs nothing, so the cores are the limit: `/info` offers
    the sessions they take (`max_sessions`, from the CPU seconds a live frame costs), each one
    opened while there is room is admitted, and the first one past it is refused with
    `over_capacity`. The offer follows the measured cost, so each opening is checked against
    what `/info` says just before it."""
    s = Server(echo=True)
    try:
        info = s.get_json("/info")
        assert info["device"] == "echo" and info["checkpoint"] is None, info
        offered = info["sessions"]["max_sessions"]
        assert 1 <= offered <= 64, info["sessions"]
        with Client(s.url) as c:
            avatar_id = c.create_avatar(image=PHOTO)["id"]

        async def go():
            opened = []
            async with AsyncClient(s.url) as c:
                try:
                    for _ in range(65):
                        room = s.get_json("/info")["sessions"]["max_sessions"]
                        live = c.live(avatar_id)
                        try:
                            await live.__aenter__()
                        except LipsyncError as e:
                            assert e.error_type == "over_capacity", repr(e)
                            assert "CPU" in str(e), repr(e)
                            assert len(opened) >= room, (len(opened), room)
                            return len(opened)
                        opened.append(live)
                        assert len(opened) <= room, (len(opened), room)
                    raise AssertionError("65 sessions admitted")
                finally:
                    for live in opened:
                        await live.close()

        admitted = run(go(), 120)
        # Admitted up to the offer it made before any session (the cost may move a little
        # as their frames go out).
        assert abs(admitted - offered) <= max(1, offered // 4), (admitted, offered)
    finally:
        s.stop()
