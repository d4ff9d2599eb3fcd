"""The learned local correction of the LETKF on the Lorenz-96 ring (:mod:`mpflow.operators.mpf.ring_correction`):
untrained it is the LETKF exactly, it is equivariant under permuting the members and rotating the ring, the energy
score of a fixed batch falls under a few Adam steps, and ``ring_train --arch correction`` writes one that loads back
and runs in :class:`~mpflow.operators.mpf.ring.RingLETKF`."""

from __future__ import annotations

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.ring import RingLETKF
from mpflow.operators.mpf.ring_correction import RingCorrection
from mpflow.operators.updaters.enkf import EnKFUpdater
from mpflow.training import ring_train
from mpflow.training.scores import energy_score


def _step(d: int = 12, N: int = 8, B: int = 3, every: int = 2):
    g = torch.Generator().manual_seed(0)
    model = make_model("lorenz96", {"delta": 0.2, "obs_every": every, "R": 0.5}, d)
    truth = 8 + torch.randn(B, d, generator=g, dtype=torch.float64)
    forecast = truth[:, None] + torch.randn(B, N, d, generator=g, dtype=torch.float64) + 0.5
    obs = truth[:, ::every] + 0.3 * torch.randn(B, d // every, generator=g, dtype=torch.float64)
    analysis, _ = EnKFUpdater(localisation=2.0).analysis(forecast, obs, model.to(torch.float64), None)
    return model, forecast.float(), analysis.float(), obs.float(), truth.float()


def _trained_looking(seed: int = 1) -> RingCorrection:
    torch.manual_seed(seed)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4)
    with torch.no_grad():
        net.site_out.weight.normal_(0, 0.3)
        net.member[-1].weight.normal_(0, 0.3)
    return net


def test_an_untrained_correction_is_the_letkf() -> None:
    model, forecast, analysis, obs, _ = _step()
    out = RingCorrection(hidden=8, layers=3, embed=4)(forecast, analysis, obs, model)
    assert out.shape == analysis.shape
    assert torch.allclose(out, analysis, atol=1e-5)


def test_the_correction_is_equivariant_under_member_permutation_and_ring_rotation() -> None:
    model, forecast, analysis, obs, _ = _step()
    net = _trained_looking()
    out = net(forecast, analysis, obs, model)
    assert not torch.allclose(out, analysis, atol=1e-3)
    perm = torch.randperm(forecast.shape[1], generator=torch.Generator().manual_seed(2))
    assert torch.allclose(net(forecast[:, perm], analysis[:, perm], obs, model), out[:, perm], atol=1e-5)
    rolled = net(forecast.roll(2, -1), analysis.roll(2, -1), obs.roll(1, -1), model)
    assert torch.allclose(rolled, out.roll(2, -1), atol=1e-5)


def test_a_few_adam_steps_lower_the_energy_score_of_a_fixed_batch() -> None:
    model, forecast, analysis, obs, truth = _step(B=4)
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = energy_score(net(forecast, analysis, obs, model), truth).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0], losses


def test_a_short_correction_run_loads_back_and_filters(tmp_path) -> None:
    args = ring_train.parser().parse_args(
        ["--arch", "correction", "--out", str(tmp_path), "--dim", "12", "--particles", "8", "--batch", "3",
         "--hidden", "8", "--layers", "3", "--iterations", "4", "--val-every", "2", "--val-twins", "2",
         "--val-cycles", "2", "--warm-up", "2", "--device", "cpu"]
    )  # fmt: skip
    out = ring_train.train(args)
    assert out["iterations"] == 4 and len(out["history"]) == 3
    net, base = ring_train.load_flow(tmp_path / "ring.pt")
    assert isinstance(net, RingCorrection) and net.config["hidden"] == 8
    model = make_model("lorenz96", {"delta": 0.2, "obs_every": 2}, 12)
    u = RingLETKF(net, **base)
    prior = GaussianMixture.gaussian(8 + torch.zeros(1, 12), torch.eye(12)[None])
    state = u.init(prior, model, 8, seed=[0])
    state, _ = u.update(state, torch.full((1, 6), 8.5), model)
    assert state.particles.shape == (1, 8, 12) and torch.isfinite(state.particles).all()
