"""``mpflow filter`` agrees with the service (issue 38, item 2): without ``--method`` it runs the service's measured
default for the family and d (``service/engine/default_methods.json``) with that entry's particle count; every
registered family runs with no options at all (its demonstration d); unknown names are refused naming the known ones."""

from __future__ import annotations

import pytest
from mpflow.operators.models import FAMILIES, make_model
from mpflow.service.engine.default_methods import default_method, model_regime

from mpflow.cli.filter_method import filter_method
from mpflow.cli.main import main


def _table(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs_with_no_options(family, capsys):
    """The family's default d and the service's default method (2 steps: the defaults, not the speed, are tested)."""
    assert main(["filter", "--family", family, "--steps", "2"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "the service's default for " + family in out.splitlines()[0]
    assert [r[0] for r in _table(out)] == ["1", "2"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_method_is_the_services_measured_default_with_its_particles(family):
    cls = FAMILIES[family]
    d = cls.example_state_dim()
    model = make_model(family, cls.example_params(d), d)
    measured = default_method(family, d, cls.linear_gaussian, params=model_regime(model.params))
    chosen = filter_method(None, None, model, None)
    assert chosen.name == measured.method  # (the service falls back to smc only where the default cannot run)
    assert chosen.particles == (measured.num_particles or 256)
    assert f"N = {chosen.particles}" in chosen.note and measured.reason.split(":")[0] in chosen.note
    assert filter_method(None, None, model, 64).particles == 64  # --particles wins


def test_lorenz96_and_range_bearing_defaults_are_their_benchmarked_ones(capsys):
    assert main(["filter", "--family", "range_bearing", "--steps", "1", "--particles", "32"]) == 0
    assert "mpf, options {'correct': True}, N = 32" in capsys.readouterr().out
    assert main(["filter", "--family", "lorenz96", "--dim", "40", "--steps", "1", "--particles", "16"]) == 0
    assert capsys.readouterr().out.startswith("# ukf, N = 16: the service's default for lorenz96, d = 40")


def test_unknown_family_and_method_are_refused_naming_the_known_ones(capsys):
    assert main(["filter", "--family", "nope"]) == 2
    assert "unknown family 'nope'; choose one of ['gmm'" in capsys.readouterr().err
    assert main(["filter", "--method", "nope", "--steps", "1"]) == 2
    assert "unknown method 'nope'; choose one of ['enkf'" in capsys.readouterr().err
