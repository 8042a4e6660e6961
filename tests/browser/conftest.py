"""Fixtures of the browser tests: the RELEASE `lipsync serve` on 127.0.0.1 with random weights
(`lipsync init-weights`), and Debian's headless Chromium driven by Playwright (the system
browser: nothing downloads one).

The release binary is `$CARGO_TARGET_DIR/release/lipsync` (default `target/`), as the load
suite finds it; scripts/test.sh builds it first. Every wait has a deadline.
"""

import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ROOT / "tests" / "media"
SCREENSHOTS = ROOT / "target" / "browser"
CHROMIUM = os.environ.get("LIPSYNC_CHROMIUM", "/usr/bin/chromium")
# The speech the file-mode tests send, and the fake microphone's.
SPEECH = MEDIA / "arctic_a0007_1s.wav"


def target_dir() -> Path:
    d = os.environ.get("CARGO_TARGET_DIR")
    return ROOT / d if d else ROOT / "target"


def release_binary() -> Path:
    binary = target_dir() / "release" / "lipsync"
    if not binary.is_file():
        pytest.fail(
            f"{binary} is missing: the browser tests run the release server; build it with "
            "`cargo build --release --locked` (scripts/test.sh does)"
        )
    return binary


def weights() -> Path:
    """Random weights, written again whenever the binary is newer than them."""
    path = target_dir() / "browser-test" / "random-seed0.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    binary = release_binary()
    if not path.exists() or path.stat().st_mtime < binary.stat().st_mtime:
        tmp = path.with_name(f"random-{os.getpid()}.tmp.safetensors")
        subprocess.run([binary, "init-weights", tmp], check=True, capture_output=True, timeout=120)
        tmp.replace(path)
    return path


class Server:
    """`lipsync serve` (release) on a free port; `url` once it listens. Batch jobs' files and
    store go to a temporary data directory of its own, removed by `stop`."""

    def __init__(self, *extra: str, ready: bool = True):
        self.log: list[str] = []
        self.data_dir = tempfile.TemporaryDirectory(prefix="lipsync-data-")
        self.proc = subprocess.Popen(
            [
                release_binary(), "serve", "--checkpoint", weights(),
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
        self.port = None

        def read():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(60):
            self.stop()
            pytest.fail("the server never listened:\n" + "\n".join(self.log[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"
        if ready:
            deadline = time.monotonic() + 300
            while self.get("/ready")[0] != 200:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail("the server never became ready:\n" + "\n".join(self.log[-30:]))
                time.sleep(0.2)

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        """(status, headers, body) of one request; never raises on an HTTP error status."""
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=120) as res:
                return res.status, res.headers, res.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def get(self, path: str, headers=None):
        try:
            return self.request("GET", path, headers=headers)
        except OSError:
            return 0, {}, b""

    def post_form(self, path: str, fields: dict, headers=None):
        """A multipart POST: values are str (text fields) or (filename, bytes) (files)."""
        boundary = "lipsyncBrowserTestBoundary1f9a"
        body = b""
        for name, value in fields.items():
            body += f"--{boundary}\r\n".encode()
            if isinstance(value, tuple):
                body += f'Content-Disposition: form-data; name="{name}"; filename="{value[0]}"\r\n'.encode()
                body += b"Content-Type: application/octet-stream\r\n\r\n" + value[1] + b"\r\n"
            else:
                body += f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        body += f"--{boundary}--\r\n".encode()
        h = {"Content-Type": f"multipart/form-data; boundary={boundary}", **(headers or {})}
        return self.request("POST", path, body, h)

    def error_of(self, status_headers_body) -> str:
        """The `error` of a JSON error response."""
        status, _, body = status_headers_body
        assert status >= 400, f"expected an error, got {status}"
        return json.loads(body)["error"]

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
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def browser():
    args = [
        "--autoplay-policy=no-user-gesture-required",
        # The microphone: Chromium's fake device, fed from the speech file, allowed without a prompt.
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={SPEECH}",
    ]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args, timeout=60_000)
        yield b
        b.close()


class Page:
    """A fresh browser context (empty storage) on one page, recording console errors."""

    def __init__(self, browser, base_url: str):
        self.context = browser.new_context(base_url=base_url, viewport={"width": 1100, "height": 900})
        self.context.set_default_timeout(60_000)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def open(self):
        self.page.goto("/")
        # /info read: the script ran.
        self.wait("() => document.getElementById('server-info').textContent.startsWith('lipsync ')")
        return self

    def wait(self, predicate: str, timeout: float = 60_000, arg=None):
        self.page.wait_for_function(predicate, arg=arg, timeout=timeout)

    def text(self, selector: str) -> str:
        return self.page.text_content(selector) or ""

    def shot(self, name: str):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)

    def close(self):
        self.context.close()


@pytest.fixture
def page(browser, server):
    p = Page(browser, server.url)
    yield p
    p.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test leaves a screenshot (target/browser/failed-NAME.png) and shows the server's
    last log lines and the page's console errors."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    p = next((v for v in item.funcargs.values() if isinstance(v, Page)), None)
    if p is not None:
        try:
            p.shot(f"failed-{item.name}")
        except Exception as e:  # the page itself may be what failed
            report.sections.append(("screenshot", f"none: {e}"))
        report.sections.append(("page console errors", "\n".join(p.errors) or "none"))
    s = item.funcargs.get("server")
    if isinstance(s, Server):
        report.sections.append(("lipsync serve log (last 40 lines)", "\n".join(s.log[-40:])))
