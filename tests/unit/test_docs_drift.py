"""docs/API.md's settings and the README's families and methods agree with the code (:mod:`tests.harness.docs_drift`),
and the checkers catch a deliberate mismatch (each fed an altered copy of the real text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpflow.operators.models import FAMILIES
from mpflow.operators.models.plugins import CATALOGUE_ORDER as BUILTIN
from mpflow.operators.updaters import UPDATERS
from mpflow.service.settings import Settings

from mpflow.cli.serve import SERVE_SETTINGS
from tests.harness.docs_drift import documented_settings, methods_md_drift, readme_drift, settings_drift

ROOT = Path(__file__).resolve().parents[2]
API = (ROOT / "docs" / "API.md").read_text()
README = (ROOT / "README.md").read_text()
METHODS_MD = (ROOT / "docs" / "methods.md").read_text()
PARAMETERS = {name: cls.spec.names for name, cls in FAMILIES.items() if name in BUILTIN}
DEFAULTS = {name: field.default for name, field in Settings.model_fields.items()}


def test_api_md_documents_every_setting_with_its_default():
    assert settings_drift(API, DEFAULTS, SERVE_SETTINGS) == []


def test_the_readme_lists_every_family_and_method():
    assert readme_drift(README, set(BUILTIN), set(UPDATERS)) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("| `MPFLOW_MAX_PARTICLES` | 65536 |", "| `MPFLOW_MAX_PARTICLES` | 4096 |", "MPFLOW_MAX_PARTICLES: documented"),
        ("`MPFLOW_HISTORY_STEPS` (500", "`MPFLOW_HISTORY_STEPS` (50", "MPFLOW_HISTORY_STEPS: documented default '50'"),
        ("`MPFLOW_BATCHING` (true)", "`MPFLOW_BATCHING` (false)", "MPFLOW_BATCHING: documented default 'false'"),
        ("`MPFLOW_WORKERS` (one per CPU", "`MPFLOW_WORKERS` (1, one per CPU", "MPFLOW_WORKERS: documented default '1,"),
        ("`MPFLOW_DATA_DIR`", "`MPFLOW_DATA_FOLDER`", "MPFLOW_DATA_DIR (default './data') is not documented"),
    ],
)
def test_a_mutated_settings_table_is_caught(old, new, problem):
    assert old in API, old
    problems = settings_drift(API.replace(old, new, 1), DEFAULTS, SERVE_SETTINGS)
    assert any(p.startswith(problem) for p in problems), problems


def test_a_mutated_readme_is_caught():
    row = next(line for line in README.splitlines() if line.startswith("| `lorenz96` |"))
    assert readme_drift(README.replace(row + "\n", ""), set(BUILTIN), set(UPDATERS)) == [
        "family lorenz96 is not in the README's table"
    ]
    assert readme_drift(README.replace('"kalman" | ', ""), set(BUILTIN), set(UPDATERS)) == [
        "method kalman is not in the README's method list"
    ]
    assert "the README's method list names magic, which is no method" in readme_drift(
        README.replace('"gpf"', '"magic" | "gpf"'), set(BUILTIN), set(UPDATERS)
    )


def test_every_documented_setting_has_a_default():
    assert set(documented_settings(API)) >= {f"MPFLOW_{n.upper()}" for n in DEFAULTS}


def test_methods_md_names_every_parameter_of_every_family():
    assert methods_md_drift(METHODS_MD, PARAMETERS) == []
    lds = next(line for line in METHODS_MD.splitlines() if line.startswith("| `lds` |"))
    assert methods_md_drift(METHODS_MD.replace(lds, lds.replace("Qc (I)", "")), PARAMETERS) == [
        "docs/methods.md's lds row does not name its parameter Qc"
    ]
