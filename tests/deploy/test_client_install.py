"""The client on its own: ``pip install "mpflow[client]"`` into a fresh virtual environment (the wheel built from
this tree, its dependencies from PyPI — pip's cache makes a second run fast) gives ``from mpflow import Client,
AsyncClient`` and runs the README's Python tour against a server, with no torch, FastAPI or Redis installed.

The server is the repository's (``python -m mpflow serve``, the full install); only the client runs in the new
environment, from a directory away from the source tree. Without PyPI the test skips, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_readme_examples import quoted_tour_lines, run_block, tour_line

pytestmark = pytest.mark.slow

#: what the client must not bring in (the server's dependencies)
SERVER_ONLY = ("torch", "fastapi", "redis", "uvicorn", "scipy", "pydantic_settings")


@pytest.fixture(scope="module")
def client_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of a fresh venv holding ``mpflow[client]`` (the wheel, and what pip resolves for it)."""
    home = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    python = str(home / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, f"{wheel}[client]"], capture_output=True, text=True, timeout=600)
    if done.returncode and ("NewConnectionError" in done.stderr or "Could not find a version" in done.stderr):
        pytest.skip(f"PyPI cannot be reached to install the client's dependencies: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def test_the_client_extra_installs_no_server(client_python: str, tmp_path: Path) -> None:
    code = (
        "import importlib.util as u, json\n"
        "from mpflow import AsyncClient, Client\n"
        "import mpflow.client\n"
        f"missing = [n for n in {SERVER_ONLY!r} if not u.find_spec(n)]\n"
        "print(json.dumps({'client': Client.__module__, 'missing': missing, 'file': mpflow.client.__file__}))\n"
        "import torch\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [client_python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    got = json.loads(done.stdout)
    assert got["client"] == "mpflow.client.http" and "site-packages" in got["file"]
    assert got["missing"] == list(SERVER_ONLY)
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in done.stderr, done.stderr[-2000:]


def test_the_readme_python_tour_runs_on_the_client_alone(client_python: str, server: int) -> None:
    """tour-python, run by the client-only interpreter, prints the lines the README quotes."""
    lines = run_block("tour-python", server, python=client_python).splitlines()
    quoted = quoted_tour_lines()
    assert len(lines) == len(quoted), lines
    for t, line in enumerate(lines):
        step, mean, inc = tour_line(line)
        assert step == t + 1
        assert all(abs(a - b) <= 0.005 for a, b in zip([*mean, inc], quoted[t], strict=True)), (line, quoted[t])


def test_a_command_names_the_full_install(client_python: str, tmp_path: Path) -> None:
    """``mpflow info`` with the client alone: exit status 2 and the install line, no traceback."""
    mpflow = Path(client_python).parent / "mpflow"
    done = subprocess.run([str(mpflow), "info"], cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs the full install" in done.stderr and 'pip install "mpflow[full]"' in done.stderr
    assert "Traceback" not in done.stderr
