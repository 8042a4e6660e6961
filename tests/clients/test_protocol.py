"""What the release server cannot be made to answer on demand, against scripted answers:
every HTTP error status and its class (httpx's MockTransport), and the live-session messages
of a newer server (issue 23: `draw_fps` in `ready`, `min_draw_fps` in the opening, an
`over_capacity` error closing 1013, more statistics in `end`), from a scripted WebSocket
server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import io
import json
import struct

import httpx
import pytest
from PIL import Image
from websockets.asyncio.server import serve

from lipsync_client import (
    AsyncClient,
    BadRequest,
    Client,
    LipsyncError,
    LiveEvent,
    LiveFrame,
    NotFound,
    Overloaded,
    Unauthorized,
    Unavailable,
)


def answering(status: int, error_type: str, headers: dict | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"error": f"refused with {status}", "error_type": error_type}
        return httpx.Response(status, json=body, headers=headers or {})

    return handler


@pytest.mark.parametrize(
    "status,cls",
    [
        (400, BadRequest), (413, BadRequest), (415, BadRequest), (422, BadRequest),
        (401, Unauthorized), (404, NotFound), (429, Overloaded), (503, Unavailable),
        (408, LipsyncError), (409, LipsyncError), (500, LipsyncError), (507, LipsyncError),
    ],
)
def test_each_status_raises_its_class(status, cls):
    transport = httpx.MockTransport(answering(status, "some_type", {"Retry-After": "7"}))
    with Client("http://lipsync.test", api_key="k", transport=transport) as c:
        with pytest.raises(LipsyncError) as e:
            c.get_avatar("x")
    assert type(e.value) is cls
    assert (e.value.status, e.value.error_type, e.value.message) == (status, "some_type", f"refused with {status}")
    assert e.value.retry_after == 7.0
    assert str(e.value) == f"{status} some_type: refused with {status}"


def test_requests_carry_the_key_and_form_fields():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/ready":
            return httpx.Response(503, json={"error": "warming up", "error_type": "not_ready"})
        return httpx.Response(200, content=b"\x00\x00\x00\x18ftypisom")

    with Client("http://lipsync.test/", api_key="s3cret", transport=httpx.MockTransport(handler)) as c:
        assert c.ready() is False
        out = c.render(b"RIFF....WAVE", image=b"\x89PNG", box=(1, 2, 3, 4), smooth=False, fps="30000/1001", crf=None)
    assert out.endswith(b"ftypisom")
    r = seen[-1]
    assert r.headers["authorization"] == "Bearer s3cret"
    body = r.read().decode("latin-1")
    assert 'name="box"\r\n\r\n1,2,3,4' in body and 'name="smooth"\r\n\r\nfalse' in body
    assert 'name="fps"\r\n\r\n30000/1001' in body and 'name="crf"' not in body
    assert 'name="audio"; filename="audio"' in body and 'name="image"; filename="image"' in body


def test_a_cut_off_stream_raises_stream_aborted():
    class Cut(httpx.SyncByteStream):
        def __iter__(self):
            yield b"\x00\x00\x00\x18ftypisom"
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=Cut()))
    with Client("http://lipsync.test", transport=transport) as c:
        chunks = []
        with pytest.raises(LipsyncError) as e:
            for chunk in c.render_stream(b"a", image=b"b"):
                chunks.append(chunk)
    assert chunks and e.value.error_type == "stream_aborted"


def jpeg() -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(b, "JPEG")
    return b.getvalue()


async def scripted(script):
    """A WebSocket server that records the opening and plays `script(ws, opening)`."""
    openings: list[dict] = []

    async def handler(ws):
        opening = json.loads(await ws.recv())
        openings.append(opening)
        await script(ws, opening)

    server = await serve(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", openings


def test_a_newer_servers_session():
    async def script(ws, opening):
        await ws.send(json.dumps({"type": "ready", "width": 8, "height": 6, "fps": 25, "mime": "image/jpeg", "draw_fps": 12.5}))
        await ws.send(json.dumps({"type": "idle", "frame": 0, "pts": 0.0}))
        j = jpeg()
        for k in range(3):
            await ws.send(struct.pack("<IdI", k, k / 25, len(j)) + j + bytes(1280))
        await ws.recv()  # end
        stats = {"frames": 3, "speaking_frames": 0, "idle_frames": 3, "drawn_frames": 1, "held_frames": 2}
        await ws.send(json.dumps({"type": "end", "stats": stats}))
        await ws.close(1000, "end")

    async def go():
        server, url, openings = await scripted(script)
        async with server, AsyncClient(url) as c:
            async with c.live("a", min_draw_fps=10) as live:
                assert live.draw_fps == 12.5
                await live.end()
                items = [x async for x in live]
            async with c.live("b") as live2:
                assert live2.draw_fps is None or live2.draw_fps == 12.5
                await live2.close()
        return openings, items, live

    openings, items, live = asyncio.run(asyncio.wait_for(go(), 20))
    assert openings[0]["min_draw_fps"] == 10 and "min_draw_fps" not in openings[1]
    assert openings[0]["output"] == "jpeg" and openings[0]["audio"] == {"format": "s16le", "sample_rate": 16000, "channels": 1}
    frames = [x for x in items if isinstance(x, LiveFrame)]
    assert [f.index for f in frames] == [0, 1, 2] and frames[0].rgb[:3] == frames[0].rgb[3:6]
    assert (frames[0].width, frames[0].height, len(frames[0].rgb)) == (8, 6, 8 * 6 * 3)
    end = [x for x in items if isinstance(x, LiveEvent)][-1]
    assert end.type == "end" and end.data["stats"]["held_frames"] == 2 and live.stats["drawn_frames"] == 1


def test_a_session_refused_for_capacity_is_overloaded():
    async def script(ws, opening):
        msg = {"type": "error", "error": "the GPU is full", "error_type": "over_capacity", "retry_after": 3}
        await ws.send(json.dumps(msg))
        await ws.close(1013, "over_capacity")

    async def go():
        server, url, _ = await scripted(script)
        async with server, AsyncClient(url) as c:
            with pytest.raises(Overloaded) as e:
                async with c.live("a"):
                    pass
            return e.value

    e = asyncio.run(asyncio.wait_for(go(), 20))
    assert (e.error_type, e.close_code, e.status, e.retry_after) == ("over_capacity", 1013, 429, 3.0)
    assert e.message == "the GPU is full"


def test_an_error_during_a_session_is_raised_by_the_iteration():
    async def script(ws, opening):
        await ws.send(json.dumps({"type": "ready", "width": 8, "height": 6, "fps": 25, "mime": "image/jpeg"}))
        await ws.send(json.dumps({"type": "error", "error": "too much audio", "error_type": "bad_stream"}))
        await ws.close(1008, "bad_stream")

    async def go():
        server, url, _ = await scripted(script)
        async with server, AsyncClient(url) as c:
            async with c.live("a") as live:
                assert live.draw_fps is None
                seen = []
                with pytest.raises(BadRequest) as e:
                    async for x in live:
                        seen.append(x)
                return seen, e.value

    seen, e = asyncio.run(asyncio.wait_for(go(), 20))
    assert [x.type for x in seen] == ["ready"]
    assert (e.error_type, e.close_code) == ("bad_stream", 1008)


def test_paced_holds_early_frames_to_their_time_and_fills_what_a_clear_dropped():
    """A fast server (a GPU) draws speech far ahead of its time. Scripted: idle frames 0-9
    when due, then speaking frames 10-59 at once; after the clear, `idle` and idle frames
    from 60 on, when due."""
    fps, lag = 25, 0.1
    speaking_jpeg = jpeg()
    b = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 10, 10)).save(b, "JPEG")
    idle_jpeg = b.getvalue()

    async def script(ws, opening):
        loop = asyncio.get_running_loop()
        start = loop.time()
        cleared, ended = asyncio.Event(), asyncio.Event()

        async def read():
            async for msg in ws:
                if isinstance(msg, str):
                    {"clear": cleared, "end": ended}[json.loads(msg)["type"]].set()

        reader = asyncio.create_task(read())

        async def frame(k, j, audio):
            await asyncio.sleep(max(0.0, start + lag + k / fps - loop.time()) if j is idle_jpeg else 0)
            await ws.send(struct.pack("<IdI", k, k / fps, len(j)) + j + audio)

        await ws.send(json.dumps({"type": "ready", "width": 8, "height": 6, "fps": fps, "mime": "image/jpeg"}))
        await ws.send(json.dumps({"type": "idle", "frame": 0, "pts": 0.0}))
        for k in range(10):
            await frame(k, idle_jpeg, bytes(1280))
        await ws.send(json.dumps({"type": "speaking", "frame": 10, "pts": 0.4}))
        for k in range(10, 60):
            await frame(k, speaking_jpeg, b"\x01\x02" * 640)
        await asyncio.wait_for(cleared.wait(), 10)
        await ws.send(json.dumps({"type": "idle", "frame": 60, "pts": 2.4}))
        for k in range(60, 80):
            await frame(k, idle_jpeg, bytes(1280))
        await asyncio.wait_for(ended.wait(), 10)
        await ws.send(json.dumps({"type": "end", "stats": {"frames": 80}}))
        await ws.close(1000, "end")
        reader.cancel()

    async def go():
        server, url, _ = await scripted(script)
        async with server, AsyncClient(url) as c:
            async with c.live("a") as live:
                loop = asyncio.get_running_loop()
                shown: list[tuple[float, object]] = []
                marks: dict[str, float] = {}
                async for x in live.paced():
                    shown.append((loop.time(), x))
                    if isinstance(x, LiveFrame) and x.speaking and x.index == 19:
                        await live.clear()
                        marks["clear"] = loop.time()
                    if isinstance(x, LiveFrame) and x.index == 79:
                        await live.end()
                return shown, marks

    shown, marks = asyncio.run(asyncio.wait_for(go(), 30))
    frames = [(t, x) for t, x in shown if isinstance(x, LiveFrame)]
    assert [x.index for _, x in frames] == list(range(80))
    # The burst is shown one frame per 40 ms: frames 10-19 over 0.36 s.
    t = {x.index: t for t, x in frames}
    assert 0.30 < t[19] - t[10] < 0.45, t[19] - t[10]
    assert [x.index for _, x in frames if x.speaking] == list(range(10, 20))
    # What the clear dropped (20-59) is the last idle frame again, silent, at 40 ms a frame,
    # then the server's idle frames.
    filled = [x for _, x in frames if x.filled]
    assert [x.index for x in filled] == list(range(20, 60))
    assert all(x.rgb == frames[0][1].rgb and not any(x.audio) and not x.speaking for x in filled)
    assert 1.45 < t[59] - t[20] < 1.7, t[59] - t[20]
    assert t[20] - marks["clear"] < 0.06
    assert all(not x.filled for _, x in frames if x.index >= 60)
    events = [x.type for _, x in shown if isinstance(x, LiveEvent)]
    assert events == ["ready", "idle", "speaking", "idle", "end"], events
