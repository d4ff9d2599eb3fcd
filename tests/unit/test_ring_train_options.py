"""The training options of issue 35's third round (:mod:`mpflow.training.ring_train`): the regime gate of
:class:`~mpflow.operators.mpf.ring_correction.RingCorrection` (γ = 0 at initialisation is the base analysis exactly,
whatever the correction's θ, and an exported gated correction serves as ``ienkf``'s), the per-twin log-ratio loss,
the forecast term through the model, and the selection that keeps a θ only if sakov2008 does not get worse."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators import registry
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.ring import ring_context
from mpflow.operators.mpf.ring_correction import RingCorrection, gate_features
from mpflow.operators.updaters import get_updater
from mpflow.training import ring_export, ring_train
from mpflow.training.scores import energy_score


def _step(d: int = 12, N: int = 8, B: int = 3, every: int = 2):
    g = torch.Generator().manual_seed(0)
    model = make_model("lorenz96", {"delta": 0.2, "obs_every": every, "R": 0.5}, d)
    truth = 8 + torch.randn(B, d, generator=g)
    forecast = truth[:, None] + torch.randn(B, N, d, generator=g) + 0.5
    analysis = truth[:, None] + 0.7 * torch.randn(B, N, d, generator=g)
    obs = truth[:, ::every] + 0.3 * torch.randn(B, d // every, generator=g)
    return model.to(torch.float32), forecast, analysis, obs, truth


def test_a_closed_gate_is_the_base_analysis_exactly_whatever_the_correction() -> None:
    model, forecast, analysis, obs, _ = _step()
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4, gate=6)
    with torch.no_grad():  # a correction that moves the analysis a lot, behind the untrained (closed) gate
        net.site_out.weight.normal_(0, 0.5)
        net.member[-1].weight.normal_(0, 0.5)
    assert torch.equal(net(forecast, analysis, obs, model), analysis)
    with torch.no_grad():
        net.gate[-1].bias.fill_(0.5)  # γ = tanh(0.5) everywhere
    out = net(forecast, analysis, obs, model)
    ungated = RingCorrection(hidden=8, layers=3, kernel=3, embed=4)
    ungated.load_state_dict({k: v for k, v in net.state_dict().items() if not k.startswith("gate.")})
    full = ungated(forecast, analysis, obs, model)
    assert torch.allclose(out, analysis + math.tanh(0.5) * (full - analysis), atol=1e-5)
    assert not torch.allclose(out, analysis, atol=1e-2)


def test_the_closed_gate_still_passes_a_gradient_to_the_gate() -> None:
    model, forecast, analysis, obs, truth = _step()
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4, gate=6)
    energy_score(net(forecast, analysis, obs, model), truth).mean().backward()
    assert float(net.gate[-1].weight.grad.abs().sum()) > 0  # γ = 0 is not a stationary point of the gate
    assert float(net.site_out.weight.grad.abs().sum()) == 0  # the correction learns once the gate opens


def test_the_gate_reads_the_regime_and_the_innovation() -> None:
    model, forecast, analysis, obs, _ = _step(every=2)
    z = gate_features(ring_context(forecast, analysis, obs, model)["shared"])
    assert z.shape == (3, 4)
    assert torch.allclose(z[:, 0], torch.full((3,), math.log(0.5)))  # log R
    assert torch.allclose(z[:, 1], torch.zeros(3), atol=1e-6)  # log(Δ / 0.2) at Δ = 0.2
    assert torch.allclose(z[:, 2], torch.full((3,), 0.5))  # every second site observed
    far = gate_features(ring_context(forecast, analysis, obs + 10.0, model)["shared"])
    assert (far[:, 3] > z[:, 3] + 1).all()  # a large innovation raises log q


def test_the_log_ratio_loss_on_a_known_case() -> None:
    ratio = ring_train.log_ratio(torch.tensor([2.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 2.0]))
    assert torch.allclose(ratio, torch.tensor([math.log(2.0), 0.0, math.log(0.25)]))


def _pool_after_a_cycle(net, grad: bool = True):
    g = torch.Generator().manual_seed(3)
    params = [{"F": 8.0, "delta": t, "R": r, "obs_every": 2, "rk4_step": 0.05} for t, r in ((0.05, 1.0), (0.4, 0.5))]
    pool = ring_train.new_pool(params, 12, 8, g, torch.device("cpu"))
    score, _ = ring_train.cycle(pool, net, ring_train.make_base("ienkf"), g, grad=grad)
    return pool, score


def _args(*extra: str):
    return ring_train.parser().parse_args(["--out", "unused", "--base", "ienkf", *extra])


def test_the_training_loss_is_zero_at_the_base_and_the_mean_log_ratio_otherwise() -> None:
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4, gate=6)
    pool, score = _pool_after_a_cycle(net)
    keep = torch.ones(2, dtype=torch.bool)
    assert torch.allclose(score, pool.base_score, atol=1e-6)  # a closed gate: the base's own score
    zero = ring_train.training_loss(pool, score, keep, _args("--loss", "log-ratio"), net)
    assert abs(float(zero.detach())) < 1e-6
    with torch.no_grad():
        net.gate[-1].bias.fill_(1.0)
    pool, score = _pool_after_a_cycle(net)
    score = score.detach()  # the values, not the graph
    loss = ring_train.training_loss(pool, score, keep, _args("--loss", "log-ratio"), net)
    expected = (score.log() - pool.base_score.log()).mean()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    only_first = ring_train.training_loss(pool, score, torch.tensor([True, False]), _args("--loss", "log-ratio"), net)
    assert float(only_first) == pytest.approx(float(expected * 2 - (score[1].log() - pool.base_score[1].log())))
    plain = ring_train.training_loss(pool, score, keep, _args(), net)
    assert float(plain) == pytest.approx(float(score.mean()))
    pulled = ring_train.training_loss(pool, score, keep, _args("--gate-l2", "0.5"), net)
    pull = 0.5 * net.gate[-1].weight.detach().square().sum()
    assert float(pulled.detach()) == pytest.approx(float(score.mean() + pull))


def test_the_forecast_term_scores_the_inflated_corrected_forecast_with_a_gradient() -> None:
    torch.manual_seed(0)
    net = RingCorrection(hidden=8, layers=3, kernel=3, embed=4, gate=6)
    with torch.no_grad():
        net.gate[-1].bias.fill_(1.0)
    pool, _ = _pool_after_a_cycle(net)
    ahead = ring_train.next_forecast_score(pool, "ienkf")
    x = pool.corrected.detach().double()
    mean = x.mean(1, keepdim=True)
    rho = torch.tensor([1.02, 1.2], dtype=torch.float64)[:, None, None]
    truth = pool.model.transition_mean(pool.truth[:, None])[:, 0]
    expected = energy_score(pool.model.transition_mean(mean + rho * (x - mean)), truth)
    assert torch.allclose(ahead.double(), expected, rtol=1e-4)
    ahead.sum().backward()
    assert float(net.gate[-1].bias.grad.abs()) > 0  # the gradient goes through the RK4 forecast to θ


def _short_run(tmp_path, *extra: str):
    args = ring_train.parser().parse_args(
        ["--arch", "correction", "--base", "ienkf", "--out", str(tmp_path), "--dim", "12", "--particles", "8",
         "--batch", "3", "--hidden", "8", "--layers", "3", "--embed", "4", "--gate", "4", "--iterations", "2",
         "--val-every", "2", "--val-twins", "2", "--val-cycles", "2", "--val-sakov-twins", "1",
         "--val-sakov-cycles", "3", "--warm-up", "2", "--device", "cpu", "--loss", "log-ratio",
         "--forecast-weight", "1", *extra]
    )  # fmt: skip
    return ring_train.train(args)


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """A short gated run whose sakov2008 bar is below the base itself (``--sakov-tolerance -0.5``): (its folder, its
    result)."""
    out = tmp_path_factory.mktemp("refused")
    return out, _short_run(out, "--sakov-tolerance", "-0.5")


def test_a_theta_that_makes_sakov2008_worse_is_never_kept(refused) -> None:
    out, result = refused
    assert result["iterations"] == 2 and len(result["history"]) == 2
    assert result["best"] == math.inf  # no θ, not even the base's, under a bar half the base's RMSE
    payload = torch.load(out / "ring.pt", weights_only=True)
    assert payload["config"]["gate"] == 4
    assert all(float(v.abs().sum()) == 0 for k, v in payload["state"].items() if k.startswith("gate.2"))  # θ₀ kept


def test_an_exported_closed_gate_serves_as_the_ienkf_with_the_rule(refused, tmp_path, monkeypatch) -> None:
    ring_export.export(refused[0] / "ring.pt", tmp_path / "ops", "lorenz96-d12-v8", "# t\n\ncmd\n", {"t": 1})
    monkeypatch.setenv(registry.ENV_DIRS, str(tmp_path / "ops"))
    model = make_model("lorenz96", {"delta": 0.4, "obs_every": 2, "R": 0.5}, 12)
    prior = GaussianMixture.gaussian(8 + torch.zeros(1, 12), torch.eye(12)[None])
    states = []
    corrected = get_updater("ienkf", iterations=4, correction="lorenz96-d12-v8")
    for u in (corrected, get_updater("ienkf", iterations=4, inflation=1.2)):
        state = u.init(prior, model, 8, seed=[0])
        state, _ = u.update(state, torch.full((1, 6), 8.0), model)
        states.append(state.particles)
    assert torch.allclose(states[0], states[1], atol=1e-5)  # the network's float32 round trip only
