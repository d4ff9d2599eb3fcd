"""The learned flow after the LETKF on the Lorenz-96 ring (:mod:`mpflow.operators.mpf.ring`): untrained it is the
LETKF exactly, it is equivariant under permuting the members and under rotating the ring (circular convolutions), and
a short energy-score training run (:mod:`mpflow.training.ring_train`) writes a flow that loads back."""

from __future__ import annotations

import torch
from mpflow.operators.models import make_model
from mpflow.operators.mpf.ring import RingFlow, RingLETKF
from mpflow.operators.updaters.enkf import EnKFUpdater
from mpflow.training import ring_train


def _step(d: int = 12, N: int = 8, B: int = 2, every: int = 2):
    g = torch.Generator().manual_seed(0)
    model = make_model("lorenz96", {"delta": 0.2, "obs_every": every, "R": 0.5}, d)
    truth = 8 + torch.randn(B, d, generator=g, dtype=torch.float64)
    forecast = truth[:, None] + torch.randn(B, N, d, generator=g, dtype=torch.float64)
    obs = truth[:, ::every] + 0.3 * torch.randn(B, d // every, generator=g, dtype=torch.float64)
    analysis, _ = EnKFUpdater(localisation=2.0).analysis(forecast, obs, model.to(torch.float64), None)
    return model, forecast.float(), analysis.float(), obs.float()


def _trained_looking(seed: int = 1) -> RingFlow:
    torch.manual_seed(seed)
    flow = RingFlow(hidden=8, layers=3, kernel=3)
    with torch.no_grad():
        flow.last.weight.normal_(0, 0.3)
    return flow


def test_an_untrained_flow_is_the_letkf() -> None:
    model, forecast, analysis, obs = _step()
    assert torch.equal(RingFlow(hidden=8, layers=3)(forecast, analysis, obs, model), analysis)


def test_the_flow_is_equivariant_under_member_permutation_and_ring_rotation() -> None:
    model, forecast, analysis, obs = _step()
    flow = _trained_looking()
    out = flow(forecast, analysis, obs, model)
    assert not torch.allclose(out, analysis)
    perm = torch.randperm(forecast.shape[1], generator=torch.Generator().manual_seed(2))
    assert torch.allclose(flow(forecast[:, perm], analysis[:, perm], obs, model), out[:, perm], atol=1e-5)
    # rotating the ring by the observation stride keeps the observed sites: the output rotates with it
    rolled = flow(forecast.roll(2, -1), analysis.roll(2, -1), obs.roll(1, -1), model)
    assert torch.allclose(rolled, out.roll(2, -1), atol=1e-5)


def test_ring_letkf_runs_a_twin_and_refuses_without_localisation() -> None:
    model = make_model("lorenz96", {"delta": 0.2, "obs_every": 2}, 12)
    u = RingLETKF(_trained_looking(), localisation=2.0, inflation=1.05)
    u.check_compatible(model)
    from mpflow.operators.models.priors import GaussianMixture

    prior = GaussianMixture.gaussian(8 + torch.zeros(1, 12), torch.eye(12)[None])
    state = u.init(prior, model, 8, seed=[0])
    state, info = u.update(state, torch.full((1, 6), 8.5), model)
    assert state.particles.shape == (1, 8, 12) and torch.isfinite(state.particles).all()
    try:
        RingLETKF(_trained_looking())
    except ValueError as exc:
        assert "localisation" in str(exc)
    else:
        raise AssertionError("the ring flow without the LETKF's localisation was accepted")


def test_a_short_training_run_writes_a_flow_that_loads(tmp_path) -> None:
    args = ring_train.parser().parse_args(
        ["--out", str(tmp_path), "--dim", "12", "--particles", "8", "--batch", "3", "--hidden", "8", "--layers", "3",
         "--iterations", "6", "--val-every", "3", "--val-twins", "2", "--val-cycles", "2", "--warm-up", "2",
         "--device", "cpu"]
    )  # fmt: skip
    out = ring_train.train(args)
    assert out["iterations"] == 6 and len(out["history"]) == 3
    flow, base = ring_train.load_flow(tmp_path / "ring.pt")
    assert base == ring_train.BASE and flow.config["hidden"] == 8
    assert (tmp_path / "ring_curve.png").exists() and (tmp_path / "ring_log.jsonl").read_text().count("\n") == 3
