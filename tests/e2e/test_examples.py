"""The documentation examples run as a user runs them (a subprocess, ``--serve``: its own server and store)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_track_target_example_writes_its_plot(tmp_path: Path) -> None:
    out = tmp_path / "track.png"
    args = ["--serve", "--steps", "6", "--particles", "64", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "track_target.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "6 steps, mpf" in run.stdout and f"wrote {out}" in run.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
