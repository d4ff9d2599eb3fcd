"""The documentation site (mkdocs.yml, ``make docs``) builds with ``mkdocs build --strict``: a broken link or
anchor, a page missing from the nav, or a name the reference pages document that no longer exists fails it. The
generated pages (docs/site_hooks.py) carry what they are generated from: the client's and the plugin hooks'
docstrings, every CLI command's help and every operation of the OpenAPI document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (pip install -e '.[dev]')")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is in the dev extra")

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_every_section_of_the_nav_is_built(site: Path) -> None:
    for page in (
        "index.html",
        "tutorial/getting-started.html",
        "how-to/track-a-target.html",
        "how-to/plugin-family.html",
        "operations.html",
        "API.html",
        "reference/client.html",
        "reference/cli.html",
        "reference/plugin-hooks.html",
        "reference/rest.html",
        "DESIGN.html",
        "methods.html",
        "benchmarks.html",
    ):
        assert (site / page).is_file(), page
    # the repository files the docs link outside docs/ are copied with the site
    assert (site / "repo" / "benchmarks" / "results" / "engine.png").is_file()


def test_client_reference_documents_the_client(site: Path) -> None:
    """Every public method and property of the client's classes is on the page — which it is only with a
    docstring (mkdocstrings leaves out the members without one)."""
    from mpflow.client import http, results, websocket

    html = (site / "reference" / "client.html").read_text()
    for module, names in (
        (http, ("Client", "AsyncClient", "Stream", "AsyncStream")),
        (results, ("Posterior", "StepTable", "History", "Smoothed")),
        (websocket, ("StreamSocket", "AsyncStreamSocket")),
    ):
        for name in names:
            cls = getattr(module, name)
            members = [
                m
                for m, v in vars(cls).items()
                if not m.startswith("_") and (callable(v) or isinstance(v, (property, classmethod, staticmethod)))
            ]
            for member in [None, *members]:
                anchor = ".".join(filter(None, (module.__name__, name, member)))
                assert f'id="{anchor}"' in html, f"{anchor} is not in the client reference (no docstring?)"
    assert ":meth:" not in html and ":class:" not in html  # the docstrings' Sphinx roles shown as code


def test_plugin_hooks_reference_has_the_hooks(site: Path) -> None:
    html = (site / "reference" / "plugin-hooks.html").read_text()
    for hook in ("log_likelihood", "sample_observation", "obs_shape", "observation_cdf", "observation_draws"):
        assert f'id="operators.models.base.ModelFamily.{hook}"' in html, hook


def test_cli_reference_is_the_parsers_help(site: Path) -> None:
    from mpflow.cli.main import COMMANDS

    html = (site / "reference" / "cli.html").read_text()
    for command in COMMANDS:
        assert f"usage: mpflow {command}" in html, command


def test_rest_reference_lists_every_operation(site: Path) -> None:
    spec = json.loads((site / "reference" / "openapi.json").read_text())
    html = (site / "reference" / "rest.html").read_text()
    assert spec["paths"]
    for path, item in spec["paths"].items():
        for method in item:
            assert f"{method.upper()} {path}".replace("{", "").replace("}", "") in html.replace("{", "").replace(
                "}", ""
            ), f"{method} {path}"
