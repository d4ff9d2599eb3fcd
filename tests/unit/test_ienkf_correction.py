"""The learned correction after ``ienkf`` (``method_options.correction``): ρ follows Δ by the one rule that training and
serving read, ``ring_train --base ienkf`` trains on the IEnKF's analysis and restarts lost twins, the exported
operator is resolved by name (never by path) and priced in ``step_work``, an untrained one is the IEnKF with that ρ
exactly, and ``mpf`` never picks a correction as its operator."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import registry
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.ring_correction import RingCorrection
from mpflow.operators.trained_operators import find_operator
from mpflow.operators.updaters import get_updater
from mpflow.operators.updaters.ienkf import IEnKFUpdater, lorenz96_inflation
from mpflow.training import ring_export, ring_train

from tests.harness.learned_options import refuses_what_it_cannot_serve

NAME = "lorenz96-d12-v7"


def test_the_inflation_rule_goes_through_the_measured_points_and_is_clipped() -> None:
    rho = lorenz96_inflation(torch.tensor([0.01, 0.05, 0.4, 2.0]))
    assert torch.allclose(rho, torch.tensor([1.02, 1.02, 1.2, 1.2], dtype=torch.float64))
    mid = float(lorenz96_inflation(0.05 * 8**0.5))  # the geometric middle of 0.05 and 0.4
    assert mid == pytest.approx(1.11)


def _short_run(tmp_path, iterations: int = 4):
    args = ring_train.parser().parse_args(
        ["--arch", "correction", "--base", "ienkf", "--out", str(tmp_path), "--dim", "12", "--particles", "8",
         "--batch", "3", "--hidden", "8", "--layers", "3", "--iterations", str(iterations),
         "--val-every", "2", "--val-twins", "2", "--val-cycles", "2", "--warm-up", "2", "--device", "cpu"]
    )  # fmt: skip
    return ring_train.train(args)


def test_base_ienkf_trains_and_records_its_base(tmp_path) -> None:
    out = _short_run(tmp_path)
    assert out["iterations"] == 4 and len(out["history"]) == 3
    payload = torch.load(tmp_path / "ring.pt", weights_only=True)
    assert payload["base"]["method"] == "ienkf" and payload["base"]["iterations"] == 4
    assert (tmp_path / "ring_curve.png").stat().st_size > 0


def test_the_base_analysis_is_the_ienkf_with_the_rule_s_inflation() -> None:
    g = torch.Generator().manual_seed(0)
    params = [{"F": 8.0, "delta": t, "R": 0.5, "obs_every": 2, "rk4_step": 0.05} for t in (0.05, 0.4)]
    pool = ring_train.new_pool(params, 12, 8, g, torch.device("cpu"))
    obs = pool.model.observed_mean(pool.truth[:, None])[:, 0]
    forecast, xa = ring_train.base_analysis(ring_train.make_base("ienkf"), pool.members, obs, pool.model)
    for b, rho in enumerate((1.02, 1.2)):
        one = type(pool.model)({k: v[b : b + 1] for k, v in pool.model.params.items()}, 12)
        ref = IEnKFUpdater(inflation=rho, iterations=4).iterate(pool.members[b : b + 1], obs[b : b + 1], one)[0]
        assert torch.allclose(xa[b : b + 1], ref, atol=1e-9)
    mean = pool.members.mean(1, keepdim=True)
    inflated = mean + torch.tensor([1.02, 1.2], dtype=torch.float64)[:, None, None] * (pool.members - mean)
    assert torch.allclose(forecast, pool.model.transition_mean(inflated))


def test_lost_twins_restart_under_the_ienkf_base() -> None:
    g = torch.Generator().manual_seed(1)
    params = ring_train.regime_params(g, 4, 2)
    pool = ring_train.new_pool(params, 12, 8, g, torch.device("cpu"))
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4)
    ring_train.cycle(pool, net, ring_train.make_base("ienkf"), g, grad=False)
    pool.members[1] += 50.0  # twin 1 lost the truth
    rmse = (pool.members.mean(1) - pool.truth).square().mean(-1).sqrt()
    old = pool.truth.clone()
    assert ring_train.restart_lost(pool, rmse, 2, 8, g) == 1
    assert not torch.equal(pool.truth[1], old[1]) and torch.equal(pool.truth[0], old[0]) and pool.age[1] == 0
    score, rmse = ring_train.cycle(pool, net, ring_train.make_base("ienkf"), g, grad=False)
    assert torch.isfinite(score).all() and float(rmse[1]) < ring_train.LOST_RMSE


def _export(tmp_path, monkeypatch, trained: bool) -> str:
    run = tmp_path / "run"
    _short_run(run, iterations=0)  # the initial network: zero output layers
    payload = torch.load(run / "ring.pt", weights_only=True)
    if trained:  # weights that move the analysis
        payload["state"] = {k: v + 0.2 * torch.randn_like(v) for k, v in payload["state"].items()}
        torch.save(payload, run / "ring.pt")
    ops = tmp_path / "ops"
    ring_export.export(run / "ring.pt", ops, NAME, "# test\n\nthe command\n", {"test": 1})
    monkeypatch.setenv(registry.ENV_DIRS, str(ops))
    return NAME


def _filter(updater, delta: float = 0.4, steps: int = 3):
    model = make_model("lorenz96", {"delta": delta, "obs_every": 2, "R": 0.5}, 12)
    prior = GaussianMixture.gaussian(8 + torch.zeros(1, 12), torch.eye(12)[None])
    state = updater.init(prior, model, 8, seed=[0])
    for m in range(steps):
        state, info = updater.update(state, torch.full((1, 6), 8.0 + 0.1 * m), model)
    return state, info, model


def test_an_untrained_served_correction_is_the_ienkf_with_the_rule(tmp_path, monkeypatch) -> None:
    name = _export(tmp_path, monkeypatch, trained=False)
    for delta, rho in ((0.4, 1.2), (0.05, 1.02)):
        # one step: float32 rounding (the network's dtype) grows by the chaos over a few more
        corrected, info, _ = _filter(get_updater("ienkf", iterations=4, correction=name), delta, steps=1)
        base, _, _ = _filter(get_updater("ienkf", iterations=4, inflation=rho), delta, steps=1)
        assert torch.allclose(corrected.particles, base.particles, atol=1e-5)
        assert info.iterations is not None


def test_a_trained_served_correction_moves_the_analysis_and_is_priced(tmp_path, monkeypatch) -> None:
    name = _export(tmp_path, monkeypatch, trained=True)
    u = get_updater("ienkf", iterations=4, correction=name)
    corrected, _, model = _filter(u)
    base, _, _ = _filter(get_updater("ienkf", iterations=4, inflation=1.2))
    assert torch.isfinite(corrected.particles).all()
    assert not torch.allclose(corrected.particles, base.particles, atol=1e-3)
    plain = get_updater("ienkf", iterations=4).step_work(model, 40).flops
    assert u.step_work(model, 40).flops > plain
    assert find_operator("lorenz96", 12) is None and find_operator("lorenz96", 12, include_named_only=True) is None


def test_a_correction_is_named_never_a_path_and_only_for_lorenz96(tmp_path, monkeypatch) -> None:
    name = _export(tmp_path, monkeypatch, trained=False)
    # the last: an MPF operator, not a correction
    refuses_what_it_cannot_serve(
        "correction", name, [str(tmp_path / "ops" / name), "../ops", "lorenz96-d12-v99", "lds-d2-v1"]
    )


def test_a_twin_whose_ienkf_blows_up_is_carried_and_restarted_alone() -> None:
    g = torch.Generator().manual_seed(2)
    pool = ring_train.new_pool(ring_train.regime_params(g, 3, 2), 12, 8, g, torch.device("cpu"))
    pool.members[2] = 1e30 * torch.randn(8, 12, generator=g, dtype=torch.float64)  # its forecast overflows
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4)
    score, rmse = ring_train.cycle(pool, net, ring_train.make_base("ienkf"), g, grad=True)
    assert torch.isfinite(rmse[:2]).all() and rmse[2] == float("inf") and not bool(pool.held[2])
    assert torch.isfinite(score[:2]).all()
    old = pool.truth.clone()
    assert ring_train.restart_lost(pool, rmse, 2, 8, g) == 1 and not torch.equal(pool.truth[2], old[2])
    score, rmse = ring_train.cycle(pool, net, ring_train.make_base("ienkf"), g, grad=False)
    assert torch.isfinite(rmse).all()
