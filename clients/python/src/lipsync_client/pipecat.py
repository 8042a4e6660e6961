"""A lipsync avatar in a Pipecat pipeline (`pip install "lipsync-client[pipecat]"`).

    pipeline = Pipeline([
        transport.input(), stt, user_aggregator, llm, tts,
        LipsyncVideoService("http://127.0.0.1:8080", avatar_id),
        transport.output(),           # video_out_enabled=True, video_out_is_live=True
        assistant_aggregator,
    ])

`LipsyncVideoService` goes right after the TTS. It sends the TTS audio to a live session
(`GET /v1/stream`, JPEG output) instead of passing it on, and pushes downstream, in order
and paced in real time, the avatar's frames as `OutputImageRawFrame`s (RGB, `pts` in
nanoseconds, `metadata["lipsync_speaking"]`) with, for each speaking frame, its share of the
speech as a `TTSAudioRawFrame` (16 kHz mono; the output transport resamples it). Idle frames
carry no audio, so the bot is not "speaking" while the face idles.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import numpy as np
    from loguru import logger
    from pipecat.audio.utils import create_stream_resampler
    from pipecat.frames.frames import (
        CancelFrame,
        EndFrame,
        Frame,
        InterruptionFrame,
        OutputImageRawFrame,
        StartFrame,
        TTSAudioRawFrame,
        TTSStartedFrame,
        TTSStoppedFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.ai_service import AIService
    from pipecat.services.settings import ServiceSettings
except ModuleNotFoundError as e:  # pragma: no cover - depends on the extra
    raise ImportError(
        f"lipsync_client.pipecat needs Pipecat ({e}): pip install \"lipsync-client[pipecat]\""
    ) from e

from ._client import AsyncClient
from ._errors import LipsyncError
from ._live import AUDIO_RATE, LiveEvent, LiveFrame, LiveSession, SpeechPacer, UtteranceEnds

__all__ = ["LipsyncVideoService"]


class LipsyncVideoService(AIService):
    """A talking face for the TTS's speech, drawn by a lipsync server.

    Args:
        base_url: the server, e.g. `http://127.0.0.1:8080`.
        avatar_id: an avatar made with `POST /v1/avatars` (`Client.create_avatar`).
        fps: the video's frame rate (the output transport's `video_out_framerate`).
        api_key: the server's API key, if it has one.
        open_timeout: seconds to wait for the session's `ready`.
        end_timeout: seconds an `EndFrame` waits for the speech already sent to be shown.
        max_ahead: seconds of speech sent to the server ahead of real time (a TTS runs far
            ahead; the rest waits here, so an interruption drops it at once and the next
            reply starts within about this long).
        min_draw_fps: the lowest drawing rate the session accepts (sent only when given; a
            server that cannot draw that fast refuses the session, `over_capacity`).

    Frames in: `TTSAudioRawFrame` (any rate, mono or stereo: resampled to the session's
    16 kHz mono and not passed on; passed on when the session could not be opened, which is
    reported upstream as an `ErrorFrame`), `TTSStartedFrame` (passed on), `TTSStoppedFrame` (passed
    on after the utterance's last frame), `InterruptionFrame` (the session is cleared: the
    face idles within a frame or two; passed on). `StartFrame` opens the session, `EndFrame`
    lets it show what was sent and closes it, `CancelFrame` closes it at once. TTFB metrics:
    first TTS audio of an utterance → its first speaking frame pushed.
    """

    def __init__(
        self,
        base_url: str,
        avatar_id: str,
        *,
        fps: float = 25,
        api_key: str | None = None,
        open_timeout: float = 60.0,
        end_timeout: float = 60.0,
        max_ahead: float = 1.0,
        min_draw_fps: float | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("settings", ServiceSettings(model="wav2lip"))
        super().__init__(**kwargs)
        self._client = AsyncClient(base_url, api_key=api_key, timeout=open_timeout)
        self._avatar_id = avatar_id
        self._fps = fps
        self._end_timeout = end_timeout
        self._max_ahead = max_ahead
        self._min_draw_fps = min_draw_fps
        self._live: LiveSession | None = None
        self._pacer: SpeechPacer | None = None
        self._output: asyncio.Task[None] | None = None
        self._resampler: Any = None
        self._resampler_rate: int | None = None
        self._ends: UtteranceEnds[TTSStoppedFrame] = UtteranceEnds()
        self._in_utterance = False
        self._ttfb_running = False
        self._context_id: str | None = None
        self._stats: dict[str, Any] | None = None

    def can_generate_metrics(self) -> bool:
        return True

    @property
    def live(self) -> LiveSession | None:
        """The open live session (its `ready` message, `draw_fps`), None when closed."""
        return self._live

    @property
    def stats(self) -> dict[str, Any] | None:
        """The last session's statistics (its `end` message), once it has ended."""
        return self._stats

    # Lifecycle

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        live = self._client.live(
            self._avatar_id, fps=self._fps, sample_rate=AUDIO_RATE, min_draw_fps=self._min_draw_fps
        )
        try:
            await live.open()
        except LipsyncError as e:
            await self.push_error(error_msg=f"lipsync: cannot open a live session: {e}", exception=e)
            return
        self._live = live
        self._pacer = SpeechPacer(
            live,
            max_ahead=self._max_ahead,
            on_sent=lambda: self._ends.sent(live),
            on_mark=self._on_mark,
        )

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        live, output, pacer = self._live, self._output, self._pacer
        if live is None or pacer is None:
            return
        try:
            await self._flush_resampler()
            await asyncio.wait_for(pacer.drain(), self._end_timeout)
            await live.end()
            if output is not None:
                await asyncio.wait_for(asyncio.shield(output), self._end_timeout)
        except (LipsyncError, asyncio.TimeoutError) as e:
            logger.warning(f"{self}: the live session did not end cleanly: {e!r}")
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def cleanup(self) -> None:
        await super().cleanup()  # type: ignore[no-untyped-call]
        await self._close()
        await self._client.aclose()

    async def _close(self) -> None:
        live, self._live = self._live, None
        output, self._output = self._output, None
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            await pacer.aclose()
        if output is not None and not output.done():
            await self.cancel_task(output)
        if live is not None:
            self._stats = live.stats
            await live.close()

    # Frames

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            if self._live is not None:
                self._output = self.create_task(self._push_output(self._live))
        elif direction != FrameDirection.DOWNSTREAM:
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSAudioRawFrame):
            if self._pacer is None:
                await self.push_frame(frame, direction)  # no session: the bot still speaks
            else:
                await self._send_speech(frame)
        elif isinstance(frame, TTSStartedFrame):
            self._context_id = frame.context_id
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSStoppedFrame):
            await self._flush_resampler()
            self._in_utterance = False
            if self._pacer is not None:
                self._pacer.push_mark(frame)
            else:
                await self.push_frame(frame, direction)
        elif isinstance(frame, InterruptionFrame):
            await self._interrupt()
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _on_mark(self, stopped: TTSStoppedFrame) -> None:
        for frame in self._ends.mark(stopped):
            await self.push_frame(frame)

    async def _send_speech(self, frame: TTSAudioRawFrame) -> None:
        if self._pacer is None:
            return
        if frame.context_id is not None:
            self._context_id = frame.context_id
        audio = frame.audio
        if frame.num_channels > 1:
            samples = np.frombuffer(audio, dtype=np.int16).reshape(-1, frame.num_channels)
            audio = samples.mean(axis=1).round().astype(np.int16).tobytes()
        if frame.sample_rate != AUDIO_RATE:
            if self._resampler is None or self._resampler_rate != frame.sample_rate:
                await self._flush_resampler()
                self._resampler = create_stream_resampler(clear_after_secs=None)
                self._resampler_rate = frame.sample_rate
            audio = await self._resampler.resample(audio, frame.sample_rate, AUDIO_RATE)
        await self._send(audio)

    async def _send(self, pcm: bytes) -> None:
        if not pcm or self._pacer is None:
            return
        if not self._in_utterance:
            self._in_utterance = True
            self._ttfb_running = True
            await self.start_ttfb_metrics()
        self._pacer.push(pcm)

    async def _flush_resampler(self) -> None:
        """Sends the audio the resampler still holds (at the end of an utterance)."""
        if self._resampler is None:
            return
        await self._send(await self._resampler.flush())

    async def _interrupt(self) -> None:
        if self._resampler is not None:
            await self._resampler.reset()
        self._ends.clear()
        self._in_utterance = False
        self._ttfb_running = False
        if self._pacer is not None:
            try:
                await self._pacer.clear()
            except LipsyncError as e:
                await self.push_error(error_msg=f"lipsync: {e}", exception=e)

    async def _push_output(self, live: LiveSession) -> None:
        """The session's frames, paced, downstream."""
        try:
            async for item in live.paced():
                if isinstance(item, LiveFrame):
                    await self._push_live_frame(item)
                for stopped in self._ends.shown(item):
                    await self.push_frame(stopped)
                if isinstance(item, LiveEvent) and item.type == "end":
                    break
        except LipsyncError as e:
            await self.push_error(error_msg=f"lipsync: the live session failed: {e}", exception=e)

    async def _push_live_frame(self, f: LiveFrame) -> None:
        pts = round(f.pts * 1e9)
        image = OutputImageRawFrame(image=f.rgb, size=(f.width, f.height), format="RGB")
        image.pts = pts
        image.metadata["lipsync_speaking"] = f.speaking
        image.metadata["lipsync_frame"] = f.index
        await self.push_frame(image)
        if f.speaking:
            if self._ttfb_running:
                self._ttfb_running = False
                await self.stop_ttfb_metrics()
            audio = TTSAudioRawFrame(
                audio=f.audio, sample_rate=AUDIO_RATE, num_channels=1, context_id=self._context_id
            )
            audio.pts = pts
            audio.metadata["lipsync_frame"] = f.index
            await self.push_frame(audio)
