"""The values of every tensor a method keeps, checked on a snapshot's import
(:mod:`mpflow.service.streams.snapshot_tensors`): every method's genuine state passes at every step of its smoothing
window's filling, and each forged tensor — a window's log-weights, its particles, its indices, its idle rows, its
covariances; ``smc2``'s θ-cloud; an extra beyond float32 — is refused naming its field."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.service.errors import ApiError
from mpflow.service.streams import snapshot_tensors as tensors

GAUSSIAN = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}, 2)
LDS = {"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.0]], "R": [[0.5]]}
#: family → (params, one observation): a linear-Gaussian one, a dynamic one observed in part, one that factorises
#: per dimension (``smc``'s and ``mpf``'s carried per-dimension clouds), and one whose R is learned (``smc2``)
FAMILIES = {
    "linear_gaussian": ({}, [0.3, -0.2]),
    "lds": (LDS, [0.3]),
    "stochastic_volatility": ({}, [0.3, -0.2]),
    "lds learning R": ({**LDS, "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}}, [0.3]),
}
LAG, N = 3, 16


def stream(method: str, family: str, steps: int, **options):
    """(model, updater, state after ``steps`` steps — observed, then unobserved, in turn — with a window of LAG)."""
    params, obs = FAMILIES[family]
    model = make_model(family.split()[0], params, 2)
    updater = get_updater(method, **options)
    updater.check_compatible(model, GAUSSIAN)
    state = updater.init(GAUSSIAN, model, N, 1, smoothing_lag=LAG if updater.smoothing else 0)
    for i in range(steps):
        y = torch.tensor([obs]) if i % 2 == 0 else model.missing_observation()[None]
        state, _ = updater.update(state, y, model)
    return model, updater, state


def refusal(model, updater, state: ParticleState) -> str:
    with pytest.raises(ApiError) as refused:
        tensors.check_tensors(updater, model, state)
    assert refused.value.status == 422
    return refused.value.message


def with_extra(state: ParticleState, name: str, edit) -> ParticleState:
    return state.replace(extras={**state.extras, name: edit(state.extras[name].clone())})


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", sorted(UPDATERS))
def test_every_genuine_state_passes_as_its_window_fills(method, family):
    try:
        model, updater, state = stream(method, family, 0)
    except ValueError:
        pytest.skip(f"{method} does not run {family}")
    for _ in range(LAG + 2):  # an empty window, part-filled, full, moved on
        tensors.check_tensors(updater, model, state)
        state, _ = updater.update(state, model.missing_observation()[None], model)


def test_a_particle_window_is_checked_row_by_row():
    model, updater, state = stream("smc", "lds", 2)  # two of three rows taken
    taken = torch.tensor([1, 2])  # the rows of steps taken (row 0 is idle)

    def half(t):  # half of each taken row's particles moved to 3e38: a covariance of ~1e76
        return t.index_copy_(1, taken, t[:, taken].index_fill_(2, torch.arange(0, N, 2), 3e38))

    def upper(t):  # a factor with an entry above its diagonal in each taken row
        return t.index_add_(1, taken, torch.ones_like(t[:, taken]).triu(1))

    forged = {
        "lag.log_weights": (lambda t: t + 1.0, "extras.lag.log_weights: the weights of each cloud must sum to 1"),
        "lag.particles": (half, "extras.lag.particles: each cloud's weighted mean and covariance"),
        "lag.ancestors": (lambda t: t + N, "extras.lag.ancestors: values from 0 to 15"),
        "lag.noise_factor": (upper, "extras.lag.noise_factor: must be lower-triangular"),
    }
    for name, (edit, message) in forged.items():
        assert refusal(model, updater, with_extra(state, name, edit)).startswith(f"snapshot: state.{message}"), name
    idle = with_extra(state, "lag.mapped", lambda t: t.index_fill_(1, torch.tensor([0]), 1.0))
    assert "extras.lag.mapped: must be zero in the rows of steps not yet taken" in refusal(model, updater, idle)
    # the newest row is the state's own cloud: another normalised cloud there is refused
    shifted = with_extra(state, "lag.log_weights", lambda t: t.index_copy_(1, torch.tensor([2]), t[:, 1:2].flip(-1)))
    assert "extras.lag.log_weights: must be its newest row the state's" in refusal(model, updater, shifted)


def test_an_rts_window_keeps_covariances():
    model, updater, state = stream("enkf", "lds", 4)
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    forged = with_extra(state, "lag.pred_cov", lambda t: t @ swap)  # symmetric? no: [[b, a], [d, c]]
    assert "state.extras.lag.pred_cov: covariances must be symmetric positive semi-definite" in refusal(
        model, updater, forged
    )
    indefinite = with_extra(state, "lag.cov", lambda t: t - 10.0 * torch.eye(2, dtype=torch.float64))
    assert "state.extras.lag.cov: covariances" in refusal(model, updater, indefinite)
    huge = with_extra(state, "lag.mean", lambda t: t + 1e39)  # float64: beyond float32, as no request could give
    assert "state.extras.lag.mean: beyond ±3.403e+38" in refusal(model, updater, huge)


def test_the_parameter_cloud_of_a_learning_stream_is_checked():
    model, updater, state = stream("smc2", "lds learning R", 2)
    forged = {
        "param_log_weights": (lambda t: t - 1.0, "extras.param_log_weights: the weights of each cloud must sum to 1"),
        "param.R": (lambda t: -t, "extras.param.R: values from 0 to inf"),
        "param_support.R": (lambda t: t * 0.0, "extras.param_support.R: must be the support of the model's prior"),
        "theta_cov": (lambda t: -t, "extras.theta_cov: covariances must be symmetric positive semi-definite"),
    }
    for name, (edit, message) in forged.items():
        assert refusal(model, updater, with_extra(state, name, edit)).startswith(f"snapshot: state.{message}"), name
    spread = with_extra(state, "param.R", lambda t: t.index_fill_(1, torch.tensor([0]), 3e38))
    assert refusal(model, updater, spread).startswith("snapshot: state.extras.param.{R}: each cloud's weighted")


def test_a_carried_per_dimension_cloud_is_checked():
    model, updater, state = stream("smc", "stochastic_volatility", 2)
    forged = with_extra(state, "marginal.log_weights", lambda t: t + 0.5)
    assert refusal(model, updater, forged).startswith("snapshot: state.extras.marginal.log_weights: the weights")
