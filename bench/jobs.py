#!/usr/bin/env python3
"""Batch jobs, measured against the release server (standard library only).

  python3 bench/jobs.py ttfb    [--jobs 12] [--repeat 5]
      Time to first byte of POST /v1/lipsync on an idle server, then with batch jobs queued
      and running (the background class: job frames only fill what interactive requests
      leave of each batch).

  python3 bench/jobs.py restart [--jobs 50] [--kill 9|15] [--at 0.3]
      Submits N jobs with a webhook, stops the server (SIGKILL by default) once a fraction of
      them has succeeded, starts it again on the same data directory, and waits for all of
      them: every video downloaded and probed (faststart MP4), every webhook signed and
      verified, exactly one success webhook per job. Prints the recovery time (restart ->
      the first job finishing after it) and the runs counts.

Both use the test checkpoint and the speech and photo under tests/media; the server is
`target/release/lipsync` (build it first: cargo build --release).
"""

import argparse
import hashlib
import hmac
import http.server
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target/release/lipsync")
CHECKPOINT = os.path.join(ROOT, "tests/fixtures/checkpoints/zip_bare.pt")
SPEECH = os.path.join(ROOT, "tests/media/arctic_a0007_1s.wav")
LONG_SPEECH = os.path.join(ROOT, "tests/media/arctic_a0007.wav")
PHOTO = os.path.join(ROOT, "tests/media/astronaut.png")
SECRET = "bench-secret"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, data_dir, port, extra=()):
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(os.path.join(data_dir, "server.log"), "ab")
        self.proc = subprocess.Popen(
            [BIN, "serve", "--checkpoint", CHECKPOINT, "--port", str(port),
             "--data-dir", data_dir, "--max-batch", "8", "--first-batch", "2",
             "--webhook-secret", SECRET, *extra],
            stdout=self.log, stderr=self.log)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: see {self.log.name}")
            time.sleep(0.2)
        raise SystemExit("the server did not get ready in 120 s")

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=120)


def multipart(files, texts):
    boundary = uuid.uuid4().hex
    out = bytearray()
    for name, path in files:
        with open(path, "rb") as f:
            data = f.read()
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; "
                f"filename=\"{os.path.basename(path)}\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode()
        out += data + b"\r\n"
    for name, value in texts:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                f"{value}\r\n").encode()
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def post(url, files, texts=()):
    body, ctype = multipart(files, texts)
    req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype})
    return urllib.request.urlopen(req, timeout=300)


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def ttfb(server):
    """Seconds from sending a POST /v1/lipsync to its first body byte, and to the end."""
    t0 = time.monotonic()
    with post(server.base + "/v1/lipsync", [("audio", SPEECH), ("image", PHOTO)]) as r:
        r.read(1)
        first = time.monotonic() - t0
        r.read()
    return first, time.monotonic() - t0


def bench_ttfb(args):
    data = tempfile.mkdtemp(prefix="lipsync-bench-jobs-")
    try:
        server = Server(data, free_port())
        ttfb(server)  # the first request warms the avatar path up
        idle = [ttfb(server) for _ in range(args.repeat)]
        ids = []
        for _ in range(args.jobs):
            with post(server.base + "/v1/jobs", [("audio", LONG_SPEECH), ("image", PHOTO)]) as r:
                ids.append(json.load(r)["id"])
        time.sleep(1.0)
        busy = []
        for _ in range(args.repeat):
            busy.append(ttfb(server))
        states = [get_json(f"{server.base}/v1/jobs/{i}")["status"] for i in ids]
        server.stop()
        med = lambda xs, k: statistics.median(x[k] for x in xs)
        print(f"POST /v1/lipsync, 1 s of speech, median of {args.repeat}:")
        print(f"  idle server:            first byte {med(idle, 0):.3f} s, whole video {med(idle, 1):.3f} s")
        print(f"  {args.jobs} jobs queued/running: first byte {med(busy, 0):.3f} s, whole video {med(busy, 1):.3f} s")
        print(f"  ratio (busy/idle) first byte {med(busy, 0) / med(idle, 0):.2f}x, "
              f"whole {med(busy, 1) / med(idle, 1):.2f}x")
        print(f"  jobs when the last request ended: "
              + ", ".join(f"{s} {states.count(s)}" for s in sorted(set(states))))
    finally:
        shutil.rmtree(data, ignore_errors=True)


class Hooks(http.server.BaseHTTPRequestHandler):
    received = []
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        want = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        ok = hmac.compare_digest(want, self.headers.get("X-Lipsync-Signature", ""))
        with Hooks.lock:
            Hooks.received.append((self.headers.get("X-Lipsync-Event"), ok, json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def top_level_boxes(data):
    boxes, i = [], 0
    while i + 8 <= len(data):
        size = int.from_bytes(data[i:i + 4], "big")
        boxes.append(data[i + 4:i + 8].decode("latin-1"))
        if size == 1:
            size = int.from_bytes(data[i + 8:i + 16], "big")
        if size < 8:
            break
        i += size
    return boxes


def bench_restart(args):
    data = tempfile.mkdtemp(prefix="lipsync-bench-jobs-")
    hooks = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=hooks.serve_forever, daemon=True).start()
    hook_url = f"http://127.0.0.1:{hooks.server_address[1]}/hook"
    port = free_port()
    try:
        server = Server(data, port)
        t0 = time.monotonic()
        ids = []
        for n in range(args.jobs):
            with post(server.base + "/v1/jobs", [("audio", SPEECH), ("image", PHOTO)],
                      [("webhook_url", hook_url), ("metadata", json.dumps({"n": n}))]) as r:
                ids.append(json.load(r)["id"])
        print(f"{args.jobs} jobs submitted in {time.monotonic() - t0:.1f} s")
        target = max(1, int(args.jobs * args.at))
        while True:
            done = sum(get_json(f"{server.base}/v1/jobs/{i}")["status"] == "succeeded" for i in ids)
            if done >= target:
                break
            time.sleep(0.3)
        sig = signal.SIGKILL if args.kill == 9 else signal.SIGTERM
        states = [get_json(f"{server.base}/v1/jobs/{i}")["status"] for i in ids]
        t_stop = time.monotonic()
        server.stop(sig)
        print(f"stopped with signal {args.kill} at {done} succeeded "
              f"({states.count('running')} running, {states.count('queued')} queued)")
        t_restart = time.monotonic()
        server = Server(data, port)
        ready = time.monotonic() - t_restart
        before = set(i for i, s in zip(ids, states) if s == "succeeded")
        first_after = None
        while True:
            jobs = [get_json(f"{server.base}/v1/jobs/{i}") for i in ids]
            fresh = [j for j in jobs if j["status"] == "succeeded" and j["id"] not in before]
            if fresh and first_after is None:
                first_after = time.monotonic() - t_restart
            if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
                break
            time.sleep(0.3)
        total = time.monotonic() - t0
        failed = [j for j in jobs if j["status"] != "succeeded"]
        videos_ok = 0
        for j in jobs:
            with urllib.request.urlopen(server.base + j["video_url"], timeout=60) as r:
                video = r.read()
            boxes = top_level_boxes(video)
            faststart = "moof" not in boxes and boxes.index("moov") < boxes.index("mdat")
            with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
                f.write(video)
                f.flush()
                probe = subprocess.run(
                    ["ffprobe", "-v", "error", "-show_entries", "stream=codec_name", "-of",
                     "csv=p=0", f.name], capture_output=True, text=True)
            videos_ok += faststart and probe.stdout.split() == ["h264", "aac"]
        deadline = time.time() + 30
        while time.time() < deadline and len(Hooks.received) < len(ids):
            time.sleep(0.2)
        time.sleep(1.0)
        per_job = {}
        for event, ok, body in Hooks.received:
            per_job.setdefault(body["id"], []).append((event, ok))
        signed = sum(1 for i in ids if per_job.get(i) == [("job.succeeded", True)])
        runs = [j["runs"] for j in jobs]
        server.stop()
        print(f"restart: ready in {ready:.1f} s; first job finished {first_after:.1f} s after "
              f"the restart began; stop -> first finish {first_after + (t_restart - t_stop):.1f} s")
        print(f"all {len(ids)} ended {total:.1f} s after the first submit: "
              f"{len(ids) - len(failed)} succeeded, {len(failed)} not")
        print(f"videos: {videos_ok} of {len(ids)} faststart MP4s with h264 + aac")
        print(f"webhooks: {signed} of {len(ids)} jobs got exactly one job.succeeded with a valid "
              f"signature ({len(Hooks.received)} deliveries in all)")
        print(f"runs: {runs.count(1)} jobs ran once, {runs.count(2)} twice, "
              f"{sum(r > 2 for r in runs)} more")
        if failed or videos_ok != len(ids) or signed != len(ids):
            sys.exit(1)
    finally:
        hooks.shutdown()
        shutil.rmtree(data, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("ttfb")
    t.add_argument("--jobs", type=int, default=12)
    t.add_argument("--repeat", type=int, default=5)
    r = sub.add_parser("restart")
    r.add_argument("--jobs", type=int, default=50)
    r.add_argument("--kill", type=int, choices=[9, 15], default=9)
    r.add_argument("--at", type=float, default=0.3, help="fraction succeeded before the stop")
    args = p.parse_args()
    if not os.access(BIN, os.X_OK):
        sys.exit(f"{BIN} is missing: cargo build --release")
    {"ttfb": bench_ttfb, "restart": bench_restart}[args.cmd](args)


if __name__ == "__main__":
    main()
