"""A lipsync avatar for LiveKit Agents (`pip install "lipsync-client[livekit]"`).

`LipsyncVideoGenerator` is a `VideoGenerator` of `livekit.agents.voice.avatar`: it drops
into an `AvatarRunner`, which receives the agent's speech (`DataStreamAudioReceiver` in an
avatar worker, or `QueueAudioOutput` in the agent's own process) and publishes the avatar's
camera and microphone tracks through an `rtc.AVSynchronizer`:

    gen = LipsyncVideoGenerator("http://127.0.0.1:8080", avatar_id)
    await gen.start()
    runner = AvatarRunner(
        room,
        audio_recv=DataStreamAudioReceiver(room),
        video_gen=gen,
        options=AvatarOptions(video_width=gen.width, video_height=gen.height,
                              video_fps=25, audio_sample_rate=16000, audio_channels=1),
    )
    await runner.start()

See `examples/livekit_avatar_worker.py` for a whole worker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Union

try:
    import numpy as np
    from livekit import rtc
    from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator
except ModuleNotFoundError as e:  # pragma: no cover - depends on the extra
    raise ImportError(
        f"lipsync_client.livekit needs LiveKit Agents ({e}): "
        'pip install "lipsync-client[livekit]"'
    ) from e

from ._client import AsyncClient
from ._live import AUDIO_RATE, LiveEvent, LiveFrame, LiveSession, SpeechPacer, UtteranceEnds

__all__ = ["LipsyncVideoGenerator"]

Output = Union[rtc.VideoFrame, rtc.AudioFrame, AudioSegmentEnd]


class LipsyncVideoGenerator(VideoGenerator):
    """A `VideoGenerator` drawing the avatar with a lipsync live session.

    Args:
        base_url: the lipsync server, e.g. `http://127.0.0.1:8080`.
        avatar_id: an avatar made with `POST /v1/avatars`.
        fps: the video's frame rate (`AvatarOptions.video_fps`).
        api_key: the server's API key, if it has one.
        audio_sample_rate: the rate of the audio frames it yields: the `AvatarOptions`'
            `audio_sample_rate` (the runner's `AudioSource` takes only that rate). The speech
            pushed in may have any rate and channel count.
        open_timeout: seconds to wait for the session's `ready`.
        max_ahead: seconds of speech sent to the server ahead of real time (the agent's
            speech comes far ahead; the rest waits here, so `clear_buffer` drops it at once
            and the next reply starts within about this long).
        min_draw_fps: the lowest drawing rate the session accepts (sent only when given; a
            server that cannot draw that fast refuses the session, `over_capacity`).

    Iterating it yields, paced in real time, an `rtc.VideoFrame` (RGB24) per frame of the
    session, each speaking frame followed by its share of the speech as an
    `rtc.AudioFrame` (mono), and an `AudioSegmentEnd` once the last frame of each segment
    pushed has been yielded. `clear_buffer()` interrupts: the face idles again within a frame
    or two and the segments held are dropped. The session opens on `start()` (or the first
    use) and closes on `aclose()`.
    """

    def __init__(
        self,
        base_url: str,
        avatar_id: str,
        *,
        fps: float = 25,
        api_key: str | None = None,
        audio_sample_rate: int = AUDIO_RATE,
        open_timeout: float = 60.0,
        max_ahead: float = 1.0,
        min_draw_fps: float | None = None,
    ) -> None:
        self._client = AsyncClient(base_url, api_key=api_key, timeout=open_timeout)
        self._avatar_id = avatar_id
        self._fps = fps
        self._out_rate = audio_sample_rate
        self._max_ahead = max_ahead
        self._min_draw_fps = min_draw_fps
        self._live: LiveSession | None = None
        self._pacer: SpeechPacer | None = None
        self._opening = asyncio.Lock()
        self._in_resampler: rtc.AudioResampler | None = None
        self._in_format: tuple[int, int] | None = None
        self._out_resampler: rtc.AudioResampler | None = None
        self._ends: UtteranceEnds[AudioSegmentEnd] = UtteranceEnds()
        self._released: deque[AudioSegmentEnd] = deque()

    async def start(self) -> None:
        """Opens the live session (waits for its `ready`)."""
        async with self._opening:
            if self._live is None:
                live = self._client.live(
                    self._avatar_id,
                    fps=self._fps,
                    sample_rate=AUDIO_RATE,
                    min_draw_fps=self._min_draw_fps,
                )
                await live.open()
                self._live = live
                self._pacer = SpeechPacer(
                    live,
                    max_ahead=self._max_ahead,
                    on_sent=lambda: self._ends.sent(live),
                    on_mark=lambda end: self._released.extend(self._ends.mark(end)),
                )

    async def _session(self) -> tuple[LiveSession, SpeechPacer]:
        if self._live is None:
            await self.start()
        assert self._live is not None and self._pacer is not None
        return self._live, self._pacer

    @property
    def width(self) -> int:
        """The video's width (after `start()`)."""
        assert self._live is not None, "start() first"
        return self._live.width

    @property
    def height(self) -> int:
        assert self._live is not None, "start() first"
        return self._live.height

    @property
    def live(self) -> LiveSession | None:
        return self._live

    async def aclose(self) -> None:
        live, self._live = self._live, None
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            await pacer.aclose()
        if live is not None:
            await live.close()
        await self._client.aclose()

    # VideoGenerator

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        _, pacer = await self._session()
        if isinstance(frame, AudioSegmentEnd):
            if self._in_resampler is not None:
                self._send(pacer, self._in_resampler.flush())
                self._in_resampler, self._in_format = None, None
            pacer.push_mark(frame)
            return
        frames = [frame]
        if frame.sample_rate != AUDIO_RATE:
            fmt = (frame.sample_rate, frame.num_channels)
            if self._in_resampler is None or self._in_format != fmt:
                if self._in_resampler is not None:
                    self._send(pacer, self._in_resampler.flush())
                self._in_resampler = rtc.AudioResampler(
                    input_rate=frame.sample_rate,
                    output_rate=AUDIO_RATE,
                    num_channels=frame.num_channels,
                )
                self._in_format = fmt
            frames = self._in_resampler.push(frame)
        self._send(pacer, frames)

    @staticmethod
    def _send(pacer: SpeechPacer, frames: list[rtc.AudioFrame]) -> None:
        for f in frames:
            pcm = f.data.tobytes()
            if f.num_channels > 1:
                samples = np.frombuffer(pcm, dtype=np.int16).reshape(-1, f.num_channels)
                pcm = samples.mean(axis=1).round().astype(np.int16).tobytes()
            pacer.push(pcm)

    async def clear_buffer(self) -> None:
        _, pacer = await self._session()
        self._in_resampler, self._in_format = None, None
        self._ends.clear()
        await pacer.clear()

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Output]:
        live, _ = await self._session()
        async for item in live.paced():
            while self._released:
                yield self._released.popleft()
            if isinstance(item, LiveFrame):
                yield rtc.VideoFrame(item.width, item.height, rtc.VideoBufferType.RGB24, item.rgb)
                if item.speaking:
                    for audio in self._audio_out(item.audio):
                        yield audio
            for end in self._ends.shown(item):
                yield end
            if isinstance(item, LiveEvent) and item.type == "end":
                break
        while self._released:
            yield self._released.popleft()

    def _audio_out(self, pcm: bytes) -> list[rtc.AudioFrame]:
        frame = rtc.AudioFrame(pcm, AUDIO_RATE, 1, len(pcm) // 2)
        if self._out_rate == AUDIO_RATE:
            return [frame]
        if self._out_resampler is None:
            self._out_resampler = rtc.AudioResampler(
                input_rate=AUDIO_RATE, output_rate=self._out_rate, num_channels=1
            )
        return list(self._out_resampler.push(frame))
