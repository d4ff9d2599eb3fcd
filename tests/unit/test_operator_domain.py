"""A trained operator's domain (ModelFamily.task_domain) and the check of a stream against it, on the settings the
MPF issue names as outside the shipped operators' training: gmm s = 0.5 with prior N(0, 4I); SV φ = 0.98,
σ = 0.15, μ = −1; R scaled by 0.01 and by 100."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.trained_operators import find_operator, operator_domain, outside_domain


def _outside(family: str, d: int, params: dict, prior_var: float = 1.0, prior_mean: float = 0.0) -> list[str]:
    model = make_model(family, params, d)
    record = find_operator(family, d, include_named_only=True)  # shipped, whether auto-selected or named only
    assert record is not None
    return outside_domain(model, operator_domain(record), torch.full((d,), prior_mean), prior_var * torch.eye(d))


@pytest.mark.parametrize(
    ("family", "d", "params"),
    [
        ("gmm", 2, {"s": 1.0}),
        ("stochastic_volatility", 2, {}),
        ("linear_gaussian", 2, {}),
        ("logistic", 10, {}),
        ("lds", 2, {"A": [[0.9, 0], [0, 0.8]], "B": [[1, 0], [0, 1]]}),
        ("lorenz96", 10, {}),
    ],
)
def test_the_training_setting_is_inside(family, d, params) -> None:
    assert _outside(family, d, params) == []


@pytest.mark.parametrize(
    ("family", "d", "params", "prior_var", "expected"),
    [
        ("gmm", 2, {"s": 0.5}, 4.0, ["s 0.5 outside the trained [1, 1]", "prior variance 4 outside"]),
        ("stochastic_volatility", 2, {"mu": -1.0, "phi": 0.98, "sigma": 0.15}, 1.0, ["sigma 0.15", "prior mean - mu"]),
        ("linear_gaussian", 2, {"R": [[0.03, 0], [0, 0.03]]}, 1.0, ["R variance 0.03 outside the trained [3, 3]"]),
        ("linear_gaussian", 2, {"R": [[300, 0], [0, 300]]}, 1.0, ["R variance 300 outside"]),
        ("lds", 2, {"A": [[1.2, 0], [0, 0.8]], "B": [[1, 0], [0, 1]]}, 1.0, ["A singular values 0.8 … 1.2"]),
        # Bocquet 2010's setting: every other variable observed, R = 1.5 (the d = 10 operator saw obs_every 1)
        ("lorenz96", 10, {"obs_every": 2, "R": 1.5}, 1.0, ["obs_every 2 outside the trained [1, 1]"]),
        ("lorenz96", 10, {"arctan": True}, 1.0, ["arctan 1 outside the trained [0, 0]"]),
    ],
)
def test_the_issue_settings_are_outside_and_say_why(family, d, params, prior_var, expected) -> None:
    outside = _outside(family, d, params, prior_var)
    assert len(outside) == len(expected), outside
    for phrase, want in zip(outside, expected, strict=True):
        assert phrase.startswith(want), (phrase, want)


def test_a_recorded_domain_is_used_as_written() -> None:
    record = find_operator("gmm", 2)
    assert operator_domain(record) == FAMILIES["gmm"].task_domain({})  # derived from its task options
    widened = dataclasses.replace(record, config={**record.config, "domain": {"s": [0.25, 4.0]}})
    model = make_model("gmm", {"s": 0.5}, 2)
    assert outside_domain(model, operator_domain(widened), torch.zeros(2), 4 * torch.eye(2)) == []


def test_every_family_describes_its_domain_with_measures_it_computes() -> None:
    for name, cls in FAMILIES.items():
        d = cls.fixed_state_dim or max(2, cls.min_state_dim)
        params = {"A": [[0.9, 0], [0, 0.9]], "B": [[1, 0], [0, 1]]} if name == "lds" else {}
        params = cls.example_params(d) if name == "structural" else params  # its components give d
        model = make_model(name, params, d)
        domain = cls.task_domain({})
        measures = model.domain_measures(torch.zeros(d), torch.eye(d))
        assert set(domain) <= set(measures), (name, set(domain) - set(measures))
        assert all(lo <= hi for lo, hi in domain.values())
    assert ModelFamily.task_domain({"scale_range": (0.1, 10.0)})["prior variance"] == [0.1, 10.0]
