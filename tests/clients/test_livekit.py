"""`lipsync_client.livekit.LipsyncVideoGenerator` (LiveKit Agents 1.8's `VideoGenerator`)
against the release server.

No LiveKit server can be installed here (none is distributed through PyPI or Debian), so
nothing is published: the generator is driven on its own, and inside a real `AvatarRunner`
with the agents' in-process audio path (`QueueAudioOutput`, what the agent's own process
uses in local mode) and LiveKit's real `AVSynchronizer`, `AudioSource` and `VideoSource`
(the native library, which runs without a room); only the room's `publish_track` is a stub.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import soxr
from livekit import rtc
from livekit.agents.voice.avatar import (
    AudioSegmentEnd,
    AvatarOptions,
    AvatarRunner,
    QueueAudioOutput,
    VideoGenerator,
)

from conftest import API_KEY, read_speech
from lipsync_client.livekit import LipsyncVideoGenerator

FPS = 25


def frames_of(pcm: bytes, rate: int, chunk_s: float = 0.02) -> list[rtc.AudioFrame]:
    n = int(rate * chunk_s)
    out = []
    for i in range(0, len(pcm) // 2, n):
        data = pcm[2 * i : 2 * (i + n)]
        out.append(rtc.AudioFrame(data, rate, 1, len(data) // 2))
    return out


def speech_at(rate: int, seconds: float | None = None) -> bytes:
    mono = np.frombuffer(read_speech(seconds=seconds), np.int16)
    if rate == 16000:
        return mono.tobytes()
    return soxr.resample(mono, 16000, rate).astype(np.int16).tobytes()


async def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.timeout(90)
def test_the_generator_yields_frames_and_speech_in_step(server, avatar, live_opts):
    async def go():
        gen = LipsyncVideoGenerator(server.url, avatar["id"], fps=FPS, api_key=API_KEY, **live_opts)
        assert isinstance(gen, VideoGenerator)
        await gen.start()
        assert (gen.width, gen.height) == (avatar["width"], avatar["height"])
        loop = asyncio.get_running_loop()
        out: list[tuple[float, object]] = []
        marks: dict[str, float] = {}

        async def consume():
            async for item in gen:
                out.append((loop.time(), item))

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.4)
        # Two utterances from a 24 kHz stereo agent, paced in real time, then a 48 kHz one
        # pushed far ahead of real time and cleared after a second.
        for seconds in (1.0, 1.5):
            mono = np.frombuffer(speech_at(24000, seconds), np.int16)
            for f in frames_of(mono.tobytes(), 24000):
                stereo = np.repeat(np.frombuffer(f.data, np.int16), 2)
                await gen.push_audio(rtc.AudioFrame(stereo.tobytes(), 24000, 2, f.samples_per_channel))
                await asyncio.sleep(0.02)
            await gen.push_audio(AudioSegmentEnd())
            await wait_until(lambda: sum(isinstance(x, AudioSegmentEnd) for _, x in out) >= (1 if seconds == 1.0 else 2), 15, "the segment end")
            await asyncio.sleep(0.5)
        before = sum(isinstance(x, rtc.AudioFrame) for _, x in out)
        for f in frames_of(speech_at(48000), 48000):
            await gen.push_audio(f)
        await wait_until(lambda: sum(isinstance(x, rtc.AudioFrame) for _, x in out) >= before + FPS, 15, "speech")
        await gen.clear_buffer()
        marks["clear"] = loop.time()
        await asyncio.sleep(1.5)
        await gen.aclose()
        await asyncio.wait_for(consumer, 10)
        return out, marks

    out, marks = asyncio.run(asyncio.wait_for(go(), 80))
    video = [x for _, x in out if isinstance(x, rtc.VideoFrame)]
    assert all(v.type == rtc.VideoBufferType.RGB24 and (v.width, v.height) == (avatar["width"], avatar["height"]) for v in video)
    # Every audio frame right after its video frame (40 ms of 16 kHz mono each).
    kinds = [type(x).__name__ for _, x in out]
    for i, k in enumerate(kinds):
        if k == "AudioFrame":
            assert kinds[i - 1] == "VideoFrame", kinds[i - 3 : i + 1]
    audio = [x for _, x in out if isinstance(x, rtc.AudioFrame)]
    assert all((a.sample_rate, a.num_channels, a.samples_per_channel) == (16000, 1, 640) for a in audio)
    # One segment end after each utterance's last audio: 1 s and 1.5 s of speech.
    ends = [i for i, k in enumerate(kinds) if k == "AudioSegmentEnd"]
    assert len(ends) == 2, kinds.count("AudioSegmentEnd")
    first = [x for x in kinds[: ends[0]] if x == "AudioFrame"]
    second = [x for x in kinds[ends[0] : ends[1]] if x == "AudioFrame"]
    assert 22 <= len(first) <= 25 and 34 <= len(second) <= 38, (len(first), len(second))
    # Paced: video at 25 fps over the whole run, never faster (a CPU server that draws more
    # slowly than real time makes some frames late).
    t_video = [t for t, x in out if isinstance(x, rtc.VideoFrame)]
    rate = (len(t_video) - 1) / (t_video[-1] - t_video[0])
    assert FPS * 0.6 < rate < FPS + 0.5, rate
    # The clear: at most one frame of speech after it, and the face goes on (idle).
    after = [x for t, x in out if t >= marks["clear"]]
    assert sum(isinstance(x, rtc.AudioFrame) for x in after) <= 1
    assert sum(isinstance(x, rtc.VideoFrame) for x in after) >= FPS
    print(f"\nlivekit generator: {len(video)} video frames at {rate:.2f} fps, speech {len(first)} + "
          f"{len(second)} frames then cleared; {sum(isinstance(x, rtc.AudioFrame) for x in after)} audio frames after the clear")


class StubParticipant:
    def __init__(self):
        self.published: list[str] = []

    async def publish_track(self, track, options):
        self.published.append(track.name)
        return StubPublication()


class StubPublication:
    async def wait_for_subscription(self):
        return None


class StubRoom:
    """What `AvatarRunner` uses of an `rtc.Room`: connected; `publish_track` recorded."""

    def __init__(self):
        self.local_participant = StubParticipant()

    def isconnected(self) -> bool:
        return True

    def on(self, event, callback=None):
        return callback

    def off(self, event, callback=None):
        return None


@pytest.mark.timeout(90)
def test_it_drops_into_an_avatar_runner(server, avatar, live_opts):
    async def go():
        loop = asyncio.get_running_loop()
        gen = LipsyncVideoGenerator(
            server.url, avatar["id"], fps=FPS, api_key=API_KEY, audio_sample_rate=24000, **live_opts
        )
        await gen.start()
        agent_audio = QueueAudioOutput(sample_rate=24000)
        room = StubRoom()
        runner = AvatarRunner(
            room,
            audio_recv=agent_audio,
            video_gen=gen,
            options=AvatarOptions(
                video_width=gen.width, video_height=gen.height, video_fps=FPS,
                audio_sample_rate=24000, audio_channels=1,
            ),
        )
        pushed: list[tuple[float, object]] = []
        push = runner.av_sync.push

        async def recording_push(frame, timestamp=None):
            pushed.append((loop.time(), frame))
            await push(frame, timestamp)

        runner.av_sync.push = recording_push
        finished: list[tuple[float, object]] = []
        agent_audio.on("playback_finished", lambda ev: finished.append((loop.time(), ev)))
        await runner.start()
        await asyncio.sleep(0.5)
        # The agent says 2 s (its TTS far ahead of real time), then flushes the segment.
        t0 = loop.time()
        for f in frames_of(speech_at(24000, 2.0), 24000):
            await agent_audio.capture_frame(f)
        agent_audio.flush()
        await wait_until(lambda: len(finished) >= 1, 20, "playback_finished")
        done = loop.time()
        # Then 4 s, interrupted after a second of playback.
        for f in frames_of(speech_at(24000), 24000):
            await agent_audio.capture_frame(f)
        before = sum(isinstance(x, rtc.AudioFrame) for _, x in pushed)
        await wait_until(lambda: sum(isinstance(x, rtc.AudioFrame) for _, x in pushed) >= before + FPS, 20, "speech")
        agent_audio.clear_buffer()
        t_clear = loop.time()
        agent_audio.flush()
        await wait_until(lambda: len(finished) >= 2, 10, "the interrupted playback_finished")
        await asyncio.sleep(1.0)
        await runner.aclose()
        await gen.aclose()
        return pushed, finished, room, t0, done, t_clear

    pushed, finished, room, t0, done, t_clear = asyncio.run(asyncio.wait_for(go(), 80))
    assert room.local_participant.published == ["avatar_audio", "avatar_video"]
    (_, first), (t_int, second) = finished
    # The agent hears when its speech has played: all of it, not interrupted, in about its
    # duration after it was sent (plus the avatar's lag).
    assert not first.interrupted and 1.8 <= first.playback_position <= 2.05, first
    assert 2.0 <= done - t0 <= 6.0, done - t0
    assert second.interrupted and 0.9 <= second.playback_position <= 2.5, second
    audio_after = [(t, x) for t, x in pushed if t > t_clear + 0.1 and isinstance(x, rtc.AudioFrame)]
    assert not audio_after, len(audio_after)
    assert all(x.sample_rate == 24000 for _, x in pushed if isinstance(x, rtc.AudioFrame))
    video_after = [t for t, x in pushed if t > t_clear and isinstance(x, rtc.VideoFrame)]
    assert len(video_after) >= FPS * 0.8, "the face goes on after the clear"
    print(f"\nlivekit runner: playback finished {first.playback_position:.2f} s after {done - t0:.2f} s; "
          f"interrupted at {second.playback_position:.2f} s, finished {1e3 * (t_int - t_clear):.0f} ms after clear_buffer")
