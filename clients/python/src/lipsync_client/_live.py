"""Live sessions: `GET /v1/stream` over a WebSocket, JPEG output decoded to RGB.

The server sends a continuous video at the session's frame rate: idle frames when they are
due, speaking frames as soon as they are drawn (possibly well ahead of their time when the
speech arrives faster than real time). Iterating the session yields them as they arrive;
`paced()` yields each at its presentation time on this machine's clock, the way a player
(or a voice agent's output transport) shows them.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Generic, TypeVar, Union

from PIL import Image
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidHandshake,
    InvalidStatus,
)

from . import _errors
from ._forms import headers

#: Sample rate of the audio the server returns with each frame (s16le, mono).
AUDIO_RATE = 16000

_HEADER = struct.Struct("<IdI")  # frame index, pts (s), JPEG length


@dataclass(frozen=True)
class LiveFrame:
    """One video frame of a live session and its share of the session's audio.

    Attributes:
        index: the frame's number in the session (0, 1, 2, ...).
        pts: its presentation time in seconds (`index / fps`).
        width, height: its size in pixels.
        rgb: the picture, `width * height * 3` bytes of packed RGB.
        audio: its audio, s16le mono at 16 kHz (silence while idle; the speech while
            speaking).
        speaking: whether it is a speaking frame (drawn from the speech) or an idle one.
        filled: True for a frame `paced()` made up to keep the video continuous where the
            server's frames were dropped by `clear()` (a copy of the last idle frame, silent).
        jpeg: the JPEG the server sent (empty for a filled frame).
    """

    index: int
    pts: float
    width: int
    height: int
    rgb: bytes = field(repr=False)
    audio: bytes = field(repr=False)
    speaking: bool
    filled: bool = False
    jpeg: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class LiveEvent:
    """A session event: `ready` (first; its data the server's `ready` message: width,
    height, fps, draw_fps when the server sends it, ...), `idle` and `speaking` (data
    `{"frame", "pts"}`: the first frame of the new state) and `end` (data `{"stats": {...}}`,
    every statistic the server sent)."""

    type: str
    data: dict[str, Any]


LiveItem = Union[LiveFrame, LiveEvent]


def _decode_jpeg(jpeg: bytes) -> tuple[int, int, bytes]:
    with Image.open(io.BytesIO(jpeg)) as f:
        img: Image.Image = f if f.mode == "RGB" else f.convert("RGB")
        return img.width, img.height, img.tobytes()


class LiveSession:
    """An open live session (made by `AsyncClient.live`; use it as an async context
    manager). See the module documentation for the two ways to read it."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        avatar_id: str,
        fps: float | str = 25,
        sample_rate: int = 16000,
        channels: int = 1,
        min_draw_fps: float | None = None,
        loop: str | None = None,
        blend: str | None = None,
        enhance: str | None = None,
        open_timeout: float = 60.0,
    ) -> None:
        self.url = url
        self._api_key = api_key
        self.opening: dict[str, Any] = {
            "avatar_id": avatar_id,
            "fps": fps,
            "audio": {"format": "s16le", "sample_rate": sample_rate, "channels": channels},
            "output": "jpeg",
        }
        if min_draw_fps is not None:
            self.opening["min_draw_fps"] = min_draw_fps
        if loop is not None:
            self.opening["loop"] = loop
        if blend is not None:
            self.opening["blend"] = blend
        if enhance is not None:
            self.opening["enhance"] = enhance
        self.sample_rate = sample_rate
        self.channels = channels
        self._open_timeout = open_timeout
        self._ws: ClientConnection | None = None
        #: The server's `ready` message.
        self.ready: dict[str, Any] = {}
        #: The `end` message's statistics, once it has come.
        self.stats: dict[str, Any] | None = None
        self._ready_pending = True
        self._finished = False
        self._closing = False
        self._speaking = False
        # After clear(): speaking frames drawn before the server saw it are dropped until it
        # says idle (or speaking again, for audio sent after the clear).
        self._stale = False
        self._audio_after_clear = False
        self._on_clear: Any = None  # paced(): drops its buffered speech
        self._wake: asyncio.Event | None = None
        self._idle_cache: tuple[bytes, tuple[int, int, bytes]] | None = None
        #: The highest frame index received (dropped frames included).
        self.max_index = -1
        #: `loop.time()` of the last `send_audio`, None before any.
        self.last_audio_at: float | None = None
        #: `loop.time()` when `ready` came.
        self.ready_at: float | None = None
        self._ending = False

    # Opening and closing

    async def __aenter__(self) -> LiveSession:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        try:
            self._ws = await asyncio.wait_for(
                connect(
                    self.url,
                    additional_headers=headers(self._api_key),
                    max_size=None,
                    compression=None,
                    open_timeout=None,
                ),
                self._open_timeout,
            )
        except InvalidStatus as e:
            r = e.response
            raise _errors.from_response(r.status_code, bytes(r.body or b""), r.headers) from None
        except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:
            raise _errors.LipsyncError(
                f"cannot open a live session at {self.url}: {e}", error_type="connection_failed"
            ) from e
        try:
            await self._ws.send(json.dumps(self.opening))
            msg = await asyncio.wait_for(self._ws.recv(), self._open_timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise _errors.LipsyncError(
                f"no `ready` within {self._open_timeout} s", error_type="timeout"
            ) from None
        except ConnectionClosed as e:
            raise self._closed_error(e) from None
        doc = json.loads(msg) if isinstance(msg, str) else {}
        if doc.get("type") == "error":
            raise await self._error(doc)
        if doc.get("type") != "ready":
            await self.close()
            raise _errors.LipsyncError(
                f"expected the `ready` message, got {str(msg)[:200]!r}", error_type="bad_stream"
            )
        self.ready = doc
        self.ready_at = asyncio.get_running_loop().time()

    async def close(self) -> None:
        """Closes the socket (the server stops the session; use `end()` first to have
        everything sent drawn)."""
        self._finished = True
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._wake is not None:
            self._wake.set()

    @property
    def width(self) -> int:
        return int(self.ready["width"])

    @property
    def height(self) -> int:
        return int(self.ready["height"])

    @property
    def fps(self) -> float:
        return float(self.ready["fps"])

    @property
    def draw_fps(self) -> float | None:
        """The frame rate the server draws this session at (`ready`'s `draw_fps`), or None
        when the server does not say."""
        v = self.ready.get("draw_fps")
        return float(v) if isinstance(v, (int, float)) else None

    def samples_of(self, index: int) -> int:
        """Samples (16 kHz) of frame `index`'s audio."""
        fps = self.fps
        return int((index + 1) * AUDIO_RATE / fps) - int(index * AUDIO_RATE / fps)

    # Sending

    def _socket(self) -> ClientConnection:
        if self._ws is None:
            raise _errors.LipsyncError("the live session is not open", error_type="closed")
        return self._ws

    async def _send(self, data: str | bytes) -> None:
        try:
            await self._socket().send(data)
        except ConnectionClosed as e:
            raise self._closed_error(e) from None

    async def send_audio(self, pcm: bytes | bytearray | memoryview) -> None:
        """Speech, s16le at the session's sample rate and channels, in pieces of any size,
        sent no faster than the avatar should speak it (a TTS that runs ahead is fine: the
        server keeps up to `--max-audio-seconds` of it)."""
        if not pcm:
            return
        if self._stale:
            self._audio_after_clear = True
        self.last_audio_at = asyncio.get_running_loop().time()
        await self._send(bytes(pcm))

    async def clear(self) -> None:
        """Interrupts: the server drops the audio not yet drawn and idles; speaking frames it
        had drawn before are dropped here (and from `paced()`'s buffer)."""
        self._stale = True
        self._audio_after_clear = False
        await self._send('{"type": "clear"}')
        if self._on_clear is not None:
            self._on_clear()

    async def end(self) -> None:
        """Everything sent is drawn, then `idle`, then the `end` event, then the server
        closes the session."""
        self._ending = True
        await self._send('{"type": "end"}')

    # Receiving

    def _closed_error(self, e: ConnectionClosed) -> _errors.LipsyncError:
        code = e.rcvd.code if e.rcvd is not None else None
        reason = e.rcvd.reason if e.rcvd is not None else ""
        return _errors.LipsyncError(
            f"the live session was closed (code {code}{': ' + reason if reason else ''})",
            error_type="session_closed",
            close_code=code,
        )

    async def _error(self, doc: dict[str, Any]) -> _errors.LipsyncError:
        """The error of an error message; waits briefly for the close that follows it."""
        self._finished = True
        code = None
        ws = self._ws
        if ws is not None:
            try:
                await asyncio.wait_for(ws.wait_closed(), 5)
            except asyncio.TimeoutError:
                await ws.close()
            code = ws.close_code
        return _errors.from_live_message(doc, close_code=code)

    def __aiter__(self) -> LiveSession:
        return self

    async def __anext__(self) -> LiveItem:
        """The next frame or event as received (the `ready` event first)."""
        if self._ready_pending:
            self._ready_pending = False
            return LiveEvent("ready", self.ready)
        while True:
            if self._finished:
                raise StopAsyncIteration
            try:
                msg = await self._socket().recv()
            except ConnectionClosed as e:
                # 1000 after `end`, 1001 (server stopping), or closed here by close()
                normal = isinstance(e, ConnectionClosedOK) or self._closing
                self._finished = True
                if normal:
                    raise StopAsyncIteration from None
                raise self._closed_error(e) from None
            item = await self._parse(msg)
            if item is not None:
                return item

    async def _parse(self, msg: str | bytes) -> LiveItem | None:
        if isinstance(msg, str):
            doc = json.loads(msg)
            kind = doc.get("type")
            if kind == "error":
                raise await self._error(doc)
            if kind == "idle":
                self._speaking = False
                self._stale = False
            elif kind == "speaking":
                self._speaking = True
                if self._stale and not self._audio_after_clear:
                    return None  # an utterance the clear dropped
                self._stale = False
            elif kind == "end":
                self.stats = dict(doc.get("stats") or {})
            return LiveEvent(str(kind), doc)
        if len(msg) < _HEADER.size:
            raise _errors.LipsyncError("a frame message shorter than its header", error_type="bad_stream")
        index, pts, n = _HEADER.unpack_from(msg)
        self.max_index = max(self.max_index, index)
        if self._stale and self._speaking:
            return None  # drawn before the server saw the clear
        jpeg = msg[_HEADER.size : _HEADER.size + n]
        audio = msg[_HEADER.size + n :]
        if not self._speaking and self._idle_cache is not None and self._idle_cache[0] == jpeg:
            w, h, rgb = self._idle_cache[1]
        else:
            w, h, rgb = _decode_jpeg(jpeg)
            if not self._speaking:
                self._idle_cache = (jpeg, (w, h, rgb))
        return LiveFrame(index, pts, w, h, rgb, audio, self._speaking, jpeg=jpeg)

    # Pacing

    async def paced(self) -> AsyncIterator[LiveItem]:
        """The session's frames and events, each yielded at its presentation time on this
        machine's clock (frames that come late at once, in order): the frames a player
        shows. The clock is taken from the idle frames, which the server sends when due.
        Frames dropped by `clear()` are replaced by copies of the last idle frame (`filled`),
        so the video stays continuous. Ends after the `end` event."""
        loop = asyncio.get_running_loop()
        buf: deque[LiveItem] = deque()
        wake = asyncio.Event()
        self._wake = wake
        origin: float | None = None
        done = False
        error: BaseException | None = None

        async def read() -> None:
            nonlocal origin, done, error
            try:
                async for item in self:
                    if isinstance(item, LiveFrame) and not item.speaking:
                        o = loop.time() - item.pts
                        origin = o if origin is None else min(origin, o)
                    buf.append(item)
                    wake.set()
            except Exception as e:  # raised to the consumer, in order
                error = e
            finally:
                done = True
                wake.set()

        def purge() -> None:
            kept = [
                x
                for x in buf
                if not (isinstance(x, LiveFrame) and x.speaking)
                and not (isinstance(x, LiveEvent) and x.type == "speaking")
            ]
            buf.clear()
            buf.extend(kept)
            wake.set()

        self._on_clear = purge
        reader = asyncio.create_task(read())
        expected: int | None = None  # the next frame index to yield
        held: LiveFrame | None = None  # the last idle frame yielded
        try:
            while True:
                now = loop.time()
                head = buf[0] if buf else None
                timeout: float | None = None
                # A frame that will never come (dropped after a clear): fill it in.
                if expected is not None and held is not None and origin is not None:
                    head_index: int | None = None
                    if isinstance(head, LiveFrame):
                        head_index = head.index
                    elif isinstance(head, LiveEvent) and isinstance(head.data.get("frame"), int):
                        head_index = head.data["frame"]
                    gap = (head_index is not None and head_index > expected) or (
                        head is None and expected <= self.max_index
                    )
                    if gap:
                        due = origin + expected / self.fps
                        if now >= due:
                            frame = LiveFrame(
                                expected,
                                expected / self.fps,
                                held.width,
                                held.height,
                                held.rgb,
                                bytes(2 * self.samples_of(expected)),
                                False,
                                filled=True,
                            )
                            expected += 1
                            yield frame
                            continue
                        timeout = due - now
                        head = None  # wait for the gap's frame time (or news)
                if head is not None:
                    pts: float | None = None
                    if isinstance(head, LiveFrame):
                        pts = head.pts
                    elif isinstance(head.data.get("pts"), (int, float)):
                        pts = float(head.data["pts"])
                    due = now if origin is None or pts is None else origin + pts
                    if now >= due:
                        buf.popleft()
                        if isinstance(head, LiveFrame):
                            expected = head.index + 1
                            if not head.speaking:
                                held = head
                        yield head
                        continue
                    timeout = due - now
                elif timeout is None and done:
                    if error is not None:
                        raise error
                    return
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            reader.cancel()
            try:
                await reader
            except BaseException:
                pass
            if self._wake is wake:
                self._wake = None
            if self._on_clear is purge:
                self._on_clear = None


T = TypeVar("T")


class UtteranceEnds(Generic[T]):
    """Holds the end marks of utterances (Pipecat's `TTSStoppedFrame`, LiveKit's
    `AudioSegmentEnd`) until the paced output has shown the utterance's last frame.

    The protocol has no "utterance ended" message: the server closes an utterance after its
    utterance gap without audio, draws the rest, and says `idle`. An utterance starts at a
    frame no earlier than its first audio's arrival (session time), and its frames reach at
    least the time its last audio arrived (when the speech comes no slower than real time),
    less the few frames the file rule leaves out at its end. So a mark is released by the
    first idle run shown that starts after the first audio sent since the previous mark and
    no more than `SLACK` seconds before the last one; or, for speech that trickled in slower
    than real time, once the output has been idle for `LATE` seconds past the last audio.
    Call `sent()` after each audio message and `shown()` for each paced item.
    """

    SLACK = 0.25
    LATE = 1.0

    def __init__(self) -> None:
        self._pending: list[tuple[float, float, T]] = []  # (first audio, last audio, mark)
        self._begin: float | None = None  # first audio since the last mark
        self._last = float("-inf")
        self._idle_pts: float | None = None  # the idle run shown; None while speaking

    @staticmethod
    def _now(live: LiveSession) -> float:
        if live.last_audio_at is None or live.ready_at is None:
            return float("-inf")
        return live.last_audio_at - live.ready_at

    def sent(self, live: LiveSession) -> None:
        """Audio was sent (call after `send_audio`)."""
        t = self._now(live)
        if self._begin is None:
            self._begin = t
        self._last = t

    def _done(self, begin: float, last: float, pts: float | None = None) -> bool:
        idle = self._idle_pts
        if idle is None or idle < begin:
            return False
        return idle >= last - self.SLACK or (pts is not None and pts >= last + self.LATE)

    def mark(self, marker: T) -> list[T]:
        """An utterance's end: returns the marks that can go out now (this one, when the
        output is already idle after its audio)."""
        begin = self._begin if self._begin is not None else float("-inf")
        last = self._last if self._begin is not None else float("-inf")
        self._begin = None
        if not self._pending and self._done(begin, last):
            return [marker]
        self._pending.append((begin, last, marker))
        return []

    def shown(self, item: LiveItem) -> list[T]:
        """A paced frame or event was shown: returns the marks it releases."""
        pts: float | None = None
        if isinstance(item, LiveEvent):
            if item.type == "speaking":
                self._idle_pts = None
                return []
            if item.type == "idle":
                p = item.data.get("pts")
                self._idle_pts = float(p) if isinstance(p, (int, float)) else float("inf")
            elif item.type == "end":
                self._idle_pts = float("inf")
            else:
                return []
        elif item.speaking:
            return []
        else:
            pts = item.pts
        out: list[T] = []
        while self._pending and self._done(self._pending[0][0], self._pending[0][1], pts):
            out.append(self._pending.pop(0)[2])
        return out

    def clear(self) -> list[T]:
        """Interrupted: forgets the audio sent and returns the marks held (their utterances
        will not be shown)."""
        out = [m for _, _, m in self._pending]
        self._pending.clear()
        self._begin = None
        return out


class SpeechPacer:
    """Sends speech to a live session at most `max_ahead` seconds ahead of real time, and
    end marks in order with it.

    The server draws speaking frames as soon as their audio is there and sends them at once;
    frame numbers only go forward, so after `clear()` the next speech can start only after
    the frames it had drawn ahead. A voice agent's TTS usually runs far ahead of real time:
    fed through a pacer, the session is never more than `max_ahead` seconds ahead, so an
    interruption leaves at most that much behind (and the audio still queued here is simply
    dropped). `push()` never waits; a task sends the queue.

    Args:
        live: the open session.
        max_ahead: seconds of speech the session may hold beyond the present.
        on_sent: called after each piece of audio is sent.
        on_mark: called with each mark (`push_mark`) once the audio before it has been sent.
    """

    PIECE = 0.04  # seconds: the unit sent

    def __init__(
        self,
        live: LiveSession,
        *,
        max_ahead: float = 1.0,
        on_sent: Any = None,
        on_mark: Any = None,
    ) -> None:
        self._live = live
        self.max_ahead = max_ahead
        self._on_sent = on_sent
        self._on_mark = on_mark
        self._bps = live.sample_rate * 2 * live.channels
        self._queue: deque[bytes | tuple[Any]] = deque()
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._clock = float("-inf")  # session time up to which speech has been sent
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    @property
    def queued_seconds(self) -> float:
        return sum(len(x) for x in self._queue if isinstance(x, bytes)) / self._bps

    def push(self, pcm: bytes) -> None:
        """Queues speech (s16le in the session's format)."""
        step = max(2 * self._live.channels, int(self.PIECE * self._bps) // (2 * self._live.channels) * 2 * self._live.channels)
        for i in range(0, len(pcm), step):
            self._queue.append(bytes(pcm[i : i + step]))
        self._kick()

    def push_mark(self, mark: Any) -> None:
        """Queues a mark: `on_mark(mark)` is called once the speech queued before it is sent."""
        self._queue.append((mark,))
        self._kick()

    def _kick(self) -> None:
        if self._queue:
            self._empty.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def drain(self) -> None:
        """Waits until everything queued has been sent (raises what sending raised)."""
        await self._empty.wait()
        if self.error is not None:
            raise self.error

    async def clear(self) -> None:
        """Drops the queue and clears the session."""
        self._queue.clear()
        self._empty.set()
        self._clock = float("-inf")
        await self._live.clear()

    async def aclose(self) -> None:
        self._queue.clear()
        self._empty.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
            self._task = None

    def _now(self) -> float:
        ready = self._live.ready_at if self._live.ready_at is not None else 0.0
        return asyncio.get_running_loop().time() - ready

    async def _run(self) -> None:
        try:
            while True:
                if not self._queue:
                    self._empty.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                head = self._queue[0]
                if isinstance(head, tuple):
                    self._queue.popleft()
                    if self._on_mark is not None:
                        await _maybe_await(self._on_mark(head[0]))
                    continue
                now = self._now()
                clock = max(self._clock, now)
                if clock - now > self.max_ahead:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), clock - now - self.max_ahead)
                    except asyncio.TimeoutError:
                        pass
                    continue
                self._queue.popleft()
                await self._live.send_audio(head)
                self._clock = clock + len(head) / self._bps
                if self._on_sent is not None:
                    await _maybe_await(self._on_sent())
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
            self._queue.clear()
            self._empty.set()


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x):
        await x
