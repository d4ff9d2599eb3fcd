"""Fixtures of the deployment tests: the wheel built from this tree, and a server started as a user starts it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.server import serve_as_user

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90
#: the build's output (``pip wheel -vv``: setuptools' own lines and warnings), beside the wheel
BUILD_LOG = "build.log"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the source tree (the files git tracks or would track), so the build leaves
    nothing (build/, *.egg-info) in the repository."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-vv", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    (out / BUILD_LOG).write_text(built.stdout + built.stderr)  # the backend's output, for test_the_build_warns_nothing
    (whl,) = out.glob("mpflow-*.whl")
    return whl


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``python -m mpflow serve --port P`` from the repository root, embedded Redis under a temporary data dir."""
    data = tmp_path_factory.mktemp("readme") / "data"
    env = {"MPFLOW_DATA_DIR": str(data), "MPFLOW_LOG_LEVEL": "WARNING"}
    with serve_as_user(env, data.parent / "server.log", start_timeout=START_TIMEOUT_S) as srv:
        yield srv.port
