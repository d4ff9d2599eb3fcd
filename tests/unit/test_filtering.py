"""The one filtering loop (operators/filtering.py) and its command-line face, ``mpflow filter``.

``run_filter`` with the ``kalman`` updater on a linear-Gaussian model is checked against the float64 Kalman
filter it scores against: the log-evidence increments agree to rounding (the same recursion), and it is scored on
its own exact moments (not on the N particles drawn from them), so the mean error and the variance ratio's
distance from 1 are rounding. A failure inside the loop ends the run with the steps before it kept; ``FilterRun``
stepped by hand is ``run_filter``.
"""

from __future__ import annotations

import pytest
import torch
from mpflow.operators.filtering import ExactPosterior, FilterRun, run_filter
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.rng import generator
from mpflow.operators.updaters import get_updater

from mpflow.cli.main import main

N, T = 256, 6


def problem(family: str = "lds", B: int = 2, d: int = 2):
    params = {"A": (0.9 * torch.eye(d)).tolist(), "B": torch.eye(d).tolist()} if family == "lds" else {}
    one = make_model(family, params, d)
    model = type(one).stack([one] * B)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    prior = type(prior).stack([prior] * B)
    _, obs = model.simulate(T, torch.ones(B, d), [generator(10 + b) for b in range(B)])
    return model, prior, obs


def test_kalman_scores_against_the_exact_posterior():
    model, prior, obs = problem()
    mean0, cov0 = prior.moments()
    exact = ExactPosterior.kalman(mean0, cov0, model, obs)
    run = run_filter(get_updater("kalman"), model, prior, obs, N, [1, 2], exact)
    assert run.error is None and run.steps == T and len(run.ms) == T and all(ms > 0 for ms in run.ms)
    assert set(run.values) == {"mean_error_sd", "var_ratio", "var_ratio_per_dim", "logz_increment_error"}
    assert run.values["mean_error_sd"].shape == (T, 2) and run.values["var_ratio_per_dim"].shape == (T, 2, 2)
    assert run.means.shape == (T, 2, 2) and run.covs.shape == (T, 2, 2, 2) and run.ess.shape == (T, 2)
    assert float(run.values["logz_increment_error"].max()) < 1e-8
    assert float(run.log_evidence_error.abs().max()) < 1e-8
    torch.testing.assert_close(run.log_evidence, exact.log_z.sum(-1))
    assert float(run.values["mean_error_sd"].max()) < 1e-6  # its exact moments (drawn particles: ~ 1/√N)
    assert float((run.values["var_ratio"] - 1).abs().max()) < 1e-6
    # the scores are the module docstring's formulas of the recorded moments
    sd = torch.diagonal(exact.covs, dim1=-2, dim2=-1).sqrt().transpose(0, 1)  # [T, B, d]
    z = (run.means - exact.means.transpose(0, 1)) / sd
    torch.testing.assert_close(run.values["mean_error_sd"], (z**2).mean(-1).sqrt())


def test_on_step_values_states_and_stepping_by_hand():
    model, prior, obs = problem("gmm", B=1)
    seen = []

    def on_step(step):
        seen.append(step.t)
        return {"first_particle": step.state.particles[:, 0]}

    run = run_filter(get_updater("smc"), model, prior, obs, 64, 5, on_step=on_step, keep_states=True)
    assert seen == list(range(1, T + 1)) and run.log_evidence_error is None
    assert run.values["first_particle"].shape == (T, 1, 2) and len(run.states) == T
    torch.testing.assert_close(run.values["first_particle"][-1], run.state.particles[:, 0])

    by_hand = FilterRun(get_updater("smc"), model, prior, obs, 64, 5)
    assert by_hand.start().particles.shape == (1, 64, 2) and not by_hand.done
    while not by_hand.done:
        by_hand.step()
    assert torch.equal(by_hand.result().means, run.means)
    assert torch.equal(by_hand.state.log_evidence, run.log_evidence)


def test_a_caught_failure_keeps_the_steps_before_it():
    model, prior, obs = problem("linear_gaussian", B=1)

    def fail_at_three(step):
        if step.t == 3:
            raise ValueError("boom")

    run = run_filter(get_updater("gpf"), model, prior, obs, 32, 0, on_step=fail_at_three, catch=(ValueError,))
    assert run.error == "ValueError at step 3: boom" and run.steps == 2 and run.means.shape[0] == 2
    with pytest.raises(ValueError, match="boom"):
        run_filter(get_updater("gpf"), model, prior, obs, 32, 0, on_step=fail_at_three)
    with pytest.raises(ValueError, match="method: kalman"):
        run_filter(get_updater("kalman"), *problem("gmm", B=1), 32)
    failed = run_filter(get_updater("kalman"), *problem("gmm", B=1), 32, catch=(ValueError,))
    assert failed.error.startswith("ValueError at step 1: method: kalman") and failed.steps == 0


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]


def test_cli_filter_prints_the_error_against_kalman(capsys):
    assert main(["filter", "--family", "lds", "--method", "kalman", "--steps", "5", "--particles", "16"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "# kalman"
    assert out.splitlines()[1].split() == ["step", "ms", "log", "Z", "mean", "err", "(sd)", "var", "ratio"]
    table = rows(out)
    assert [r[0] for r in table] == ["1", "2", "3", "4", "5"] and all(len(r) == 5 for r in table)
    assert all(float(r[3]) == 0 and float(r[4]) == 1 for r in table)  # scored on its exact moments, not its draws
    last = out.splitlines()[-1]
    assert last.startswith("log-evidence error vs Kalman: ") and abs(float(last.split()[-2])) < 1e-3


def test_cli_filter_of_a_nonlinear_family_and_a_method_that_cannot_run_it(capsys):
    assert main(["filter", "--family", "gmm", "--method", "smc", "--steps", "3", "--particles", "64"]) == 0
    out = capsys.readouterr().out
    assert [len(r) for r in rows(out)] == [3, 3, 3] and "Kalman" not in out  # no exact reference for gmm
    assert main(["filter", "--family", "gmm", "--method", "kalman", "--steps", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: method: kalman")
