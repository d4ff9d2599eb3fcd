"""The documentation examples run as a user runs them (a subprocess, ``--serve``: its own server and store)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXAMPLES = {
    # script: (its arguments besides --out, what its output must say)
    "track_target.py": (["--steps", "6", "--particles", "64"], ["6 steps, mpf"]),
    "track_irregular.py": (
        ["--steps", "12", "--dropout", "0.3"],
        ["12 fixes (", "kalman: position RMSE", "95 % region"],
    ),
    "sv_gbp_usd.py": (["--steps", "30", "--particles", "256"], ["30 days, smc2, N = 256", "  phi: mean"]),
    "anomaly_score.py": (["--steps", "60", "--at", "40"], ["60 readings, kalman, outlier injected at step 41"]),
    "smooth_fixed_lag.py": (["--steps", "30", "--lag", "5"], ["30 readings, kalman, smoothing_lag 5"]),
    "learn_noise.py": (["--steps", "40", "--particles", "128"], ["40 readings, smc2, N = 128"]),
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_writes_its_plot(script: str, tmp_path: Path) -> None:
    args, says = EXAMPLES[script]
    stdout = _run(script, args, tmp_path)
    assert all(s in stdout for s in says), stdout[-2000:]
    assert f"wrote {tmp_path / 'plot.png'}" in stdout


def _run(script: str, args: list[str], tmp_path: Path) -> str:
    out = tmp_path / "plot.png"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--serve", *args, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return run.stdout


def _number(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, text[-2000:]
    return float(match.group(1))


def test_track_irregular_holds_the_truth_in_its_95_percent_region(tmp_path: Path) -> None:
    """Issue 58, newcomer task 1: fixes at irregular times, lost (None) or holed (NaN), a 95 % region per step from
    the answers' 0.025 and 0.975 quantiles — which holds the truth about 95 % of the time."""
    text = _run("track_irregular.py", ["--steps", "60", "--dropout", "0.3"], tmp_path)
    lost, partial = _number(text, r"\((\d+) lost"), _number(text, r"(\d+) partial\)")
    assert lost > 0 and partial > 0, text
    assert _number(text, r"true position's coordinates at (\d+)% of steps") >= 80, text


def test_anomaly_score_flags_the_injected_outlier(tmp_path: Path) -> None:
    """Issue 58, newcomer task 2: the injected outlier has the stream's lowest log-evidence increment and a
    two-sided p-value below 0.01; the other readings' p-values are mostly above it."""
    text = _run("anomaly_score.py", ["--steps", "150", "--at", "100"], tmp_path)
    assert "lowest log-evidence increment: step 101" in text, text
    row = re.search(r"^\s+101\s+\S+\s+(\S+)\s+(\S+)$", text, re.M)
    assert row and float(row.group(2)) < 0.01, text
    flagged = re.search(r"flagged \(p < 0.01\): steps \[([\d, ]*)\]", text)
    assert flagged and 101 in [int(s) for s in flagged.group(1).split(",")], text
    assert _number(text, r"other steps with p > 0.01: ([\d.]+)") >= 0.9, text


def test_smooth_fixed_lag_narrows_the_filtered_posterior(tmp_path: Path) -> None:
    """Issue 58, newcomer task 4: a stream with ``smoothing_lag``; the smoothed sd is below the filtered sd at the
    lagged steps, and the smoothed means are closer to the truth."""
    text = _run("smooth_fixed_lag.py", ["--steps", "60", "--lag", "8"], tmp_path)
    assert _number(text, r"smoothed sd below the filtered sd at (\d+)% of the 53 lagged steps") == 100, text
    for name in ("position", "velocity"):
        f_rmse, f_sd, s_rmse, s_sd = map(float, re.search(rf"^\s+{name}\s+(.*)$", text, re.M).group(1).split())
        assert s_sd < f_sd and s_rmse < f_rmse, text


def test_learn_noise_finds_the_true_r(tmp_path: Path) -> None:
    """Issue 58, newcomer task 3: R given as a lognormal prior, learned online by smc2 from data simulated with a
    known R: the posterior mean within 2 posterior sd of it."""
    text = _run("learn_noise.py", ["--steps", "200"], tmp_path)
    assert "200 readings, smc2" in text, text
    assert abs(_number(text, r"sd [\d.]+: ([-+][\d.]+) posterior sd from the true R")) < 2, text


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
