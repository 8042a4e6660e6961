"""The try-it page (`GET /`) in a real headless Chromium against the release server.

Each state is saved as a screenshot under target/browser/. Requests are one second of speech on
the 512×512 photo (random weights on the CPU: a few seconds each).
"""

import base64
import re
import subprocess
import wave

from conftest import MEDIA, SPEECH, Page, Server

PHOTO = MEDIA / "astronaut.png"
FPS = 25


def speech_seconds() -> float:
    with wave.open(str(SPEECH)) as w:
        return w.getnframes() / w.getframerate()


def record_forms(p: Page):
    """From now on the page's fetch() calls keep the forms they send in `window.sentForms`."""
    p.page.evaluate(
        """() => {
            const original = window.fetch;
            window.sentForms = [];
            window.fetch = (url, options) => {
                if (options && options.body instanceof FormData) window.sentForms.push({url, form: options.body});
                return original(url, options);
            };
        }"""
    )


def sent_forms(p: Page, path: str) -> list:
    """The forms sent to `path` since record_forms: [{field: text, or {name, type, base64}}]."""
    return p.page.evaluate(
        """async (path) => {
            const out = [];
            for (const {url, form} of window.sentForms.filter(f => f.url === path)) {
                const fields = {};
                for (const [k, v] of form.entries()) {
                    if (typeof v === 'string') { fields[k] = v; continue; }
                    const bytes = new Uint8Array(await v.arrayBuffer());
                    let bin = '';
                    for (let i = 0; i < bytes.length; i += 8192) bin += String.fromCharCode(...bytes.subarray(i, i + 8192));
                    fields[k] = {name: v.name, type: v.type, base64: btoa(bin)};
                }
                out.push(fields);
            }
            return out;
        }""",
        path,
    )


def choose_photo(p: Page, photo=PHOTO):
    """Picks the photo; the page finds the face by creating an avatar. Returns the box."""
    p.page.set_input_files("#face-file", str(photo))
    p.wait("() => /face at|kept as/.test(document.getElementById('face-status').textContent)"
           " || document.getElementById('face-status').classList.contains('bad')")
    status = p.text("#face-status")
    m = re.search(r"face at (\d+),(\d+),(\d+),(\d+)", status)
    assert m, f"no face box: {status!r}"
    return [int(x) for x in m.groups()]


def render(p: Page, timeout=120_000) -> dict:
    """Clicks the button and waits for the stream to end and the video to play to its end."""
    p.page.click("#generate")
    p.wait("() => document.body.dataset.state === 'done' || document.body.dataset.state === 'error'", timeout)
    assert p.page.evaluate("document.body.dataset.state") == "done", p.text("#error")
    p.wait("() => document.getElementById('output').ended", timeout)
    return p.page.evaluate(
        """() => {
            const v = document.getElementById('output');
            const q = v.getVideoPlaybackQuality();
            const run = window.lipsyncRun;
            return {duration: v.duration, currentTime: v.currentTime, total: q.totalVideoFrames,
                    dropped: q.droppedVideoFrames, frames: run.frames, seconds: run.seconds,
                    ttff: (run.firstFrameAt - run.started) / 1000, bytes: run.parts.reduce((s, b) => s + b.length, 0),
                    error: v.error && v.error.message};
        }"""
    )


def assert_played_whole(stats: dict, p: Page):
    seconds = speech_seconds()
    assert stats["error"] is None, stats
    # One frame per 1/25 s of speech, counted from the stream's fragments by the page.
    assert abs(stats["frames"] - seconds * FPS) <= 1, stats
    assert abs(stats["seconds"] - seconds) <= 1.5 / FPS, stats
    # Presented through MSE: decoded and not dropped, at least 95 % of what arrived.
    presented = stats["total"] - stats["dropped"]
    assert presented >= 0.95 * stats["frames"], stats
    assert abs(stats["duration"] - seconds) <= 0.1, stats
    assert stats["currentTime"] >= stats["duration"] - 0.05, stats
    assert 0 < stats["ttff"] < 60, stats
    # Out of the count the server announced before the first byte (X-Video-Frames).
    assert p.text("#frames") == f"{stats['frames']} of {stats['frames']}", p.text("#frames")
    assert re.match(r"\d+\.\d\d s", p.text("#ttff")), p.text("#ttff")
    assert re.match(r"\d+\.\d frames/s \(\d+\.\d\d× real time\)", p.text("#speed")), p.text("#speed")


def test_page_loads_without_console_errors_and_holds_its_inputs(page: Page, server: Server):
    status, headers, body = server.get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    html = body.decode()
    # The inputs are in the static markup (before any script runs), in a form that posts to the API.
    assert '<input type="file" id="face-file" name="image" accept="image/*,video/*">' in html
    assert 'accept="audio/*"' in html
    assert 'action="/v1/lipsync"' in html
    page.open()
    page.wait("() => document.fonts.status === 'loaded'")
    page.shot("01-loaded")
    assert page.page.is_visible("#face-file") and page.page.is_visible("#audio-file")
    assert page.page.is_visible("#record"), "the microphone button should show in Chromium"
    assert not page.page.is_visible("#key-row"), "no key field when the server has no key"
    assert page.page.is_visible("#avatars-empty")
    assert "random weights" in page.text("#server-info")
    assert page.errors == []


def test_file_mode_plays_the_stream_to_the_end_through_mse(page: Page, server: Server):
    page.open()
    box = choose_photo(page)
    assert box[2] > box[0] and box[3] > box[1]
    assert page.page.input_value("#box") == ",".join(map(str, box))
    page.shot("02-photo-with-box")
    page.page.set_input_files("#audio-file", str(SPEECH))
    stats = render(page)
    page.shot("03-played")
    assert_played_whole(stats, page)
    # The server announces the frames before the first byte.
    status, headers, _ = server.post_form(
        "/v1/lipsync", {"audio": ("s.wav", SPEECH.read_bytes()), "image": ("p.png", PHOTO.read_bytes())}
    )
    assert status == 200 and headers["x-video-frames"] == str(stats["frames"]), dict(headers)
    # The download is the whole stream, an MP4.
    with page.page.expect_download() as d:
        page.page.click("#download")
    data = open(d.value.path(), "rb").read()
    assert len(data) == stats["bytes"] and data[4:8] == b"ftyp", len(data)
    assert page.errors == []


def test_a_typed_box_is_drawn_and_sent_with_the_photo(page: Page, server: Server):
    page.open()
    choose_photo(page)
    record_forms(page)
    page.page.fill("#box", "150,60,300,220")
    page.wait("() => !document.getElementById('keep-avatar').hidden")
    # The box is drawn: a green pixel on its left edge, in the canvas's scale.
    green = page.page.evaluate(
        """() => {
            const c = document.getElementById('face-canvas');
            const s = c.width / 512;
            const [r, g, b] = c.getContext('2d').getImageData(Math.round(150 * s), Math.round(140 * s), 1, 1).data;
            return g > 150 && r < 100 && b < 150;
        }"""
    )
    assert green
    page.shot("04-typed-box")
    page.page.set_input_files("#audio-file", str(SPEECH))
    assert_played_whole(render(page), page)
    [form] = sent_forms(page, "/v1/lipsync")
    assert form["box"] == "150,60,300,220" and form["image"]["name"] == "astronaut.png", form.keys()
    assert "avatar_id" not in form
    assert page.errors == []


def test_files_can_be_dropped_and_the_box_drawn_by_dragging(page: Page):
    page.open()
    # Drop the photo and the speech on their sections, as a file manager would.
    for section, path, mime in [("#face-drop", PHOTO, "image/png"), ("#audio-drop", SPEECH, "audio/wav")]:
        page.page.evaluate(
            """([section, name, mime, b64]) => {
                const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
                const dt = new DataTransfer();
                dt.items.add(new File([bytes], name, {type: mime}));
                const target = document.querySelector(section);
                target.dispatchEvent(new DragEvent('dragover', {dataTransfer: dt, bubbles: true, cancelable: true}));
                target.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
            }""",
            [section, path.name, mime, base64.b64encode(path.read_bytes()).decode()],
        )
    page.wait("() => /face at/.test(document.getElementById('face-status').textContent)")
    assert page.page.evaluate("document.getElementById('face-file').files[0].name") == PHOTO.name
    assert page.text("#audio-status").startswith(SPEECH.name)
    # Drag a box on the picture: the field follows, in the photo's pixels.
    r = page.page.locator("#face-canvas").bounding_box()
    scale = 512 / r["width"]
    page.page.mouse.move(r["x"] + 100 / scale, r["y"] + 50 / scale)
    page.page.mouse.down()
    page.page.mouse.move(r["x"] + 200 / scale, r["y"] + 150 / scale, steps=5)
    page.page.mouse.move(r["x"] + 300 / scale, r["y"] + 250 / scale, steps=5)
    page.page.mouse.up()
    box = [int(v) for v in page.page.input_value("#box").split(",")]
    assert all(abs(a - b) <= 2 for a, b in zip(box, [100, 50, 300, 250])), box
    assert page.page.is_visible("#keep-avatar")
    page.shot("14-dragged-box")
    # Kept as an avatar with that box: a second entry in the list.
    page.page.click("#keep-avatar")
    page.wait("() => document.querySelectorAll('#avatars li').length === 2")
    assert page.text("#face-status").endswith("with the box " + ",".join(map(str, box)))
    assert page.errors == []


def test_a_bad_file_shows_the_apis_error(page: Page, server: Server):
    bad = b"this is not a picture of anyone\n" * 4
    expected = server.error_of(server.post_form("/v1/avatars", {"image": ("bad.png", bad)}))
    page.open()
    page.page.set_input_files("#face-file", {"name": "bad.png", "mimeType": "image/png", "buffer": bad})
    page.wait("() => document.getElementById('face-status').classList.contains('bad')")
    assert page.text("#face-status") == expected
    # Rendering with it anyway sends the image itself, and the API's message shows.
    page.page.set_input_files("#audio-file", str(SPEECH))
    page.page.click("#generate")
    page.wait("() => document.body.dataset.state === 'error'")
    expected = server.error_of(
        server.post_form("/v1/lipsync", {"audio": ("s.wav", SPEECH.read_bytes()), "image": ("bad.png", bad)})
    )
    assert page.text("#error") == expected
    page.shot("05-bad-file")
    # Speech that is not audio: the API's message again.
    choose_photo(page)
    page.page.set_input_files("#audio-file", {"name": "noise.wav", "mimeType": "audio/wav", "buffer": bad})
    page.page.click("#generate")
    page.wait("() => document.body.dataset.state === 'error'")
    expected = server.error_of(
        server.post_form("/v1/lipsync", {"audio": ("n.wav", bad), "image": ("p.png", PHOTO.read_bytes())})
    )
    assert page.text("#error") == expected
    # Only the refused requests' own log lines.
    assert page.errors and all("status of 4" in e for e in page.errors), page.errors


def test_avatars_are_listed_reused_and_deleted(page: Page, server: Server):
    page.open()
    choose_photo(page)
    ids = page.page.eval_on_selector_all("#avatars li", "els => els.map(e => e.dataset.id)")
    assert len(ids) == 1
    avatar = ids[0]
    assert server.get(f"/v1/avatars/{avatar}")[0] == 200
    # Kept in the browser: still listed after a reload, and reusable by id.
    page.page.reload()
    page.open()
    assert page.page.eval_on_selector_all("#avatars li", "els => els.map(e => e.dataset.id)") == [avatar]
    page.page.click(f"#avatars li[data-id='{avatar}'] button.use")
    page.wait("() => document.getElementById('face-status').textContent.startsWith('avatar ')")
    page.page.set_input_files("#audio-file", str(SPEECH))
    record_forms(page)
    page.shot("06-avatar-chosen")
    assert_played_whole(render(page), page)
    [form] = sent_forms(page, "/v1/lipsync")
    assert form["avatar_id"] == avatar and "image" not in form and "box" not in form, form.keys()
    page.shot("07-avatar-played")
    page.page.click(f"#avatars li[data-id='{avatar}'] button.delete")
    page.wait("() => document.querySelectorAll('#avatars li').length === 0")
    assert page.page.is_visible("#avatars-empty")
    assert server.get(f"/v1/avatars/{avatar}")[0] == 404
    assert page.page.evaluate("localStorage.getItem('lipsync.avatars')") == "[]"
    page.shot("08-avatar-deleted")
    assert page.errors == []


def test_a_clip_becomes_a_video_avatar_and_plays(page: Page, tmp_path):
    # One second of the photo as a 25 fps H.264 clip (ffmpeg, which the server needs anyway).
    clip = tmp_path / "clip.mp4"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-loop", "1", "-i", str(PHOTO), "-t", "1", "-r", "25",
         "-vf", "scale=256:256", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-y", str(clip)],
        check=True, timeout=60,
    )
    page.open()
    choose_photo(page, clip)
    assert "a clip of 25 frames at 25 fps" in page.text("#face-status"), page.text("#face-status")
    [label] = page.page.eval_on_selector_all("#avatars li code", "els => els.map(e => e.textContent)")
    assert label.startswith("clip "), label
    page.shot("12-clip")
    record_forms(page)
    page.page.set_input_files("#audio-file", str(SPEECH))
    assert_played_whole(render(page), page)
    page.shot("13-clip-played")
    [form] = sent_forms(page, "/v1/lipsync")
    assert "avatar_id" in form and "video" not in form, form.keys()
    assert page.errors == []


def test_speech_recorded_from_the_microphone_is_sent_as_wav(page: Page):
    page.open()
    choose_photo(page)
    record_forms(page)
    page.page.click("#record")
    page.wait("() => document.getElementById('record').textContent === 'Stop'")
    page.page.wait_for_timeout(1500)
    page.page.click("#record")
    page.wait("() => document.getElementById('audio-status').textContent.startsWith('recorded')")
    page.shot("09-recorded")
    status = page.text("#audio-status")
    m = re.match(r"recorded (\d+\.\d) s at (\d+) Hz", status)
    assert m and 1.0 <= float(m.group(1)) <= 3.0, status
    stats = render(page)
    page.shot("10-recorded-played")
    assert stats["frames"] >= FPS and stats["total"] - stats["dropped"] >= 0.95 * stats["frames"], stats
    [form] = sent_forms(page, "/v1/lipsync")
    assert form["audio"]["name"] == "recording.wav" and form["audio"]["type"] == "audio/wav"
    wav = base64.b64decode(form["audio"]["base64"])
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    assert int.from_bytes(wav[20:22], "little") == 1 and int.from_bytes(wav[34:36], "little") == 16
    # The fake microphone plays speech, not silence.
    samples = wav[44:44 + int(m.group(2))]
    assert max(abs(int.from_bytes(samples[i:i + 2], "little", signed=True)) for i in range(0, len(samples), 2)) > 1000
    assert page.errors == []


def test_with_an_api_key_the_page_asks_for_it(browser):
    server = Server("--api-key", "s3cret-key", ready=False)
    try:
        assert server.get("/")[0] == 200, "the page needs no key"
        assert server.get("/v1/avatars/x")[0] == 401
        p = Page(browser, server.url).open()
        assert p.page.is_visible("#key-row")
        p.page.set_input_files("#face-file", str(PHOTO))
        p.wait("() => document.getElementById('face-status').classList.contains('bad')")
        assert p.text("#face-status") == server.error_of(server.get("/v1/avatars/x"))
        p.page.fill("#api-key", "s3cret-key")
        # (another photo: choosing the same file again is no change)
        choose_photo(p, MEDIA / "grace_hopper.jpg")
        p.shot("11-api-key")
        assert p.errors and all("status of 401" in e for e in p.errors), p.errors
        p.close()
    finally:
        server.stop()


def test_no_ui_leaves_the_page_out():
    server = Server("--no-ui", ready=False)
    try:
        for path in ["/", "/ui/app.js", "/ui/app.css"]:
            status, headers, body = server.get(path)
            assert status == 404 and headers["content-type"] == "application/json", (path, status)
            assert server.error_of((status, headers, body)) == f"no route for GET {path}"
        assert server.get("/health")[0] == 200
    finally:
        server.stop()
