"""The CPU image as a user runs it: `docker run` with the weights mounted read-only.

Ready and rendering, healthy by its own HEALTHCHECK, not root, drains on `docker stop`
(SIGTERM to PID 1) and exits 0, and avatars kept on a named volume across containers.
"""

import io
import json
import threading
import time
import wave

import pytest

from conftest import (
    TEST_CHECKPOINT,
    assert_video,
    create_avatar,
    docker,
    media,
    post_lipsync,
    request,
    multipart,
    unique,
    wait_ready,
)


class Container:
    """One `docker run -d` of the image, port 8080 published on a free loopback port."""

    def __init__(self, image, weights_dir, volume=None, env=()):
        self.name = unique("lipsync-test")
        args = [
            "run", "-d", "--name", self.name,
            "-p", "127.0.0.1::8080",
            "-v", f"{weights_dir}:/weights:ro",
            "-e", f"LIPSYNC_CHECKPOINT=/weights/{TEST_CHECKPOINT}",
        ]
        if volume:
            args += ["-v", f"{volume}:/var/lib/lipsync/avatars"]
        for e in env:
            args += ["-e", e]
        docker(*args, image)
        port = docker("port", self.name, "8080/tcp").stdout.split()[0].rsplit(":", 1)[1]
        self.base = f"http://127.0.0.1:{port}"

    def inspect(self, fmt):
        return docker("inspect", "-f", fmt, self.name).stdout.strip()

    def logs(self):
        p = docker("logs", self.name, check=False)
        return p.stdout + p.stderr

    def remove(self):
        docker("rm", "-f", "-v", self.name, check=False)


@pytest.fixture
def volume():
    name = unique("lipsync-avatars")
    docker("volume", "create", name)
    yield name
    docker("volume", "rm", "-f", name, check=False)


@pytest.fixture
def start(image, weights_dir):
    made = []

    def _start(**kw):
        c = Container(image, weights_dir, **kw)
        made.append(c)
        return c

    yield _start
    for c in made:
        c.remove()


def long_speech(seconds):
    """The 1-second speech repeated: a render that lasts long enough to stop the container
    while it streams."""
    with wave.open(io.BytesIO(media("arctic_a0007_1s.wav"))) as w:
        params, pcm = w.getparams(), w.readframes(w.getnframes())
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setparams(params)
        w.writeframes(pcm * seconds)
    return out.getvalue()


def test_image_serves_renders_and_is_healthy_as_non_root(start):
    c = start()
    wait_ready(c.base, timeout=180)
    r = post_lipsync(c.base)
    assert r.status == 200, r
    assert r.headers.get("content-type", "").startswith("video/mp4"), r.headers
    info = assert_video(r.body)
    assert float(info["format"]["duration"]) == pytest.approx(1.0, abs=0.2)

    # The image's own HEALTHCHECK (interval 15 s) turns the container healthy.
    deadline = time.monotonic() + 60
    while c.inspect("{{.State.Health.Status}}") != "healthy":
        assert time.monotonic() < deadline, c.inspect("{{json .State.Health}}")
        time.sleep(1)

    # Not root: the configured user, and the process itself (PID 1 is the server).
    assert c.inspect("{{.Config.User}}") == "10001:10001"
    status = docker("exec", c.name, "cat", "/proc/1/status").stdout
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids and all(u == "10001" for u in uids), status
    assert docker("exec", c.name, "cat", "/proc/1/comm").stdout.strip() == "lipsync"
    # The checkpoint is mounted read-only and the avatar folder is writable by that user.
    assert docker("exec", c.name, "sh", "-c", "touch /weights/x", check=False).returncode != 0
    docker("exec", c.name, "sh", "-c", "touch /var/lib/lipsync/avatars/.w && rm /var/lib/lipsync/avatars/.w")


def test_docker_stop_lets_a_stream_finish_and_exits_zero(start):
    c = start(env=["LIPSYNC_SHUTDOWN_TIMEOUT=35"])
    wait_ready(c.base, timeout=180)
    body, ctype = multipart(
        [("audio", "speech.wav", long_speech(3)), ("image", "astronaut.png", media("astronaut.png"))]
    )
    result = {}

    def client():
        try:
            result["r"] = request(c.base, "POST", "/v1/lipsync", body, {"Content-Type": ctype}, timeout=120)
        except Exception as e:  # the test asserts below that this did not happen
            result["error"] = e

    t = threading.Thread(target=client)
    t.start()
    # Stop once the render is under way: its frames are being computed.
    deadline = time.monotonic() + 60
    while True:
        m = request(c.base, "GET", "/metrics", timeout=5).body.decode()
        if any(line.startswith("lipsync_frames_total") and not line.endswith(" 0") for line in m.splitlines()):
            break
        assert time.monotonic() < deadline and t.is_alive(), "the render never started"
        time.sleep(0.05)
    stopped = time.monotonic()
    assert t.is_alive(), "the render finished before the stop: make the speech longer"
    docker("stop", "-t", "40", c.name, timeout=60)
    stop_seconds = time.monotonic() - stopped
    t.join(60)
    assert "error" not in result, (result, c.logs())
    r = result["r"]
    assert r.status == 200, r
    info = assert_video(r.body)
    assert float(info["format"]["duration"]) == pytest.approx(3.0, abs=0.3), info["format"]
    assert c.inspect("{{.State.ExitCode}}") == "0", c.logs()
    assert c.inspect("{{.State.OOMKilled}}") == "false"
    # Stopped by SIGTERM handling, not by Docker's SIGKILL after the 40 s grace.
    assert stop_seconds < 40, stop_seconds
    assert "shutting down" in c.logs()


def test_avatar_outlives_its_container_on_a_named_volume(start, volume):
    first = start(volume=volume)
    wait_ready(first.base, timeout=180)
    avatar = create_avatar(first.base)
    assert post_lipsync(first.base, avatar_id=avatar).status == 200
    # -v: the container's anonymous volumes (the data directory), not the named one.
    docker("rm", "-f", "-v", first.name)

    second = start(volume=volume)
    wait_ready(second.base, timeout=180)
    r = post_lipsync(second.base, avatar_id=avatar)
    assert r.status == 200, r
    assert_video(r.body)
    # Deleted there, it is gone for every container on the volume.
    assert request(second.base, "DELETE", f"/v1/avatars/{avatar}").status == 204
    third = start(volume=volume)
    wait_ready(third.base, timeout=180)
    r = post_lipsync(third.base, avatar_id=avatar)
    assert r.status == 404, r
    assert json.loads(r.body)["error_type"] == "avatar_not_found"
