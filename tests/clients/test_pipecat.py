"""`lipsync_client.pipecat.LipsyncVideoService` in Pipecat 1.14 pipelines run by Pipecat's
own test utilities (`pipecat.tests.utils.run_test`: a source, the processor, a sink, no
transport) against the release server. TTS audio frames are made from the repository's
speech; `Recorder` notes when each frame reaches the end of the pipeline."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import soxr
from pipecat.frames.frames import (
    CancelFrame,
    ErrorFrame,
    InterruptionFrame,
    MetricsFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import SleepFrame, run_test

from conftest import API_KEY, read_speech
from lipsync_client.pipecat import LipsyncVideoService

FPS = 25
NS = 1_000_000_000


class Recorder(FrameProcessor):
    """Passes every frame on, noting `(monotonic time, frame)` of the downstream ones."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[float, object]] = []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.log.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)


def tts_frames(pcm: bytes, rate: int, *, chunk_s: float, paced: bool) -> list:
    """The TTS's output: audio frames of `chunk_s` seconds, with sleeps of their length
    between them when paced in real time."""
    step = int(rate * chunk_s) * 2
    frames: list = []
    for i in range(0, len(pcm), step):
        frames.append(TTSAudioRawFrame(pcm[i : i + step], rate, 1))
        if paced:
            frames.append(SleepFrame(sleep=chunk_s))
    return frames


def service(server, avatar, live_opts) -> LipsyncVideoService:
    return LipsyncVideoService(server.url, avatar["id"], fps=FPS, api_key=API_KEY, **live_opts)


def images(log):
    return [(t, f) for t, f in log if isinstance(f, OutputImageRawFrame)]


@pytest.mark.timeout(90)
def test_tts_paced_in_real_time_comes_out_as_frames_and_speech(server, avatar, live_opts):
    pcm = read_speech(seconds=3.0)
    svc, rec = service(server, avatar, live_opts), Recorder()
    frames = [
        SleepFrame(sleep=0.4),
        TTSStartedFrame(),
        *tts_frames(pcm, 16000, chunk_s=0.02, paced=True),
        TTSStoppedFrame(),
        SleepFrame(sleep=0.5),
    ]
    down, up = asyncio.run(
        run_test(
            Pipeline([svc, rec]),
            frames_to_send=frames,
            start_timeout=60,
            pipeline_params=PipelineParams(enable_metrics=True),
        )
    )
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    log = rec.log
    imgs = images(log)
    # Every frame of the session, in order: contiguous numbers, pts 40 ms apart, RGB.
    indices = [f.metadata["lipsync_frame"] for _, f in imgs]
    assert indices == list(range(len(indices)))
    assert all(f.pts == round(f.metadata["lipsync_frame"] * NS / FPS) for _, f in imgs)
    assert all(f.format == "RGB" and len(f.image) == f.size[0] * f.size[1] * 3 for _, f in imgs)
    speaking = [f for _, f in imgs if f.metadata["lipsync_speaking"]]
    # About 3 s × 25 fps speaking frames (the file rule leaves out the last few windows).
    assert 71 <= len(speaking) <= 75, len(speaking)
    # The server counted as many (EndFrame let the session finish before it closed).
    assert svc.stats is not None and svc.stats["speaking_frames"] == len(speaking), svc.stats
    assert svc.stats["frames"] == len(imgs) and svc.stats["utterances"] == 1, svc.stats
    # Each speaking frame is followed by its speech, with its pts; idle frames have none.
    audio = [f for _, f in log if isinstance(f, TTSAudioRawFrame)]
    assert len(audio) == len(speaking)
    order = [f for _, f in log if isinstance(f, (OutputImageRawFrame, TTSAudioRawFrame))]
    for i, f in enumerate(order):
        if isinstance(f, TTSAudioRawFrame):
            prev = order[i - 1]
            assert isinstance(prev, OutputImageRawFrame) and prev.metadata["lipsync_speaking"]
            assert f.pts == prev.pts and (f.sample_rate, f.num_channels) == (16000, 1)
    back = b"".join(f.audio for f in audio)
    a, b = np.frombuffer(back, np.int16), np.frombuffer(pcm[: len(back)], np.int16)
    assert len(back) >= len(pcm) - 4 * 1280 and np.abs(a.astype(int) - b).max() <= 1, "the speech, back"
    # Paced: the speaking frames reach the sink no faster than real time (a CPU server that
    # draws more slowly than that makes some late).
    t_speak = [t for t, f in imgs if f.metadata["lipsync_speaking"]]
    span, want = t_speak[-1] - t_speak[0], (len(speaking) - 1) / FPS
    assert span >= 0.95 * want, (span, want)
    # TTSStartedFrame before the speech, TTSStoppedFrame after its last frame.
    kinds = [type(f).__name__ for _, f in log]
    first_speaking = next(i for i, (_, f) in enumerate(log) if f is speaking[0])
    last_audio = max(i for i, (_, f) in enumerate(log) if isinstance(f, TTSAudioRawFrame))
    assert kinds.index("TTSStartedFrame") < first_speaking
    assert kinds.count("TTSStoppedFrame") == 1 and kinds.index("TTSStoppedFrame") > last_audio
    # TTFB: first TTS audio → first speaking frame.
    ttfb = [
        d.value
        for _, f in log
        if isinstance(f, MetricsFrame)
        for d in f.data
        # (the worker reports a 0 for every processor at start)
        if isinstance(d, TTFBMetricsData) and d.processor == svc.name and d.value > 0
    ]
    assert len(ttfb) == 1 and 0.05 < ttfb[0] < 3.0, ttfb
    print(f"\npipecat: {len(speaking)} speaking frames for 3.00 s of TTS at {FPS} fps "
          f"({len(imgs)} frames in all), shown over {span:.2f} s; TTFB {ttfb[0] * 1e3:.0f} ms")


@pytest.mark.timeout(90)
def test_an_interruption_stops_the_speech_at_once(server, avatar, live_opts):
    # A 24 kHz TTS far ahead of real time: all 4 s of speech in 0.2 s chunks at once.
    speech = np.frombuffer(read_speech(), np.int16)
    pcm24 = soxr.resample(speech, 16000, 24000).astype(np.int16).tobytes()
    svc, rec = service(server, avatar, live_opts), Recorder()
    frames = [
        SleepFrame(sleep=0.4),
        TTSStartedFrame(),
        *tts_frames(pcm24, 24000, chunk_s=0.2, paced=False),
        TTSStoppedFrame(),
        # Mid-speech: the 4 s reply starts on screen one lag after it was sent (up to about
        # 0.8 s with the CPU model on 2 cores), so 2.5 s in, a second or more has been spoken.
        SleepFrame(sleep=2.5),
        InterruptionFrame(),
        SleepFrame(sleep=2.0),
        # The next reply, after the interruption.
        TTSStartedFrame(),
        *tts_frames(pcm24[: 2 * 24000 * 2], 24000, chunk_s=0.2, paced=False),
        TTSStoppedFrame(),
        SleepFrame(sleep=0.5),
    ]
    down, up = asyncio.run(run_test(Pipeline([svc, rec]), frames_to_send=frames, start_timeout=60))
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    log = rec.log
    t_int = next(t for t, f in log if isinstance(f, InterruptionFrame))
    i_int = next(i for i, (_, f) in enumerate(log) if isinstance(f, InterruptionFrame))
    imgs = images(log)
    indices = [f.metadata["lipsync_frame"] for _, f in imgs]
    assert indices == list(range(len(indices))), "continuous across the interruption"
    # The pts shown when the interruption came.
    pts_int = max(f.pts for _, f in log[:i_int] if isinstance(f, OutputImageRawFrame))
    spoke_before = [f for _, f in log[:i_int] if isinstance(f, OutputImageRawFrame) and f.metadata["lipsync_speaking"]]
    assert len(spoke_before) >= 20, "the face was speaking when interrupted"
    # The rest of the interrupted reply: nothing more than 1 s after the interruption.
    second_reply = next(t for t, f in log if isinstance(f, TTSStartedFrame) and t > t_int)
    after = [(t, f) for t, f in log[i_int:] if t < second_reply]
    late = [
        f for _, f in after
        if (isinstance(f, OutputImageRawFrame) and f.metadata["lipsync_speaking"]) or isinstance(f, TTSAudioRawFrame)
    ]
    assert all(f.pts <= pts_int + NS for f in late), [(f.pts - pts_int) / NS for f in late]
    last_speech = max((t for t, f in after if isinstance(f, TTSAudioRawFrame)), default=t_int)
    # The next reply is spoken: 2 s of speech, starting within about a second.
    reply = [(t, f) for t, f in log if t > second_reply and isinstance(f, OutputImageRawFrame) and f.metadata["lipsync_speaking"]]
    assert 46 <= len(reply) <= 50, len(reply)
    reply_delay = reply[0][0] - second_reply
    assert reply_delay < 2.0, reply_delay
    kinds = [type(f).__name__ for _, f in log]
    assert kinds.count("InterruptionFrame") == 1
    assert kinds.count("TTSStoppedFrame") == 1, "the interrupted reply's stop is dropped, the next one's kept"
    late_pts = max(((f.pts - pts_int) / NS for f in late), default=0.0)
    print(f"\npipecat interruption: {len(spoke_before)} speaking frames before it, {len(late)} frames of "
          f"speech after it (latest pts {late_pts:+.2f} s, last at {1e3 * (last_speech - t_int):.0f} ms); "
          f"next reply on screen {reply_delay * 1e3:.0f} ms after its TTS started")


@pytest.mark.timeout(60)
def test_cancel_closes_the_session(server, avatar, live_opts):
    svc, rec = service(server, avatar, live_opts), Recorder()
    pcm = read_speech(seconds=1.0)
    frames = [
        SleepFrame(sleep=0.3),
        TTSStartedFrame(),
        *tts_frames(pcm, 16000, chunk_s=0.1, paced=False),
        # Long enough for frames to come on a loaded machine: in a full test run on two slow
        # cores, none had come 0.5 s after the speech (the session's first frame is due a lag
        # of about 0.25 s after it opens).
        SleepFrame(sleep=1.5),
        CancelFrame(),
    ]
    seen: dict[str, float] = {}

    async def go():
        task = asyncio.create_task(
            run_test(Pipeline([svc, rec]), frames_to_send=frames, start_timeout=60, send_end_frame=False)
        )
        while svc.live is None and not task.done():
            await asyncio.sleep(0.01)
        seen["open"] = server.metric("lipsync_stream_sessions")
        return await task

    asyncio.run(go())
    assert seen["open"] == 1
    assert svc.live is None
    deadline = time.monotonic() + 5
    while server.metric("lipsync_stream_sessions") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("lipsync_stream_sessions") == 0
    assert images(rec.log), "frames came while it ran"


@pytest.mark.timeout(60)
def test_a_refused_session_is_an_error_upstream_and_the_bot_still_speaks(server):
    svc = LipsyncVideoService(server.url, "0" * 64, api_key=API_KEY)
    speech = tts_frames(read_speech(seconds=0.2), 16000, chunk_s=0.02, paced=False)
    down, up = asyncio.run(
        run_test(svc, frames_to_send=[TTSStartedFrame(), *speech, TTSStoppedFrame()], start_timeout=60)
    )
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "avatar_not_found" in errors[0].error, up
    assert not [f for f in down if isinstance(f, OutputImageRawFrame)]
    # Without a face, the TTS audio goes on as it came.
    assert [f for f in down if isinstance(f, TTSAudioRawFrame)] == [f for f in speech if isinstance(f, TTSAudioRawFrame)]
    assert isinstance(down[0], TTSStartedFrame) and isinstance(down[-1], TTSStoppedFrame)
