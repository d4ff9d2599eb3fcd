"""The documentation examples run as a user runs them (a subprocess, ``--serve``: its own server and store)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXAMPLES = {
    # script: (its arguments besides --out, what its output must say)
    "track_target.py": (["--steps", "6", "--particles", "64"], ["6 steps, mpf"]),
    "track_irregular.py": (["--steps", "12", "--dropout", "0.3"], ["12 fixes (", "kalman: position RMSE"]),
    "sv_gbp_usd.py": (["--steps", "30", "--particles", "256"], ["30 days, smc2, N = 256", "  phi: mean"]),
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_writes_its_plot(script: str, tmp_path: Path) -> None:
    args, says = EXAMPLES[script]
    out = tmp_path / "plot.png"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--serve", *args, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(s in run.stdout for s in says), run.stdout[-2000:]
    assert f"wrote {out}" in run.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
