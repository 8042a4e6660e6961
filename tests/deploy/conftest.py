"""Shared helpers of the container and replica tests (tests/deploy/run.sh runs them).

Everything here talks to this machine only: containers and networks the tests create, ports
on loopback. Standard library only (plus pytest), so the tests read like what a user does with
curl and docker.
"""

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ROOT / "tests" / "media"
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
# The test checkpoint (deterministic random weights), as the images find a real one.
TEST_CHECKPOINT = "zip_bare.pt"
IMAGE = os.environ.get("LIPSYNC_TEST_IMAGE", "lipsync:cpu")


def run(*args, check=True, timeout=300, **kw):
    """Runs a command, returns CompletedProcess (text); raises with its output on failure."""
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def docker(*args, **kw):
    return run("docker", *args, **kw)


def unique(prefix):
    """A name no other test run uses (containers, volumes, networks, compose projects)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def media(name):
    return (MEDIA / name).read_bytes()


def multipart(files=(), fields=()):
    """(body, content_type) of a multipart/form-data body: files are (name, filename, bytes)."""
    boundary = uuid.uuid4().hex
    out = bytearray()
    for name, filename, data in files:
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        out += data + b"\r\n"
    for name, value in fields:
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


class Response:
    def __init__(self, status, headers, body, first_byte_s, total_s):
        self.status = status
        # Header names in lower case (HTTP names are case-insensitive).
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.body = body
        self.first_byte_s = first_byte_s
        self.total_s = total_s

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<{self.status} {len(self.body)} B {self.body[:200]!r}>"


def request(base, method, path, body=None, headers=None, timeout=120):
    """One HTTP/1.1 request on a new connection; reads the whole (streamed) body.

    Raises OSError / http.client exceptions when the connection fails or the body is cut
    short (a stream that ends without its final chunk is a failed request).
    """
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    start = time.monotonic()
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        first = time.monotonic() - start
        data = resp.read()
        return Response(resp.status, dict(resp.getheaders()), data, first, time.monotonic() - start)
    finally:
        conn.close()


def post_lipsync(base, avatar_id=None, image="astronaut.png", audio="arctic_a0007_1s.wav", timeout=120):
    files = [("audio", audio, media(audio))]
    fields = []
    if avatar_id:
        fields.append(("avatar_id", avatar_id))
    else:
        files.append(("image", image, media(image)))
    body, ctype = multipart(files, fields)
    return request(base, "POST", "/v1/lipsync", body, {"Content-Type": ctype}, timeout=timeout)


def create_avatar(base, image="astronaut.png", timeout=120):
    body, ctype = multipart([("image", image, media(image))])
    r = request(base, "POST", "/v1/avatars", body, {"Content-Type": ctype}, timeout=timeout)
    assert r.status in (200, 201), r
    return r.json()["id"]


def wait_ready(base, timeout=180):
    """Waits until GET /ready answers 200; raises with the last answer otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = request(base, "GET", "/ready", timeout=5)
            if r.status == 200:
                return
            last = r
        except OSError as e:
            last = e
        time.sleep(0.5)
    raise AssertionError(f"{base} not ready after {timeout} s: {last}")


def metric(text, name, labels=None):
    """The value of one Prometheus sample (0 when absent); labels must all match."""
    total = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        if labels and not all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            continue
        total = (total or 0.0) + float(value)
    return total or 0.0


def ffprobe(data):
    """ffprobe's JSON of an MP4 held in memory (streams and format)."""
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        out = run("ffprobe", "-v", "error", "-show_streams", "-show_format", "-of", "json", f.name)
    return json.loads(out.stdout)


def assert_video(data):
    info = ffprobe(data)
    kinds = sorted(s["codec_name"] for s in info["streams"])
    assert kinds == ["aac", "h264"], kinds
    return info


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def image():
    """The image under test; tests/deploy/run.sh builds it before pytest starts."""
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"image {IMAGE} is missing: run tests/deploy/run.sh (it builds it)")
    return IMAGE


@pytest.fixture(scope="session")
def weights_dir():
    """A folder with the test checkpoint, readable by the image's user (uid 10001)."""
    d = Path(tempfile.mkdtemp(prefix="lipsync-weights-"))
    shutil.copy(CHECKPOINTS / TEST_CHECKPOINT, d / TEST_CHECKPOINT)
    d.chmod(0o755)
    (d / TEST_CHECKPOINT).chmod(0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)
