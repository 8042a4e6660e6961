"""The examples of clients/python/README.md, run as they are (each block in its own Python
process) against the release server, in a folder holding `speech.wav` and `avatar.png`, and
what each leaves behind checked. Blocks that need another service say so in an HTML comment
(`<!-- not run: ... -->`) right above them; the count of each kind is checked, so a block
cannot drop out silently. Also the LiveKit avatar worker example, as far as it goes without
a LiveKit server (its `--help`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import API_KEY, CLIENT, PHOTO, SPEECH, ffprobe

README = CLIENT / "README.md"
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks():
    found = [(m.group("why"), m.group("code")) for m in BLOCK.finditer(README.read_text())]
    return [code for why, code in found if not why], [why for why, _ in found if why]


def test_the_readme_has_the_examples_it_says():
    run, skipped = blocks()
    assert len(run) == 6, len(run)
    assert skipped == ["needs a transport's service (Daily, LiveKit, ...)", "needs a LiveKit server"]


@pytest.mark.parametrize("n", range(6))
@pytest.mark.timeout(120)
def test_readme_example(n, server, tmp_path):
    code = blocks()[0][n]
    shutil.copy(SPEECH, tmp_path / "speech.wav")
    shutil.copy(PHOTO, tmp_path / "avatar.png")
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "LIPSYNC_URL": server.url, "LIPSYNC_API_KEY": API_KEY}
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, f"example {n}:\n{code}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr[-3000:]}"
    out = run.stdout
    if n == 0:
        doc = ffprobe((tmp_path / "out.mp4").read_bytes(), tmp_path)
        assert sorted(s["codec_name"] for s in doc["streams"]) == ["aac", "h264"], doc
    elif n == 1:
        doc = ffprobe((tmp_path / "streamed.mp4").read_bytes(), tmp_path)
        video = next(s for s in doc["streams"] if s["codec_type"] == "video")
        assert video["avg_frame_rate"] == "30/1" and int(video["nb_read_frames"]) >= 110, video
        assert re.fullmatch(r"\[\d+, \d+, \d+, \d+\]\n", out), out
    elif n == 2:
        data = (tmp_path / "job.mp4").read_bytes()
        assert data.find(b"moov") < data.find(b"mdat"), "faststart"
        assert sorted(s["codec_name"] for s in ffprobe(data, tmp_path)["streams"]) == ["aac", "h264"]
    elif n == 3:
        assert re.match(r"415 not_an_image ", out) and out.splitlines()[-1].startswith("True "), out
    elif n == 4:
        lines = out.splitlines()
        kinds = [line.split()[0] for line in lines[:-1]]
        assert kinds == ["ready", "idle", "speaking", "idle", "end"], out
        m = re.match(r"(\d+) speaking frames; the server counted (\{.*\})", lines[-1])
        assert m and 94 <= int(m.group(1)) <= 100, out
        assert f"'speaking_frames': {m.group(1)}" in m.group(2), out
    elif n == 5:
        doc = ffprobe((tmp_path / "talking.mp4").read_bytes(), tmp_path)
        streams = {s["codec_type"]: s for s in doc["streams"]}
        assert set(streams) == {"video", "audio"}, doc
        frames = int(streams["video"]["nb_read_frames"])
        # All 4 s of speech (97 frames) and the idle frames around it, and audio as long.
        assert 97 <= frames <= 250, frames
        assert abs(float(doc["format"]["duration"]) - frames / 25) < 0.2, doc


@pytest.mark.timeout(60)
def test_the_livekit_worker_example_starts():
    run = subprocess.run(
        [sys.executable, str(CLIENT / "examples" / "livekit_avatar_worker.py"), "--help"],
        capture_output=True, text=True, timeout=50,
    )
    assert run.returncode == 0, run.stderr
    assert "--token" in run.stdout and "--lipsync" in run.stdout
