"""The Python reference client, examples/stream_client.py (the `websockets` package, pinned in
tests/browser/run.sh), against the release server: it opens a session on the repository's
photo, streams one second of speech in real time, ends, and writes the fragmented MP4 that came
back, which ffprobe must decode.
"""

import ast
import json
import subprocess
import sys

from conftest import MEDIA, ROOT, SPEECH

EXAMPLE = ROOT / "examples" / "stream_client.py"


def probe(path):
    """ffprobe's view of an MP4: its streams (codec_name, nb_read_packets, nb_read_frames) and
    its errors."""
    out = subprocess.run(
        [
            "ffprobe", "-v", "error", "-count_packets", "-count_frames",
            "-show_entries", "stream=codec_type,codec_name,nb_read_packets,nb_read_frames",
            "-of", "json", str(path),
        ],
        capture_output=True, text=True, timeout=60,
    )
    return json.loads(out.stdout or "{}").get("streams", []), out.stderr


def test_the_python_example_client_writes_a_playable_mp4(server, tmp_path):
    status, _, body = server.post_form(
        "/v1/avatars", {"image": ("astronaut.png", (MEDIA / "astronaut.png").read_bytes())}
    )
    assert status in (200, 201), body
    avatar = json.loads(body)["id"]
    out = tmp_path / "out.mp4"
    ws_url = server.url.replace("http://", "ws://", 1)
    run = subprocess.run(
        # Any drawing rate: the CPU server may offer fewer than the default 5 faces/s.
        [sys.executable, str(EXAMPLE), ws_url, avatar, str(SPEECH), str(out), "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    # It printed the `ready` message and the session's events, ending with `end` (no error).
    lines = run.stdout.splitlines()
    assert lines[0].startswith("ready:") and "video/mp4" in lines[0], run.stdout
    assert "'type': 'speaking'" in run.stdout, run.stdout
    assert "'type': 'error'" not in run.stdout, run.stdout
    end = ast.literal_eval(lines[-1])
    assert end["type"] == "end", run.stdout
    assert end["stats"]["utterances"] == 1 and end["stats"]["speaking_frames"] >= 20, end
    # A playable MP4, H.264 and AAC, holding every frame the session sent (idle, speech, idle).
    streams, errors = probe(out)
    assert errors == "", errors
    assert sorted(st["codec_name"] for st in streams) == ["aac", "h264"], streams
    video = next(st for st in streams if st["codec_type"] == "video")
    assert int(video["nb_read_packets"]) == end["stats"]["frames"], (video, end)
    # (ffprobe decodes all but the first one or two: the stream is cut into fragments as it is
    # encoded, and its decoder starts on them late, as a player joining it does)
    assert int(video["nb_read_frames"]) + 3 > end["stats"]["frames"], (video, end)
