"""The import contract of docs/DESIGN.md "Layers": imports point downwards only.

    mpflow (root, lazy client re-export) → mpflow.cli → mpflow.service | mpflow.training → mpflow.operators

``mpflow.service`` and ``mpflow.training`` are siblings and never import each other; nothing in the shipped
package imports ``benchmarks`` or ``tests``, and nothing anywhere (package, tests, benchmarks, examples) uses
the bare folder names ``operators``, ``training`` or ``service`` as import names — the wheel does not provide
them. import-linter cannot be used here: its graph builder (grimp) walks a package's own folder, and the
sub-packages of ``mpflow`` live in sibling folders mapped by ``package-dir`` (setup.py); so the contract is
read from the source with :mod:`ast`, every import statement, function-level (lazy) ones included. Tests and
examples do not import ``benchmarks`` either (a benchmark is tested by running it, as a user does); benchmarks
may use the test harness (``tests.harness``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# layer of a folder → the mpflow sub-packages it may import
FOLDERS = {"operators": "mpflow.operators", "training": "mpflow.training", "service": "mpflow.service"}
ALLOWED = {
    "mpflow.client": {"mpflow.client"},  # the REST client installs without the server: it imports none of it
    "mpflow.operators": {"mpflow.operators"},
    "mpflow.training": {"mpflow.operators", "mpflow.training"},
    "mpflow.service": {"mpflow.operators", "mpflow.service", "mpflow.client"},
    "mpflow.cli": {"mpflow.operators", "mpflow.training", "mpflow.service", "mpflow.client", "mpflow.cli"},
}
ALLOWED["mpflow"] = set(ALLOWED)  # the root (``python -m mpflow``, the lazy client re-export) sits on top
BARE = {"operators", "training", "service"}
OUTSIDE_PACKAGE = {"benchmarks", "tests"}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``source`` (relative imports are not used)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def layer_of(module: str) -> str | None:
    """The layer an ``mpflow`` module name belongs to (``mpflow.service.app`` → ``mpflow.service``)."""
    parts = module.split(".")
    if parts[0] != "mpflow":
        return None
    if len(parts) == 1:
        return "mpflow"
    return f"mpflow.{parts[1]}" if f"mpflow.{parts[1]}" in ALLOWED else "mpflow"


def violations(layer: str | None, path: Path, source: str, forbidden: frozenset[str] = frozenset()) -> list[str]:
    """The contract's breaches in one file; ``layer`` None means a file outside the package (tests, benchmarks,
    examples), which may import any ``mpflow`` module but never the bare folder names nor the top-level names in
    ``forbidden``."""
    out = []
    for line, module in imported_modules(source):
        top = module.split(".")[0]
        where = f"{path}:{line}: imports {module}"
        if module.startswith("."):
            out.append(f"{where} (relative import: write the absolute mpflow name)")
        elif top in BARE:
            out.append(f"{where} (no such import name once installed: use mpflow.{module})")
        elif layer is None:
            if top in forbidden:
                out.append(f"{where} (run a benchmark as a user does instead of importing it)")
        elif top in OUTSIDE_PACKAGE:
            out.append(f"{where} (the shipped package never imports {top}/)")
        elif top == "mpflow" and layer_of(module) not in ALLOWED[layer]:
            out.append(f"{where} ({layer} may import only {sorted(ALLOWED[layer])})")
    return out


def package_files() -> list[tuple[str, Path]]:
    files = [(FOLDERS[folder], p) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    for p in sorted((ROOT / "mpflow").rglob("*.py")):
        files.append(("mpflow" if p.parent == ROOT / "mpflow" else f"mpflow.{p.parent.name}", p))
    return files


def outside_files() -> list[tuple[Path, frozenset[str]]]:
    no_benchmarks = frozenset({"benchmarks"})
    return [
        (p, frozenset() if folder == "benchmarks" else no_benchmarks)
        for folder in ("tests", "benchmarks", "examples")
        for p in sorted((ROOT / folder).rglob("*.py"))
    ]


def test_the_package_imports_downwards_only() -> None:
    bad = [v for layer, p in package_files() for v in violations(layer, p.relative_to(ROOT), p.read_text())]
    assert not bad, "\n".join(bad)


def test_tests_benchmarks_and_examples_use_the_mpflow_name() -> None:
    bad = [v for p, no in outside_files() for v in violations(None, p.relative_to(ROOT), p.read_text(), no)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("layer", "source", "reason"),
    [
        ("mpflow.operators", "from mpflow.service.store import Store\n", "may import only"),
        ("mpflow.operators", "def f():\n    from mpflow.training import tasks\n", "may import only"),
        ("mpflow.service", "import mpflow.training.evaluate\n", "may import only"),
        ("mpflow.training", "from mpflow.cli import main\n", "may import only"),
        ("mpflow.service", "from benchmarks.engine import run_benchmark\n", "never imports benchmarks/"),
        ("mpflow.training", "import tests.harness\n", "never imports tests/"),
        (None, "from operators.models import make_model\n", "no such import name"),
        ("mpflow.service", "from .store import Store\n", "relative import"),
    ],
)
def test_a_deliberate_violation_is_caught(layer: str | None, source: str, reason: str) -> None:
    (found,) = violations(layer, Path("x.py"), source)
    assert reason in found


def test_allowed_imports_pass() -> None:
    assert violations("mpflow.service", Path("x.py"), "from mpflow.operators.models import make_model\n") == []
    assert violations("mpflow.cli", Path("x.py"), "from mpflow.service.app import create_app\n") == []
    assert violations(None, Path("x.py"), "from benchmarks.engine import run_benchmark\n") == []
    (found,) = violations(None, Path("x.py"), "from benchmarks import engine\n", frozenset({"benchmarks"}))
    assert "run a benchmark" in found
