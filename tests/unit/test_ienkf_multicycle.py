"""Issue 35's fourth round (:mod:`mpflow.training.ring_train` ``--window``/``--select paired``): the Gauss–Newton step
with a frozen transform is the IEnKF's step with a stable gradient, the k-cycle loss is the sum of the per-cycle
losses of the same path and its gradient crosses cycles through the IEnKF, and the paired validation gives θ₀ (a
closed gate) a difference of exactly 0."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.mpf.ring_correction import RingCorrection
from mpflow.operators.updaters.ienkf import gauss_newton, gauss_newton_frozen
from mpflow.training import ring_train


def test_the_frozen_transform_step_is_the_gauss_newton_step_with_a_finite_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    Yw = torch.randn(3, 8, 5, generator=g, dtype=torch.float64, requires_grad=True)
    delta = torch.randn(3, 5, 1, generator=g, dtype=torch.float64)
    w = 0.1 * torch.randn(3, 8, 1, generator=g, dtype=torch.float64)
    ref = gauss_newton(Yw.detach(), delta, w)
    got = gauss_newton_frozen(Yw, delta, w)
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    assert not got[1].requires_grad and not got[2].requires_grad  # T, T⁻¹: constants of the step
    (grad,) = torch.autograd.grad(got[0].square().sum(), Yw)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
    assert torch.autograd.gradcheck(lambda y: gauss_newton_frozen(y, delta, w)[0], (Yw,))


def _pool(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    params = [{"F": 8.0, "delta": t, "R": r, "obs_every": 2, "rk4_step": 0.05} for t, r in ((0.05, 1.0), (0.4, 0.5))]
    return ring_train.new_pool(params, 12, 8, g, torch.device("cpu"))


def _net(open_gate: float = 0.5):
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4, gate=6, mean_only=1).double()
    with torch.no_grad():
        net.gate[-1].bias.fill_(open_gate)
    return net


def _args(*extra: str):
    return ring_train.parser().parse_args(["--out", "unused", "--base", "ienkf", "--loss", "log-ratio", *extra])


def test_the_window_loss_is_the_sum_of_the_per_cycle_losses_of_the_same_path() -> None:
    net, base = _net(), ring_train.make_base("ienkf")
    pool = _pool()
    loss, rmse = ring_train.window_step(pool, net, base, torch.Generator().manual_seed(7), _args("--window", "3"))
    replay, gen, expected = _pool(), torch.Generator().manual_seed(7), 0.0
    for _ in range(3):  # the same cycles one at a time, no gradient: the same path (the same noise draws)
        score, r = ring_train.cycle(replay, net, base, gen, grad=False)
        expected += float(ring_train.cycle_loss(score, replay.base_score, torch.ones(2, dtype=torch.bool), "log-ratio"))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert torch.allclose(rmse, r, atol=1e-10) and not pool.members.requires_grad  # detached after the window
    loss.backward()
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads) and sum(float(x.abs().sum()) for x in grads) > 0


def test_the_gradient_of_a_later_cycle_reaches_an_earlier_correction_through_the_ienkf() -> None:
    net, base, gen = _net(), ring_train.make_base("ienkf"), torch.Generator().manual_seed(1)
    pool = _pool()
    ring_train.cycle(pool, net, base, gen, grad=True, through=True)
    first = pool.corrected
    score = None
    for _ in range(2):
        score, _ = ring_train.cycle(pool, net, base, gen, grad=True, through=True)
    (grad,) = torch.autograd.grad(score.sum(), first)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
    # without ``through`` the ensemble is carried detached: no path back to the first cycle
    pool2 = _pool()
    ring_train.cycle(pool2, net, base, gen, grad=True)
    assert not pool2.members.requires_grad


def test_a_window_needs_the_ienkf_base_and_no_forecast_term(tmp_path) -> None:
    for extra in (["--base", "letkf"], ["--forecast-weight", "1"]):
        args = ring_train.parser().parse_args(["--out", str(tmp_path), "--window", "2", "--base", "ienkf", *extra])
        with pytest.raises(ValueError, match="--window"):
            ring_train.train(args)


def _val_pools():
    g = torch.Generator().manual_seed(5)
    return {
        name: ring_train.new_pool([{**p, "rk4_step": 0.05}] * 3, 12, 8, g, torch.device("cpu"))
        for name, p in ring_train.VALIDATION.items()
    }


def test_the_paired_validation_gives_theta0_a_zero_difference_and_a_moved_theta_its_own() -> None:
    pools, base, cycles = _val_pools(), ring_train.make_base("ienkf"), {"spantini2019": 4, "sakov2008": 3}
    closed = _net(open_gate=0.0)
    assert ring_train.closed_gate(closed) and not ring_train.closed_gate(_net())
    reference: dict = {}
    row = ring_train.paired_validate(closed, base, pools, cycles, 11, reference)  # θ₀ run, not skipped
    for name in ring_train.VALIDATION:
        assert row[f"{name}_diff"] == 0.0 and row[f"{name}_diff_se"] == 0.0
        assert row[f"{name}_rmse"] == row[f"{name}_base_rmse"] > 0
    moved = ring_train.paired_validate(_net(open_gate=1.0), base, pools, cycles, 11, reference)
    for name in ring_train.VALIDATION:
        assert moved[f"{name}_base_rmse"] == row[f"{name}_base_rmse"]  # the cached base, the same twins
        assert moved[f"{name}_diff"] == pytest.approx(moved[f"{name}_rmse"] - moved[f"{name}_base_rmse"])
        assert moved[f"{name}_diff"] != 0.0 and math.isfinite(moved[f"{name}_diff_se"])
    skipped = ring_train.paired_validate(None, base, pools, cycles, 11, reference)  # θ₀ known to be the base
    assert skipped["spantini2019_diff"] == 0.0 and skipped["sakov2008_rmse"] == row["sakov2008_rmse"]


def test_a_short_multicycle_run_with_the_paired_selection(tmp_path) -> None:
    args = ring_train.parser().parse_args(
        ["--arch", "correction", "--base", "ienkf", "--out", str(tmp_path), "--dim", "12", "--particles", "8",
         "--batch", "3", "--hidden", "8", "--layers", "3", "--embed", "4", "--gate", "4", "--mean-only",
         "--iterations", "3", "--val-every", "3", "--val-twins", "2", "--val-cycles", "3", "--val-sakov-twins", "2",
         "--val-sakov-cycles", "2", "--warm-up", "2", "--device", "cpu", "--loss", "log-ratio", "--window", "3",
         "--select", "paired", "--lr", "0.05"]
    )  # fmt: skip
    out = ring_train.train(args)
    first, last = out["history"]
    assert first["spantini2019_diff"] == 0.0 and first["sakov2008_diff"] == 0.0  # θ₀: the base
    assert last["iteration"] == 3 and last["spantini2019_base_rmse"] == first["spantini2019_base_rmse"]
    assert out["best"] <= 0.0  # the kept θ: θ₀ (0) or one better than the base on spantini2019
    assert (tmp_path / "ring_curve.png").stat().st_size > 0 and (tmp_path / "ring_final.pt").exists()


def test_a_twin_that_overflows_is_carried_not_raised() -> None:
    net, base = _net(), ring_train.make_base("ienkf")
    for scale in (1e20, 1e150, 1e200):  # S not positive definite; the anomalies overflow; the forecast overflows
        pool = _pool()
        noise = torch.randn(8, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        pool.members[0] = pool.members[0].mean(0) + scale * noise
        score, rmse = ring_train.cycle(pool, net, base, torch.Generator().manual_seed(0), grad=False)
        assert torch.isfinite(pool.members).all() and not float(rmse[0]) <= ring_train.LOST_RMSE  # counted lost
        assert math.isfinite(float(score[1]))  # the other twin goes on
