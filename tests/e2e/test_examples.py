"""The documentation examples run as a user runs them (a subprocess, ``--serve``: its own server and store)."""

from __future__ import annotations

import shutil
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


#: run a script as a (non-editable) install would: the editable finder removed, ``installed`` a site folder
_AS_INSTALLED = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:0] = [{examples!r}, {installed!r}]  # the script's folder first, as Python puts it, then site-packages
sys.argv = [{script!r}, "--help"]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_imports_the_installed_mpflow_not_the_checkouts_folder(script: str, tmp_path: Path) -> None:
    """A checkout's ``mpflow/`` folder holds only the CLI (the package maps ``mpflow.service`` to ``service/``): an
    example that put the checkout on ``sys.path`` found it first and failed with ``No module named
    'mpflow.service'`` under a non-editable install (issue 38). Here the examples sit in a checkout and mpflow is
    installed as a wheel lays it out."""
    checkout, installed = tmp_path / "checkout", tmp_path / "site"
    shutil.copytree(ROOT / "examples", checkout / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "mpflow", checkout / "mpflow", ignore=shutil.ignore_patterns("__pycache__"))
    (installed / "mpflow").mkdir(parents=True)
    shutil.copy(ROOT / "mpflow" / "__init__.py", installed / "mpflow")
    links = {"cli": "mpflow/cli", "client": "mpflow/client", "service": "service", "operators": "operators"}
    for name, source in links.items():
        (installed / "mpflow" / name).symlink_to(ROOT / source)
    path = str(checkout / "examples" / script)
    code = _AS_INSTALLED.format(examples=str(checkout / "examples"), installed=str(installed), script=path)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_an_example_run_without_mpflows_environment_says_which_python_to_use(tmp_path: Path) -> None:
    run = subprocess.run(  # -S: no site-packages, as a system Python without the set-up's packages
        [sys.executable, "-S", str(ROOT / "examples" / "track_target.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "No module named" in run.stderr
    assert ".venv/bin/python examples/track_target.py" in run.stderr and "make setup" in run.stderr
