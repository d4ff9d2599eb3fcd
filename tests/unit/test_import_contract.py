"""The import contract of docs/DESIGN.md "Layers", checked by import-linter (``[tool.importlinter]`` in
pyproject.toml): imports point downwards only,

    mpflow.operators  ←  mpflow.training | mpflow.service  ←  mpflow.cli;   mpflow.client: nothing of the server

and inside the service (docs/DESIGN.md "Package layout")

    service.store  ←  service.engine  ←  service.streams  ←  service.api  ←  service.dashboard  ←  service.app

the shipped package never imports ``tests`` or ``benchmarks``, and tests never import ``benchmarks``. (Relative
imports and the bare folder names ``operators``, ``training``, ``service`` are ruff's: TID252, TID251.)

import-linter's graph builder (grimp) reads a package from its folder, and mpflow's sub-packages live in sibling
folders mapped by ``package-dir`` (setup.py). So it runs on a tree of symbolic links laid out as the wheel is —
``mpflow/`` holding links to the entries of ``mpflow/`` and to ``operators/``, ``training/``, ``service/`` — in a
temporary folder first on ``PYTHONPATH``; nothing in the repository moves. A second run, with a module added
that breaks two contracts, shows the check can fail.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def package_dirs() -> dict[str, str]:
    """setup.py's ``PACKAGE_DIRS`` (import name → folder), read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (value,) = (
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIRS" for t in node.targets)
    )
    return ast.literal_eval(value)


def link_tree(into: Path, extra: dict[str, str] | None = None) -> Path:
    """The package as the wheel lays it out, in links under ``into``; ``extra`` adds modules (path under
    ``mpflow/`` → source), their folder then made of links rather than one link."""
    top = into / "mpflow"
    top.mkdir()
    for entry in (ROOT / "mpflow").iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in package_dirs().items():
        if name != "mpflow":
            (top / name.removeprefix("mpflow.")).symlink_to(ROOT / folder)
    for relative, source in (extra or {}).items():
        folder = top
        for part in Path(relative).parent.parts:  # each linked folder on the way: a folder of links to its entries
            folder = folder / part
            if folder.is_symlink():
                real = folder.resolve()
                folder.unlink()
                folder.mkdir()
                for entry in real.iterdir():
                    (folder / entry.name).symlink_to(entry)
        (top / relative).write_text(source)
    return into


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject.toml's contracts, run in ``tree`` (it puts its working folder first on the
    path: the links' ``mpflow``, not the repository's ``mpflow/``; ``tests`` and ``benchmarks`` from the root)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    command = [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_layering_contracts_hold(tmp_path: Path) -> None:
    done = lint_imports(link_tree(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 7 kept, 0 broken." in done.stdout, done.stdout[-2000:]


def test_a_breach_is_caught(tmp_path: Path) -> None:
    """An operators module importing the service, a client module importing torch, a store module importing the
    API and a dashboard module importing a router: four contracts broken (the repository is not touched)."""
    extra = {
        "operators/breach.py": "from mpflow.service import app\n",
        "client/breach.py": "def f():\n    import torch\n",
        "service/store/breach.py": "from mpflow.service.api import deps\n",
        "service/dashboard/breach.py": "from mpflow.service.api import reads\n",
    }
    done = lint_imports(link_tree(tmp_path, extra))
    assert done.returncode == 1, done.stdout[-4000:]
    assert "Contracts: 3 kept, 4 broken." in done.stdout, done.stdout[-2000:]
    assert "mpflow.operators.breach -> mpflow.service.app" in done.stdout
    assert "mpflow.client.breach -> torch" in done.stdout
    assert "mpflow.service.store.breach -> mpflow.service.api.deps" in done.stdout
    assert "mpflow.service.dashboard.breach -> mpflow.service.api.reads" in done.stdout
    assert not (ROOT / "service" / "store" / "breach.py").exists()


def test_the_root_and_the_client_load_no_server_code() -> None:
    """``import mpflow`` loads neither the client nor torch; ``from mpflow import Client`` loads the client and
    nothing of the server (what ``pip install "mpflow[client]"`` relies on; tests/deploy/test_client_install.py
    shows it in a venv without them)."""
    code = (
        "import sys, mpflow\n"
        "heavy = ('torch', 'fastapi', 'redis', 'httpx', 'mpflow.client', 'mpflow.service', 'mpflow.operators')\n"
        "root = [m for m in heavy if m in sys.modules]\n"
        "from mpflow import Client\n"
        "server = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'redis', 'scipy')\n"
        "          or m.startswith(('mpflow.service', 'mpflow.operators', 'mpflow.training'))]\n"
        "print(root, server)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[] []", done.stdout
