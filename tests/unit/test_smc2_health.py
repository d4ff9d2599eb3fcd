"""How much of an ``smc2`` stream's θ-cloud is left (:func:`mpflow.operators.updaters.smc2.cloud_health`, docs/API.md
"Unknown parameters"): a fresh cloud is healthy, a collapsed one — every θ equal, resampling's copies moved by less
than the resolution, or one weight holding everything — says ``params_degenerate``; the summary carries the θ-ESS
and distinct count beside ``params``; a step reports its θ-ESS before rejuvenation for the metrics; and an answer
gives the parameters once, in its summary, unless the request asks for them per step."""

from __future__ import annotations

import math

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.smc2 import MIN_DISTINCT, cloud_health
from mpflow.service.engine.summary import PARAM_FIELDS, step_summary, summary
from mpflow.service.streams.documents import observation_document

LOGNORMAL = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}
M = 256


def fresh():
    model = make_model("lds", {"A": [[1.0]], "B": [[1.0]], "Q": [[1.0]], "R": LOGNORMAL}, 1)
    updater = get_updater("smc2")
    return updater, model, updater.init(GaussianMixture.gaussian(torch.zeros(1, 1), torch.eye(1)[None]), model, M, 0)


def with_theta(state, R: torch.Tensor, log_weights: torch.Tensor | None = None):
    extras = {**state.extras, "param.R": R.to(torch.float64)[None]}
    if log_weights is not None:
        extras["param_log_weights"] = torch.log_softmax(log_weights.to(torch.float64), -1)[None]
    return state.replace(extras=extras)


def test_a_fresh_cloud_is_healthy_and_a_collapsed_one_degenerate():
    _, _, state = fresh()
    health = cloud_health(state.extras)
    assert math.isclose(float(health.ess[0]), M) and int(health.distinct[0]) == M and not bool(health.degenerate[0])
    # every θ equal: one distinct value
    same = with_theta(state, torch.full((M,), 0.7))
    health = cloud_health(same.extras)
    assert int(health.distinct[0]) == 1 and bool(health.degenerate[0])
    # resampling's copies of 3 values, jittered by a collapsed cloud's scale (1e-9 of θ): 3 distinct
    copies = torch.tensor([0.5, 0.7, 2.0]).repeat(M // 3 + 1)[:M] * (1 + 1e-9 * torch.randn(M, dtype=torch.float64))
    health = cloud_health(with_theta(state, copies).extras)
    assert int(health.distinct[0]) == 3 and bool(health.degenerate[0])
    # distinct values, but all within 0.01 % of each other: its sd is below the threshold
    narrow = 0.7 * (1 + 1e-4 * torch.linspace(-1, 1, M, dtype=torch.float64))
    health = cloud_health(with_theta(state, narrow).extras)
    assert int(health.distinct[0]) > MIN_DISTINCT and bool(health.degenerate[0])
    # distinct, spread, but one weight holds nearly everything: ESS ≈ 1
    lw = torch.zeros(M)
    lw[0] = 50.0
    health = cloud_health(with_theta(state, state.extras["param.R"][0], lw).extras)
    assert float(health.ess[0]) < 1.01 and bool(health.degenerate[0])


def test_the_summary_and_the_step_carry_the_clouds_health():
    updater, model, state = fresh()
    doc = summary(state)
    always = [k for k in PARAM_FIELDS if k != "params_rejuvenation"]  # that one with the mh kernel only
    assert set(always) <= set(doc) and doc["params_distinct"] == M and doc["params_degenerate"] is False
    assert "params_rejuvenation" not in doc
    new, info = updater.update(state, torch.tensor([[1.0]]), model)
    fraction = float(info.extras["theta_ess_fraction"][0])
    assert 0 < fraction <= 1
    entry = step_summary(new, info)
    assert {k: entry[k] for k in always} == {k: summary(new)[k] for k in always}
    collapsed = summary(with_theta(new, torch.full((M,), 0.7)))
    assert collapsed["params_distinct"] == 1 and collapsed["params_degenerate"] is True


def test_an_answer_gives_the_parameters_once_unless_asked_per_step():
    updater, model, state = fresh()
    per_step = []
    for y in (1.0, 1.0, 3.0):
        state, info = updater.update(state, torch.tensor([[y]]), model)
        per_step.append(step_summary(state, info))
    meta = {
        "model": {"family": "lds", "params": {}},
        "method": "smc2",
        "num_particles": M,
        "state_dim": 1,
        "seed": 0,
        "ttl_seconds": 0,
        "step": 3,
        "created_at": "",
        "updated_at": "",
    }
    last = summary(state)
    doc = observation_document("s", meta, last, per_step, None, duplicate=False)
    assert all(not set(PARAM_FIELDS) & set(e) for e in doc["per_step"])
    assert doc["summary"]["params"] == per_step[-1]["params"]
    assert all("params" in e for e in per_step)  # the entries themselves (the history's) are left as they were
    asked = observation_document("s", meta, last, per_step, None, duplicate=False, per_step_params=True)
    assert asked["per_step"] == per_step
