"""Fixtures of the Python client tests (clients/python): the RELEASE `lipsync serve` on
127.0.0.1 with random weights (`lipsync init-weights`), as the browser tests run it, and the
avatar of the repository's photo made through the client.

The release binary is `$CARGO_TARGET_DIR/release/lipsync` (default `target/`); scripts/test.sh
builds it first. Every wait has a deadline, and pytest-timeout bounds every test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import wave
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ROOT / "tests" / "media"
CLIENT = ROOT / "clients" / "python"
PHOTO = MEDIA / "astronaut.png"
# 4.00 s of speech, 16 kHz mono s16le.
SPEECH = MEDIA / "arctic_a0007.wav"
SPEECH_1S = MEDIA / "arctic_a0007_1s.wav"
API_KEY = "client-test-key"

# Pipecat's logger (loguru) at DEBUG floods the output: warnings and up only.
try:
    from loguru import logger as _loguru

    _loguru.remove()
    _loguru.add(sys.stderr, level="WARNING")
except ImportError:  # pragma: no cover
    pass


def target_dir() -> Path:
    d = os.environ.get("CARGO_TARGET_DIR")
    return ROOT / d if d else ROOT / "target"


def release_binary() -> Path:
    binary = target_dir() / "release" / "lipsync"
    if not binary.is_file():
        pytest.fail(
            f"{binary} is missing: the client tests run the release server; build it with "
            "`cargo build --release --locked` (scripts/test.sh does)"
        )
    return binary


def weights() -> Path:
    """Random weights, written again whenever the binary is newer than them."""
    path = target_dir() / "clients-test" / "random-seed0.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    binary = release_binary()
    if not path.exists() or path.stat().st_mtime < binary.stat().st_mtime:
        tmp = path.with_name(f"random-{os.getpid()}.tmp.safetensors")
        subprocess.run([binary, "init-weights", tmp], check=True, capture_output=True, timeout=120)
        tmp.replace(path)
    return path


class Server:
    """`lipsync serve` (release) on a free port of 127.0.0.1, ready; its jobs' files in a
    temporary data directory that `stop` removes."""

    def __init__(self, *extra: str, echo: bool = False):
        """`echo`: on the echo device (`--device echo`, no checkpoint), the model stand-in."""
        self.log: list[str] = []
        self.data_dir = tempfile.TemporaryDirectory(prefix="lipsync-client-data-")
        model = ["--device", "echo"] if echo else ["--checkpoint", weights()]
        self.proc = subprocess.Popen(
            [
                release_binary(), "serve", *model,
                "--host", "127.0.0.1", "--port", "0",
                "--max-batch", "8", "--first-batch", "2",
                "--data-dir", self.data_dir.name, *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "LIPSYNC_LOG": "info", "NO_COLOR": "1"},
        )
        listening = threading.Event()
        self.port: int | None = None

        def read():
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    listening.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                time.sleep(0.2)  # its last words
                self.stop()
                pytest.fail("the server never listened:\n" + "\n".join(self.log[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while self.status("/ready") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("the server never became ready:\n" + "\n".join(self.log[-30:]))
            time.sleep(0.2)

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        """A gauge or counter of /metrics without labels."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.data_dir.cleanup()


@pytest.fixture(scope="session")
def server():
    """The server every test shares: an API key, and one live session at a time (so a second
    one is refused, and each test's session must be closed when it ends)."""
    s = Server("--api-key", API_KEY, "--max-sessions", "1")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def live_opts(server) -> dict:
    """Options of the tests' live sessions: a server that gives each session a drawing rate
    (`draw_fps` in /info) refuses one it cannot draw at `min_draw_fps` (5 by default), which a
    machine busy with other work can make it do; the tests take any rate (frames the server
    cannot draw in time are held, and their speech still comes)."""
    return {"min_draw_fps": 0} if "draw_fps" in server.get_json("/info")["sessions"] else {}


@pytest.fixture(scope="session")
def avatar(server):
    """The repository's photo as an avatar (made with the client)."""
    from lipsync_client import Client

    with Client(server.url, api_key=API_KEY) as c:
        return c.create_avatar(image=PHOTO)


def read_speech(path: Path = SPEECH, seconds: float | None = None) -> bytes:
    """The s16le samples of a 16 kHz mono WAV (the first `seconds` of it)."""
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (16000, 2, 1)
        n = w.getnframes() if seconds is None else int(seconds * 16000)
        return w.readframes(n)


def ffprobe(data: bytes, tmp_path: Path) -> dict:
    """ffprobe's streams (codec, frames) and format duration of an MP4, and its errors."""
    f = tmp_path / f"probe-{time.monotonic_ns()}.mp4"
    f.write_bytes(data)
    out = subprocess.run(
        [
            "ffprobe", "-v", "error", "-count_frames",
            "-show_entries", "stream=codec_type,codec_name,nb_read_frames,avg_frame_rate,width,height",
            "-show_entries", "format=duration", "-of", "json", str(f),
        ],
        capture_output=True, text=True, timeout=60,
    )
    doc = json.loads(out.stdout or "{}")
    doc["errors"] = out.stderr
    return doc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the server's last log lines."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        s = item.funcargs.get("server")
        if isinstance(s, Server):
            report.sections.append(("lipsync serve log (last 40 lines)", "\n".join(s.log[-40:])))
