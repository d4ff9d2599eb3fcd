"""The wheel a user installs: built from this tree, it claims exactly one import name, ``mpflow``, and works
installed outside the repository — the CLI, ``mpflow serve`` with the shipped operators, and the client.

The wheel is installed with ``pip install --no-deps --target`` into a fresh virtual environment that sees the
dependencies (torch, FastAPI, …) through a path entry to this environment's site-packages; path entries do
not run that directory's ``.pth`` hooks, so the editable install of the repository stays invisible, and every
command runs from a temporary directory, away from the source tree.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.conftest import BUILD_LOG

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh venv with the wheel installed; (its python, an environment without this repository)."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    python = home / "bin" / "python"
    site = Path(
        subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .decode()
        .strip()
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("MPFLOW_")}
    yield python, env


def test_the_build_warns_nothing(wheel: Path) -> None:
    """Issue 38: the set-up's build printed setuptools warnings (the license as a table, package data "absent from
    packages"); the build log of the wheel has none."""
    log = (wheel.parent / BUILD_LOG).read_text()
    assert "running bdist_wheel" in log, log[-2000:]  # the backend's own output is there
    setuptools_warning = r"Setuptools\w*Warning|absent from the `packages`|is deprecated|!!$"
    warnings = [line for line in log.splitlines() if re.search(setuptools_warning, line)]
    assert warnings == [], warnings


def test_the_wheel_claims_only_mpflow(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"mpflow", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    assert any(n.startswith("mpflow/operators/pretrained/") and n.endswith("config.json") for n in names)
    assert "mpflow/service/dashboard/static/index.html" in names
    assert "mpflow/service/engine/default_methods.json" in names  # the measured defaults travel with their reader
    for part in ("api", "streams", "engine", "store", "dashboard"):
        assert f"mpflow/service/{part}/__init__.py" in names, part
    assert not any(n.startswith(("mpflow/tests", "mpflow/benchmarks")) for n in names)


def _py(venv: tuple[Path, dict[str, str]], code: str, cwd: Path) -> str:
    python, env = venv
    done = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_installed_package_imports_from_site_packages(venv: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    out = _py(
        venv,
        "import importlib.util as u, json, mpflow, mpflow.operators, mpflow.service.app, mpflow.training.tasks\n"
        "from mpflow import Client\n"
        "from mpflow.operators.registry import default_dirs, list_operators\n"
        "print(json.dumps({'file': mpflow.operators.__file__, 'client': Client.__module__,\n"
        "  'bare': [n for n in ('operators', 'training', 'service') if u.find_spec(n)],\n"
        "  'operators': len(list_operators(default_dirs()))}))",
        tmp_path,
    )
    got = json.loads(out)
    assert "site-packages" in got["file"] and str(ROOT) not in got["file"]
    assert got["client"] == "mpflow.client.http"
    assert got["bare"] == []
    assert got["operators"] >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_installed_cli_serves_and_the_client_filters(venv: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    python, env = venv
    help_out = subprocess.run(
        [str(python), "-m", "mpflow", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert help_out.returncode == 0 and "serve" in help_out.stdout
    port = _free_port()
    env = {**env, "MPFLOW_DATA_DIR": str(tmp_path / "data"), "MPFLOW_LOG_LEVEL": "WARNING"}
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(python), "-m", "mpflow", "serve", "--port", str(port)], cwd=tmp_path, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the installed server did not get ready"
            time.sleep(0.3)
        out = _py(
            venv,
            "import json\nfrom mpflow import Client\n"
            f"c = Client('http://127.0.0.1:{port}')\n"
            "prior = {'type': 'gaussian', 'mean': [0, 0], 'cov': [[1, 0], [0, 1]]}\n"
            "model = {'family': 'linear_gaussian', 'params': {}}\n"
            "s = c.create_stream(model, prior, num_particles=256, seed=0)\n"
            "r = s.update([[0.3, -1.2], [0.1, -0.9]], seq=1)\n"
            "m = c.create_stream(model, prior, method='mpf', num_particles=256, seed=0)\n"
            "print(json.dumps({'step': r['step'], 'method': r['method'], 'reason': r['method_reason'],\n"
            "  'operator': m.document['operator'], 'log_evidence': r['summary']['log_evidence']}))",
            tmp_path,
        )
        got = json.loads(out)
        assert got["step"] == 2
        assert got["operator"], "the shipped operators travel in the wheel and serve from it"
        assert got["method"] == "kalman" and got["reason"].startswith("measured"), "so does the default table"
        assert abs(got["log_evidence"] - (-6.623)) < 0.1  # conjugate answer: README tour
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
