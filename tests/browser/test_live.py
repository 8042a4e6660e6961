"""Live mode of the try-it page: Chromium's fake microphone, fed from a WAV, speaks through
`GET /v1/stream` and the page shows the avatar live (fMP4 through MSE).

The microphone here plays one second of speech, then a second and a half of silence, over and
over: the page's voice gate opens and closes, so the avatar idles and speaks in turn.
"""

import array
import os
import re
import wave

import pytest
from playwright.sync_api import sync_playwright

from conftest import CHROMIUM, SPEECH, Page, Server
from test_page import choose_photo


@pytest.fixture(scope="module")
def live_browser(tmp_path_factory):
    """Chromium whose fake microphone plays speech, then silence (the file loops)."""
    wav = tmp_path_factory.mktemp("mic") / "speech-then-silence.wav"
    with wave.open(str(SPEECH)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        speech = w.readframes(w.getnframes())
    assert width == 2 and channels == 1
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(speech + array.array("h", [0] * int(rate * 1.5)).tobytes())
    args = [
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
    ]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args, timeout=60_000)
        yield b
        b.close()


@pytest.fixture
def live_page(live_browser, server):
    p = Page(live_browser, server.url)
    yield p
    p.close()


LIVE = "window.lipsyncLive"


def live(p: Page, expr: str):
    """`expr` evaluated in the page with `L` the live session."""
    return p.page.evaluate(f"() => {{ const L = {LIVE}; return {expr}; }}")


def watch_mouth(p: Page, box):
    """From now on every frame the live video shows is compared with the first idle frame shown,
    over the lower half of the face box (where the model draws the mouth): `window.mouth` gets
    {t, speaking, diff} per frame, diff the mean absolute difference of the pixels (0-255)."""
    p.page.evaluate(
        """([x1, y1, x2, y2]) => {
            const v = document.getElementById('live-video');
            const c = document.createElement('canvas');
            const ctx = c.getContext('2d', {willReadFrequently: true});
            const top = Math.round(y1 + (y2 - y1) * 0.55);
            let idle = null;
            window.mouth = [];
            const cb = (_, meta) => {
                const L = window.lipsyncLive;
                if (L && L.ready) {
                    c.width = v.videoWidth;
                    c.height = v.videoHeight;
                    ctx.drawImage(v, 0, 0);
                    const px = ctx.getImageData(x1, top, x2 - x1, y2 - top).data;
                    const speaking = speakingAt(L, meta.mediaTime);
                    if (!idle && !speaking) idle = px;
                    if (idle) {
                        let d = 0;
                        for (let i = 0; i < px.length; i += 4) d += Math.abs(px[i] - idle[i]) + Math.abs(px[i + 1] - idle[i + 1]) + Math.abs(px[i + 2] - idle[i + 2]);
                        window.mouth.push({t: meta.mediaTime, speaking, diff: d / (px.length / 4 * 3)});
                    }
                }
                v.requestVideoFrameCallback(cb);
            };
            v.requestVideoFrameCallback(cb);
        }""",
        box,
    )


def test_live_mode_shows_speaking_frames_from_the_microphone(live_page: Page):
    p = live_page
    p.open()
    assert p.page.is_visible("#live-start") and p.page.is_disabled("#live-stop")
    box = choose_photo(p)
    watch_mouth(p, box)
    # One face a second is enough here: on a 2-core machine the engine's measured capacity for a
    # session can fall below the default 5 and the session would be refused (over_capacity).
    p.page.fill("#live-min-draw", "1")
    p.page.click("#live-start")
    p.wait(f"() => {LIVE} && {LIVE}.ready", 60_000)
    ready = live(p, "L.ready")
    assert (ready["width"], ready["height"], ready["fps"]) == (512, 512, 25), ready
    assert ready["mime"].startswith('video/mp4; codecs="avc1.'), ready
    # The faces per second the server expects to draw: said on the status line when it is
    # fewer than the frame rate (the other speaking frames show the last face again).
    draw_fps = ready["draw_fps"]
    assert draw_fps > 0, ready
    drawing = f", drawing about {draw_fps:g} faces/s" if draw_fps < 25 else ""
    assert p.text("#live-status") == f"live: 512×512 at 25 fps{drawing}; speak", (p.text("#live-status"), ready)
    # Idle first, then the fake microphone's speech opens the voice gate: speaking frames shown.
    p.wait(f"() => {LIVE}.speakingShown >= 10", 90_000)
    p.wait("() => document.getElementById('live-latency').textContent.includes('on screen after')")
    p.shot("15-live-speaking")
    events = live(p, "L.events.map(e => e.type)")
    assert events[:3] == ["ready", "idle", "speaking"], events
    assert re.fullmatch(r"(speaking|idle) \(on screen: (speaking|idle)\)", p.text("#live-activity")), p.text("#live-activity")
    m = re.match(r"received after (\d+) ms, on screen after (\d+) ms \(utterance \d+\)", p.text("#live-latency"))
    assert m and 0 < int(m.group(1)) <= int(m.group(2)) < 30_000, p.text("#live-latency")
    # Speaking frames come back within 2 s of the utterance's first audio reaching the server
    # (on this page: sent by it; the fragment holding the utterance's first frame received).
    assert int(m.group(1)) <= 2_000, p.text("#live-latency")
    # The speaking frames drawn and held so far, as the server counted them at its last event.
    m = re.fullmatch(r"(\d+) received, \d+ speaking frames shown; (\d+) drawn, (\d+) held \(server\)", p.text("#live-frames"))
    # The server's counts come with its last activity event, which goes out before the frames
    # it counts have been through the encoder: they may run ahead of the frames received by
    # the encoder's delay (well under a second, 25 frames), never more.
    assert m and int(m.group(2)) + int(m.group(3)) <= int(m.group(1)) + 25, p.text("#live-frames")
    # Interrupt while the face speaks: the server drops what it has not drawn and idles again.
    # Early in an utterance (its "speaking" event less than 250 ms old), so the server still has
    # frames of it to drop: near its end the server may have sent its last frame already, and a
    # clear then interrupts nothing.
    p.wait(
        f"() => {{ const e = {LIVE}.events.findLast(x => x.type === 'idle' || x.type === 'speaking'); "
        f"return e !== undefined && e.type === 'speaking' && performance.now() - e.at < 250; }}",
        60_000,
    )
    p.page.click("#live-clear")
    cleared = live(p, "performance.now()")
    p.wait(f"() => {LIVE}.events.some(e => e.type === 'idle' && e.at > {cleared})", 30_000)
    p.shot("16-live-interrupted")

    # The speaking frames are the model's mouths, not the idle face: the mouth changes while
    # speaking, far more than the idle face's frames differ from one another (encoding noise).
    # Measured once the interrupted face has idled again: when the microphone's speech reaches
    # the server within a frame of `ready`, the first utterance starts at frame 1 and only one
    # idle frame precedes it, too few to measure the idle face's noise.
    p.wait("() => window.mouth.filter(f => !f.speaking).length >= 3", 30_000)
    mouth = p.page.evaluate("window.mouth")
    speaking = [f["diff"] for f in mouth if f["speaking"]]
    idle = [f["diff"] for f in mouth if not f["speaking"]]
    assert len(speaking) >= 10 and len(idle) >= 2, (len(speaking), len(idle))
    # (Measured: idle frames within 4 of the first one, speaking mouths about 30 away. Some
    # speaking frames look idle: the voice gate's last 400 ms are quiet, and the model draws
    # the idle face for silence.)
    assert max(idle) < 8 and max(speaking) > 15, (max(idle), max(speaking))
    # Playback caught up by playing faster, never by jumping over frames, and the first
    # utterance was on screen from its start (its first half second; a busy compositor may
    # drop a single frame, which the page does not control).
    assert live(p, "L.jumps") == 0
    first = live(p, "L.utterances[0]")
    assert any(f["speaking"] and first["pts"] - 1e-3 <= f["t"] < first["pts"] + 0.5 for f in mouth), (first, mouth)

    # Stop: everything sent is drawn, then the server's statistics, then it closes.
    p.page.click("#live-stop")
    p.wait(f"() => {LIVE}.closed", 60_000)
    assert p.text("#live-status") == "ended", p.text("#live-status")
    stats = live(p, "L.endStats")
    assert stats["speaking_frames"] >= 10 and stats["idle_frames"] > 0, stats
    # Every speaking frame drawn or held (the last face again), and faces drawn; the page
    # shows the end's counts.
    assert stats["drawn_frames"] + stats["held_frames"] == stats["speaking_frames"], stats
    assert stats["drawn_frames"] > 0, stats
    assert p.text("#live-frames").endswith(f"; {stats['drawn_frames']} drawn, {stats['held_frames']} held (server)"), p.text("#live-frames")
    assert stats["utterances"] >= 1 and stats["interrupted"] >= 1, stats
    assert stats["latency_ms_p50"] > 0, stats
    # Every frame the server counted came through as a fragment.
    assert live(p, "L.frames") == stats["frames"], (live(p, "L.frames"), stats)
    server = p.text("#live-server")
    assert re.match(r"latency p50 \d+ ms, p95 \d+ ms; \d+ frames \(\d+ speaking, \d+ idle\), \d+ utterances, [1-9]\d* interrupted", server), server
    assert re.match(r"\d+ \(server\), \d+ as received", p.text("#live-late")), p.text("#live-late")
    assert p.page.is_enabled("#live-start") and p.page.is_disabled("#live-clear")
    p.shot("17-live-ended")
    assert p.errors == []


def test_live_mode_sends_the_api_key_in_the_query(live_browser, tmp_path):
    server = Server("--api-key", "s3cret-key")
    try:
        p = Page(live_browser, server.url).open()
        p.page.fill("#api-key", "s3cret-key")
        choose_photo(p)
        # A wrong key: the page shows the API's message for the refused upgrade.
        p.page.fill("#api-key", "wrong")
        p.page.click("#live-start")
        p.wait("() => document.getElementById('live-status').classList.contains('bad')", 30_000)
        assert p.text("#live-status") == server.error_of(server.get("/v1/stream?api_key=wrong"))
        assert p.page.is_enabled("#live-start")
        # The right one, as ?api_key= (browsers cannot set headers on a WebSocket).
        p.page.fill("#api-key", "s3cret-key")
        p.page.fill("#live-min-draw", "1")  # as above: never refused for capacity on 2 cores
        p.page.click("#live-start")
        p.wait(f"() => {LIVE} && {LIVE}.ready && {LIVE}.frames > 0", 60_000)
        p.page.click("#live-stop")
        p.wait(f"() => {LIVE}.closed", 60_000)
        assert p.text("#live-status") == "ended", p.text("#live-status")
        assert live(p, "L.endStats.frames") == live(p, "L.frames") > 0
        assert not any("s3cret" in line for line in server.log), "the key is never logged"
        # Only the refused handshake and its plain GET are errors in the console.
        [handshake, plain] = p.errors
        assert handshake.startswith("WebSocket connection to") and "api_key=wrong" in handshake, handshake
        assert "status of 401" in plain, plain
        p.close()
    finally:
        server.stop()


def test_a_refused_opening_shows_the_servers_message(live_page: Page):
    p = live_page
    p.open()
    choose_photo(p)
    p.page.fill("#live-fps", "1000")
    p.page.click("#live-start")
    p.wait("() => document.getElementById('live-status').classList.contains('bad')", 30_000)
    # The session's error message (then close 1008), as the server words it.
    assert live(p, "L.error.error_type") == "bad_fps"
    assert p.text("#live-status") == live(p, "L.error.error") and "1000" in p.text("#live-status")
    assert p.page.is_enabled("#live-start") and p.page.is_disabled("#live-stop")
    assert live(p, "L.closed")
    assert p.errors == []
