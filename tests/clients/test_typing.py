"""The package is typed (`py.typed`): mypy --strict finds nothing in it, its plugins
included (checked against the pinned Pipecat and LiveKit Agents)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import CLIENT


@pytest.mark.timeout(120)
def test_mypy_strict_passes(tmp_path):
    run = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--no-incremental",
            "--cache-dir", str(tmp_path / "mypy-cache"), str(CLIENT / "src" / "lipsync_client"),
        ],
        capture_output=True, text=True, timeout=110,
        env={"MYPYPATH": str(CLIENT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (CLIENT / "src" / "lipsync_client" / "py.typed").exists()
