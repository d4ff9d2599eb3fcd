"""``kalman``'s outlier clipping (option ``outlier_clip``; operators/updaters/kalman.py, "Outlier clipping"): off by
default (the exact update, bit for bit); a reading within c sd is conditioned on exactly; a reading d sd out moves
the belief as the exact update under the noise R + (d²/c² − 1) S (closed form in 1-D), its evidence staying the
model's; bad values are refused naming the option."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import get_updater

MODEL = {"A": [[1.0]], "Q": [[0.5]], "B": [[1.0]], "R": [[1.0]]}


def run(options: dict, readings: list[float]):
    model = make_model("lds", MODEL, 1, torch.float64)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0], "cov": [[2.0]]}, 1)
    updater = get_updater("kalman", **options)
    state = updater.init(prior, model, 8, seed=0)
    out = []
    for r in readings:
        state, info = updater.update(state, torch.tensor([[r]], dtype=torch.float64), model)
        out.append(
            (
                float(state.extras["mean"][0, 0]),
                float(state.extras["cov"][0, 0, 0]),
                float(info.log_evidence_increment[0]),
            )
        )
    return out


def test_off_by_default_and_exact_within_the_clip():
    readings = [0.3, -1.2, 2.0, 0.1]  # every reading within 3 sd of its predictive
    assert run({}, readings) == run({"outlier_clip": None}, readings)
    flat = [v for step in run({"outlier_clip": 3.0}, readings) for v in step]
    assert flat == pytest.approx([v for step in run({}, readings) for v in step], rel=1e-12)


def test_a_spike_moves_the_belief_as_the_inflated_noise_says_and_keeps_the_models_evidence():
    c, spike = 3.0, 30.0
    exact, clipped = run({}, [spike])[0], run({"outlier_clip": c}, [spike])[0]
    P_pred, R = 2.0 + 0.5, 1.0  # the prior's variance after one predict, and the noise
    S = P_pred + R
    d2 = spike**2 / S
    S_eff = d2 / c**2 * S
    gain = P_pred / S_eff
    assert clipped[0] == pytest.approx(gain * spike, rel=1e-9)  # the clipped correction
    assert clipped[1] == pytest.approx(P_pred * (1 - gain), rel=1e-9)  # the update under R_eff
    assert clipped[0] < 0.1 * exact[0]  # the spike no longer drags the state
    assert clipped[2] == pytest.approx(exact[2], rel=1e-12)  # the evidence is the model's
    assert exact[2] == pytest.approx(-0.5 * (math.log(2 * math.pi * S) + d2), rel=1e-9)


@pytest.mark.parametrize("bad", [0.5, 101, "3", True, -1])
def test_bad_clip_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="outlier_clip"):
        get_updater("kalman", outlier_clip=bad)
