"""The ``mpflow`` command line as a user meets it: a quick ``--help``, every option explained with its default,
``info`` readable, ``filter --method mpf`` naming the operator it runs, flags named in their errors, and ``train``
loud about an operator whose validation never improved."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpflow.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _command_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_help_imports_neither_torch_nor_the_service():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from mpflow.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'fastapi', 'mpflow.service', 'mpflow.operators') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    assert out.returncode == 0, out.stderr
    assert all(command in out.stdout for command in COMMANDS)
    assert elapsed < 2.0, f"mpflow --help took {elapsed:.2f} s"  # 0.05 s measured; torch alone is ~2 s


#: runs ``mpflow ARGS`` in this process and prints which heavy modules it imported (benchmarks/cli_startup.py times it)
HEAVY_IMPORTS = """
import contextlib, io, json, sys
from mpflow.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
heavy = ("torch", "numpy", "fastapi", "pydantic", "mpflow.operators", "mpflow.service.app")
print(json.dumps([m for m in heavy if m in sys.modules]))
"""


def _imported(args: list[str], env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", HEAVY_IMPORTS, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_filter_help_and_a_cached_info_import_no_torch(tmp_path):
    """Issue 38: ``mpflow filter --help`` builds its parser without torch, numpy or the service; ``mpflow info``
    reads its catalogue and, with no ``MPFLOW_*`` variable set, the default settings from its cache — after the
    first run, which builds the cache, it imports neither torch nor pydantic (0.66 → 0.25 s measured)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MPFLOW_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    assert _imported(["filter", "--help"], env) == []
    assert "torch" in _imported(["info"], env)  # the first run builds the catalogue
    assert _imported(["info"], env) == []
    assert _imported(["info", "--json"], env) == []
    # a setting in the environment: read by the settings module (pydantic), the catalogue still from the cache
    env["MPFLOW_MAX_PARTICLES"] = "7"
    assert "torch" in _imported(["info"], env)  # the first run with MPFLOW_* builds its own catalogue
    assert "torch" not in _imported(["info"], env)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command):
    parser = _command_parser(command)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = f"mpflow {command} {action.option_strings[0]}"
        assert action.help, f"{flag} has no help"
        shown = formatter._expand_help(action)  # the help as printed, before wrapping
        if action.default is not None and action.default is not False:
            assert "default" in shown or f"({action.default})" in shown, f"{flag}: default not shown: {shown!r}"


@pytest.mark.parametrize("command", ["evaluate", "fit-sampler"])
def test_long_commands_have_short_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 45, out
    assert "In full: python -m pydoc mpflow.training." in out and "``" not in out


def test_a_bad_json_flag_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        main(["filter", "--params", "{bad"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --params: not valid JSON" in err and "'{bad'" in err
    with pytest.raises(SystemExit):
        main(["filter", "--params", "[1, 2]"])
    assert "argument --params: expected a JSON object" in capsys.readouterr().err


def test_filter_mpf_runs_the_fitting_operator_or_says_it_has_none(capsys):
    assert main(["filter", "--family", "lds", "--method", "mpf", "--steps", "2", "--particles", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# mpf with the operator lds-d2-v1 (the newest for lds, d = 2)"
    assert out[1].split()[:2] == ["step", "ms"] and len(out) == 5  # header, 2 steps, the evidence error
    argv = ["filter", "--family", "stochastic_volatility", "--dim", "3", "--method", "mpf", "--steps", "1"]
    assert main([*argv, "--particles", "32"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "no trained operator fits stochastic_volatility with d = 3" in first and "untrained" in first


def test_filter_operator_implies_mpf_and_is_refused_with_another_method(capsys):
    assert main(["filter", "--family", "lds", "--operator", "lds-d2-v1", "--steps", "1", "--particles", "32"]) == 0
    assert capsys.readouterr().out.startswith("# mpf with the operator lds-d2-v1\n")
    assert main(["filter", "--family", "lds", "--method", "smc", "--operator", "lds-d2-v1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --operator: only used with --method mpf, not smc"
    assert main(["filter", "--family", "lds", "--dim", "3", "--operator", "lds-d2-v1", "--steps", "1"]) == 2
    assert "operator lds-d2-v1 is for lds with d = 2" in capsys.readouterr().err


def test_info_is_readable_and_json_on_request(capsys, monkeypatch):
    monkeypatch.setenv("MPFLOW_API_KEYS", "tenant:a-secret-key")
    monkeypatch.setenv("MPFLOW_REDIS_URL", "redis://user:hunter2@store:6379/0")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for heading in ("Model families", "Methods:", "Trained operators", "Service settings in force"):
        assert heading in text
    assert "lds-d2-v1" in text and "mean error" in text and "max_particles" in text
    assert "a-secret-key" not in text and "hunter2" not in text and "1 key(s)" in text
    assert main(["info", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"families", "methods", "operators", "settings"} <= set(doc)
    assert "gmm" in {f["family"] for f in doc["families"]} and doc["settings"]["redis_url"].endswith("***@store:6379/0")
    assert "lds-d2-v1" in {o["name"] for o in doc["operators"]}


def _train_without_improvement(tmp_path: Path, *extra: str) -> list[str]:
    """A tiny training run whose learning rate is 0: the validation loss cannot improve (best iteration 0)."""
    return [
        "train", "--family", "gmm", "--dim", "2", "--iterations", "2", "--batch", "2", "--steps-per-seq", "2",
        "--particles", "16", "--out", str(tmp_path), "--val-every", "1", "--val-tasks", "2", "--lr", "0",
        "--weight-decay", "0", "--quiet", *extra,
    ]  # fmt: skip


def test_train_warns_loudly_when_validation_never_improved(tmp_path, capsys):
    assert main(_train_without_improvement(tmp_path / "kept")) == 0
    captured = capsys.readouterr()
    assert "WARNING: the validation loss never improved" in captured.err
    assert "the saved operator is the untrained network" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["metrics"]["best_iteration"] == 0
    assert main(_train_without_improvement(tmp_path / "refused", "--require-improvement")) == 3
    captured = capsys.readouterr()
    assert "nothing was saved (--require-improvement)" in captured.err and '"saved"' not in captured.out
    assert not [p for p in (tmp_path / "refused").iterdir() if not p.name.startswith("_")]
