"""Three replicas behind the balancer, as docker/compose.replicas.yaml runs them.

`docker-compose up --scale lipsync=3` on the CPU image with the test checkpoint, then through
the balancer's published port only: requests spread over the replicas by least connections
(each replica's own /metrics counts what it served); an avatar created once is served by
whichever replica a request lands on (the shared volume); a live session (WebSocket, Origin
checked against the Host the balancer passes through); `docker kill` of a replica under
steady load fails only requests that replica was streaming; a rolling restart (SIGTERM, one
replica at a time, each back in the balancer before the next) under steady load fails none.

Load: the first 0.2 s of the 1 s speech (5 frames) with an avatar_id, a 7 KB form the balancer
holds and can retry, from a few client threads back to back: on 2 CPU cores a replica renders
a frame of the test checkpoint in 0.1-0.3 s, so the whole speech would make this file take
several times longer without testing anything more. Each request is recorded with its outcome
and the replica that answered (the balancer's X-Served-By header, a server name of its
config; the stats page maps names to container addresses). The replicas run with
LIPSYNC_MAX_BATCH=4 (a test-only override: their warm-up takes 2 s instead of 12 s, which the
rolling restart waits for three times).
"""

import csv
import http.client
import io
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import wave
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import (
    ROOT,
    TEST_CHECKPOINT,
    assert_video,
    create_avatar,
    docker,
    free_port,
    media,
    metric,
    multipart,
    run,
    unique,
    wait_ready,
)

COMPOSE = ROOT / "docker" / "compose.replicas.yaml"
BALANCER_IMAGE = "lipsync-balancer"  # `image:` of the balancer service
POSTGRES_IMAGE = "lipsync-postgres"  # `image:` of the job store's service
REPLICAS = 3
SPEECH = "arctic_a0007_1s.wav"
LOAD_SECONDS = 0.2
# Test-only settings of the replicas (merged over the compose file's).
OVERRIDE = """\
services:
  lipsync:
    environment:
      LIPSYNC_MAX_BATCH: "4"
"""


def speech(seconds):
    """The first `seconds` of SPEECH, as a WAV file's bytes."""
    with wave.open(str(ROOT / "tests" / "media" / SPEECH), "rb") as r:
        params = r.getparams()
        frames = r.readframes(int(params.framerate * seconds))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setparams(params)
        w.writeframes(frames)
    return out.getvalue()


def compose_command():
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


class Stack:
    """One compose project of the replicas file: its containers, the balancer's stats."""

    def __init__(self, image, weights_dir, override):
        self.project = unique("lipsync-replicas")
        self.override = override
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(
            os.environ,
            IMAGE=image,
            WEIGHTS_DIR=str(weights_dir),
            LIPSYNC_CHECKPOINT=f"/weights/{TEST_CHECKPOINT}",
            # Loopback only: `PUBLISH_PORT` takes an address too.
            PUBLISH_PORT=f"127.0.0.1:{self.port}",
        )

    def compose(self, *args, timeout=300, check=True):
        return run(*compose_command(), "-p", self.project, "-f", str(COMPOSE),
                   "-f", str(self.override), *args,
                   env=self.env, timeout=timeout, check=check)

    def containers(self, service="lipsync", all=False):
        out = docker(
            "ps", *(["-a"] if all else []), "-q",
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--filter", f"label=com.docker.compose.service={service}",
        ).stdout.split()
        return sorted(docker("inspect", "-f", "{{.Name}}", *out).stdout.split()) if out else []

    @property
    def balancer(self):
        (name,) = self.containers("balancer")
        return name.lstrip("/")

    def ip(self, container):
        return docker(
            "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", container
        ).stdout.split()[0]

    def metrics(self, container):
        return docker("exec", container.lstrip("/"), "curl", "-fsS",
                      "http://127.0.0.1:8080/metrics", timeout=30).stdout

    def served(self):
        """Successful /v1/lipsync requests per replica (its lipsync_requests_total)."""
        return {
            c: metric(self.metrics(c), "lipsync_requests_total", {"outcome": "success"})
            for c in self.containers()
        }

    def servers(self):
        """The balancer's view: {(backend, server name): (status, address, streams now)} of
        the servers that have an address (the unused slots of server-template left out)."""
        text = docker("exec", self.balancer, "curl", "-fsS",
                      "http://127.0.0.1:8404/stats;csv", timeout=30).stdout
        out = {}
        for row in csv.DictReader(io.StringIO(text.lstrip("# "))):
            if row["pxname"] in ("lipsync", "live") and row["svname"] not in ("BACKEND", "FRONTEND"):
                if row["addr"] and "MAINT" not in row["status"]:
                    out[(row["pxname"], row["svname"])] = (
                        row["status"], row["addr"], int(row["scur"] or 0))
        return out

    def server_of(self, container):
        """The balancer's server name for a replica (in backend `lipsync`), or None."""
        addr = f"{self.ip(container)}:8080"
        for (backend, name), (_, a, _) in self.servers().items():
            if backend == "lipsync" and a == addr:
                return name
        return None

    def ready(self, container):
        return docker("exec", container.lstrip("/"), "curl", "-fsS",
                      "http://127.0.0.1:8080/ready", check=False, timeout=30).returncode == 0

    def wait_balanced(self, containers, timeout=180):
        """Waits until these replicas are ready (their own /ready) and the balancer has
        exactly them, all UP, in both backends."""
        want = {f"{self.ip(c)}:8080" for c in containers}
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if not all(self.ready(c) for c in containers):
                last = "not ready yet"
                time.sleep(0.5)
                continue
            last = self.servers()
            for backend in ("lipsync", "live"):
                up = {a for (b, _), (s, a, _) in last.items() if b == backend and s == "UP"}
                if up != want:
                    break
            else:
                return
            time.sleep(0.5)
        raise AssertionError(f"balancer did not get {sorted(want)} up: {last}")

    def logs(self):
        p = self.compose("logs", "--no-color", "--tail", "60", check=False, timeout=60)
        return p.stdout[-20000:]


@pytest.fixture(scope="module")
def stack(image, weights_dir):
    # The balancer's image (Debian's HAProxy; a cached rebuild is a second).
    docker("build", "-q", "-t", BALANCER_IMAGE, str(ROOT / "docker" / "balancer"), timeout=600)
    # The job store's image (Debian's PostgreSQL 15; about 100 s the first time, then cached).
    docker("build", "-q", "-t", POSTGRES_IMAGE, str(ROOT / "docker" / "postgres"), timeout=900)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OVERRIDE)
    s = Stack(image, weights_dir, f.name)
    try:
        s.compose("up", "-d", "--no-build", "--scale", f"lipsync={REPLICAS}", timeout=300)
        replicas = s.containers()
        assert len(replicas) == REPLICAS, replicas
        wait_ready(s.base)
        s.wait_balanced(replicas)
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)
        os.unlink(f.name)
        left = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}").stdout
        assert not left.strip(), f"containers left behind: {left}"


@pytest.fixture(scope="module")
def avatar(stack):
    """An avatar created once through the balancer (on whichever replica it chose)."""
    return create_avatar(stack.base)


class Attempt:
    """One POST /v1/lipsync through the balancer, recorded whatever happens."""

    def __init__(self, base, body, ctype, keep=False):
        self.start = time.monotonic()
        self.status = self.served_by = self.error = None
        self.data = b""
        u = urllib.parse.urlsplit(base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        try:
            conn.request("POST", "/v1/lipsync", body=body, headers={"Content-Type": ctype})
            resp = conn.getresponse()
            self.status = resp.status
            self.served_by = resp.getheader("X-Served-By")
            self.request_id = resp.getheader("X-Request-Id")
            # Raises (IncompleteRead, reset) when the stream is cut before its last chunk.
            self.data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.error = repr(e)
        finally:
            conn.close()
        self.end = time.monotonic()
        self.ok = self.error is None and self.status == 200 and self.data[4:8] == b"ftyp"
        self.size = len(self.data)
        if not keep:
            self.data = b""

    def __repr__(self):
        return (f"<{self.status} by {self.served_by} {self.size} B "
                f"{self.start:.2f}-{self.end:.2f} {self.error or ''}>")


def lipsync_form(avatar_id):
    return multipart([("audio", "speech.wav", speech(LOAD_SECONDS))], [("avatar_id", avatar_id)])


class Load:
    """`threads` clients sending requests back to back until stopped."""

    def __init__(self, base, avatar_id, threads=4):
        self.base = base
        self.body, self.ctype = lipsync_form(avatar_id)
        self.records = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(threads)]

    def _client(self):
        while not self.stopping.is_set():
            a = Attempt(self.base, self.body, self.ctype)
            with self.lock:
                self.records.append(a)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=180)

    def failed(self):
        with self.lock:
            return [a for a in self.records if not a.ok]

    def wait_done(self, n, timeout=120):
        """Waits until n more requests finished (so the load really runs)."""
        with self.lock:
            target = len(self.records) + n
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.records) >= target:
                    return
            time.sleep(0.1)
        raise AssertionError(f"load stalled: {self.records[-10:]}")


def probe_in(container, data):
    """assert_video, with the replica's own ffprobe when this machine has none."""
    if shutil.which("ffprobe"):
        return assert_video(data)
    p = subprocess.run(
        ["docker", "exec", "-i", container.lstrip("/"), "ffprobe", "-v", "error",
         "-show_streams", "-of", "json", "-i", "pipe:0"],
        input=data, capture_output=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    kinds = sorted(s["codec_name"] for s in json.loads(p.stdout)["streams"])
    assert kinds == ["aac", "h264"], kinds


def test_least_connections_spreads_requests_over_every_replica(stack, avatar):
    before = stack.served()
    body, ctype = lipsync_form(avatar)
    with ThreadPoolExecutor(6) as pool:
        attempts = list(pool.map(lambda i: Attempt(stack.base, body, ctype, keep=i < 3), range(60)))
    assert all(a.ok for a in attempts), [a for a in attempts if not a.ok]
    for a in attempts[:3]:
        probe_in(stack.containers()[0], a.data)
    # Each replica's own count (its /metrics), once the last ones are counted.
    deadline = time.monotonic() + 10
    while True:
        after = stack.served()
        delta = {c: after[c] - before.get(c, 0) for c in after}
        if sum(delta.values()) >= 60 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"requests per replica: {delta}")
    assert sum(delta.values()) == 60, delta
    assert all(n >= 10 for n in delta.values()), delta
    by_header = {}
    for a in attempts:
        by_header[a.served_by] = by_header.get(a.served_by, 0) + 1
    assert len(by_header) == REPLICAS, by_header


def test_a_response_streams_through_the_balancer(stack, avatar):
    """The video arrives while it is made, not all at once when it is done: the balancer
    passes fragments on as the replica writes them."""
    body, ctype = multipart([("audio", SPEECH, media(SPEECH))], [("avatar_id", avatar)])
    u = urllib.parse.urlsplit(stack.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        start = time.monotonic()
        conn.request("POST", "/v1/lipsync", body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        reads = []
        while chunk := resp.read1(1 << 16):
            reads.append((time.monotonic() - start, len(chunk)))
    finally:
        conn.close()
    first, last = reads[0][0], reads[-1][0]
    print(f"1 s of speech: first body bytes at {first:.2f} s, last at {last:.2f} s, "
          f"{len(reads)} reads")
    # The init segment comes with the first frames; the other 25 frames take seconds more.
    assert len(reads) >= 3 and first <= 0.6 * last, reads


def test_an_avatar_created_once_is_served_by_every_replica(stack):
    # A different photo from the module's avatar, so only one replica has seen it.
    avatar_id = create_avatar(stack.base, image="grace_hopper.jpg")
    body, ctype = lipsync_form(avatar_id)
    with ThreadPoolExecutor(3) as pool:
        attempts = list(pool.map(lambda _: Attempt(stack.base, body, ctype), range(20)))
    statuses = [a.status for a in attempts]
    assert all(a.ok for a in attempts), attempts
    assert statuses == [200] * 20, statuses
    served_by = {a.served_by for a in attempts}
    print(f"avatar used on {sorted(served_by)}")
    assert len(served_by) == REPLICAS, served_by


def test_a_live_session_through_the_balancer(stack, avatar):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{stack.port}/v1/stream"
    # The browser's Origin is this page's, the same host:port as the Host the balancer passes on.
    origin = f"http://127.0.0.1:{stack.port}"
    with connect(url, origin=origin, max_size=None, proxy=None, open_timeout=30) as ws:
        ws.send(json.dumps({
            "avatar_id": avatar,
            "fps": 25,
            "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
            "output": "fmp4",
            # Any drawing rate: three replicas on two cores may each offer fewer than 5 faces/s.
            "min_draw_fps": 0,
        }))
        ready = json.loads(ws.recv(timeout=60))
        assert ready["type"] == "ready", ready
        pcm = media(SPEECH)[44:]  # the whole 1 s: 16 kHz mono s16le after the WAV header
        chunk = 640  # 20 ms

        def speak():
            t0 = time.monotonic()
            for i in range(0, len(pcm), chunk):
                time.sleep(max(0.0, t0 + i / chunk * 0.02 - time.monotonic()))
                ws.send(pcm[i:i + chunk])
            ws.send(json.dumps({"type": "end"}))

        sender = threading.Thread(target=speak)
        sender.start()
        fragments, events = 0, []
        for msg in ws:  # until the server closes after `end`
            if isinstance(msg, bytes):
                fragments += 1
            else:
                events.append(json.loads(msg))
        sender.join()
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, events
    assert "speaking" in kinds and kinds[-1] == "end", events
    assert fragments >= 2, fragments  # the init segment and at least one fragment
    assert events[-1]["stats"]["speaking_frames"] >= 20, events[-1]

    # Another site's page is refused by the replica (so the Host above really was checked).
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="http://elsewhere.example", proxy=None, open_timeout=30)
    assert refused.value.response.status_code == 403


def test_killing_a_replica_fails_only_the_requests_it_was_streaming(stack, avatar):
    replicas = stack.containers()
    with Load(stack.base, avatar, threads=4) as load:
        load.wait_done(8)
        # The replica the balancer has the most streams on now (so the kill cuts some).
        streams = {a: n for (b, _), (_, a, n) in stack.servers().items() if b == "lipsync"}
        victim = max(replicas, key=lambda c: streams.get(f"{stack.ip(c)}:8080", 0))
        name = stack.server_of(victim)
        with load.lock:
            done_before = len(load.records)
        t_kill = time.monotonic()
        docker("kill", victim.lstrip("/"))
        t_killed = time.monotonic()
        load.wait_done(30)
    records = load.records
    failed = [a for a in records if not a.ok]
    # In flight at the kill: started before it and not finished when it was sent.
    in_flight = [a for a in records if a.start < t_killed and a.end > t_kill]
    on_victim = [a for a in in_flight if a.served_by in (name, None)]
    after = [a for a in records if a.start >= t_killed]
    print(f"kill of {victim} ({name}): {len(records)} requests, {len(in_flight)} in flight, "
          f"{len(failed)} failed: {failed}; {len(after)} started after the kill")
    assert len(after) >= 20, after
    # No request started after the kill fails: the balancer retries one that meets the dead
    # replica (connection refused or timed out) on another, and takes the replica out within
    # about a second (its address leaves Docker's DNS, its /ready check fails).
    assert all(a.ok for a in after), [a for a in after if not a.ok]
    # The ones that failed were being streamed by the killed replica.
    for a in failed:
        assert a.start < t_killed and a.end > t_kill, (a, t_kill)
        assert a.served_by in (name, None), (a, name)
    assert len(failed) <= len(on_victim), (failed, on_victim)
    assert done_before > 0

    # Back to three for the next test.
    docker("start", victim.lstrip("/"))
    stack.wait_balanced(stack.containers())


def test_a_rolling_restart_under_load_fails_no_request(stack, avatar):
    replicas = stack.containers()
    stack.wait_balanced(replicas)
    timings = []
    with Load(stack.base, avatar, threads=4) as load:
        load.wait_done(6)
        for c in replicas:
            t0 = time.monotonic()
            ip_before = stack.ip(c)
            # SIGTERM; the replica drains its streams (LIPSYNC_SHUTDOWN_TIMEOUT 30 s) and exits.
            docker("stop", "-t", "40", c.lstrip("/"), timeout=120)
            stopped = time.monotonic()
            exit_code = docker("inspect", "-f", "{{.State.ExitCode}}", c.lstrip("/")).stdout.strip()
            assert exit_code == "0", (c, exit_code, docker("logs", "--tail", "30", c.lstrip("/")).stderr)
            docker("start", c.lstrip("/"))
            stack.wait_balanced(replicas)
            timings.append((c, round(stopped - t0, 1), round(time.monotonic() - stopped, 1),
                            f"{ip_before} -> {stack.ip(c)}"))
            load.wait_done(4)
        load.wait_done(6)
    records = load.records
    failed = [a for a in records if not a.ok]
    print(f"rolling restart (replica, stop s, back in s, address): {timings}; "
          f"{len(records)} requests, {len(failed)} failed")
    assert not failed, failed
