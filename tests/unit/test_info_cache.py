"""``mpflow info`` without torch (issue 38: under 0.5 s): its catalogue is cached under ``$XDG_CACHE_HOME/mpflow``
by a key over everything it is read from (:mod:`mpflow.cli.info_cache`); a change to an operator folder gives
another key, so a stale catalogue is never read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mpflow.cli.info_cache import cache_key

RUN_INFO = """
import contextlib, io, json, sys
from mpflow.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["info", "--json"])
print(json.dumps({"torch": "torch" in sys.modules, "info": json.loads(out.getvalue())}))
"""


def _info(env: dict[str, str]) -> dict:
    run = subprocess.run([sys.executable, "-c", RUN_INFO], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_second_info_reads_the_cache_without_torch_and_says_the_same(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "MPFLOW_OPERATOR_DIRS": str(tmp_path / "ops")}
    first, second = _info(env), _info(env)
    assert first["torch"] and not second["torch"]  # built once (importing torch), then read
    assert first["info"] == second["info"] and len(list((tmp_path / "cache" / "mpflow").glob("info-*.json"))) == 1


def test_the_key_follows_the_operator_folders_and_the_settings(tmp_path, monkeypatch):
    ops = tmp_path / "ops"
    ops.mkdir()
    monkeypatch.setenv("MPFLOW_OPERATOR_DIRS", str(ops))
    before = cache_key([], 512)
    assert cache_key([], 512) == before and cache_key([], 64) != before
    (ops / "new-operator").mkdir()
    (ops / "new-operator" / "config.json").write_text("{}")
    assert cache_key([], 512) != before
    assert cache_key([str(tmp_path)], 512) != cache_key([], 512)
