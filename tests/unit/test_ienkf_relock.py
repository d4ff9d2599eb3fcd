"""``ienkf``'s ``relock`` (``method_options.relock``, :mod:`mpflow.operators.updaters.relock`): the observer's
training loss is the Gaussian CRPS, ``observer_train`` trains and registers an observer that no ``mpf`` stream picks,
a re-locking stream carries its window and innovation ratio (through a gap, a snapshot, a fall-back) without depending
on its batch, the option is a registered name and Lorenz-96 only — and with the shipped observer a stream that lost
the truth re-locks onto it where the IEnKF alone stays lost on most twins."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.ring_observer import RingObserver, gaussian_crps
from mpflow.operators.state import ParticleState
from mpflow.operators.trained_operators import find_operator
from mpflow.operators.updaters import get_updater, relock
from mpflow.service.engine.numerics import finite_state
from mpflow.training import observer_train
from mpflow.training.scores import crps

from tests.harness.learned_options import refuses_what_it_cannot_serve

#: the shipped observer the Spantini-regime default re-locks from
SHIPPED = "lorenz96-d40-v2"
SPANTINI = {"delta": 0.4, "rk4_step": 0.02, "obs_every": 2, "R": 0.5}


def test_the_training_loss_is_the_crps_of_the_gaussian() -> None:
    g = torch.Generator().manual_seed(0)
    mean, sd, y = torch.tensor([[0.3, -1.0]]), torch.tensor([[0.5, 2.0]]), torch.tensor([[1.1, -0.2]])
    draws = mean[:, None] + sd[:, None] * torch.randn(1, 20000, 2, generator=g)
    closed = gaussian_crps(mean, sd, y).sum(-1)
    assert closed.item() == pytest.approx(crps(draws, y).item(), rel=0.02)
    assert gaussian_crps(mean, sd, mean).sum().item() == pytest.approx(
        ((math.sqrt(2) - 1) / math.sqrt(math.pi)) * 2.5, rel=1e-4
    )


@pytest.fixture(scope="module")
def tiny_observer(tmp_path_factory) -> str:
    """An observer trained for a few iterations at d = 12 and registered in a folder of its own → its name."""
    out = tmp_path_factory.mktemp("observer")
    args = observer_train.parser().parse_args(
        ["--out", str(out), "--dim", "12", "--hidden", "8", "--layers", "2", "--batch", "4", "--iterations", "6",
         "--val-every", "3", "--val-twins", "4", "--val-windows", "2", "--quiet"]
    )  # fmt: skip
    summary = observer_train.train(args)
    assert summary["iterations"] == 6 and (out / "observer_curve.png").exists()
    assert len((out / "observer_log.jsonl").read_text().splitlines()) == 3
    record = observer_train.register(out / "observer.pt", out / "ops", "lorenz96-d12-v8")
    assert record.config["architecture"]["kind"] == "ring_observer" and record.config["auto_select"] is False
    return str(out / "ops")


@pytest.fixture
def observer_name(tiny_observer, monkeypatch) -> str:
    monkeypatch.setenv("MPFLOW_OPERATOR_DIRS", tiny_observer)
    return "lorenz96-d12-v8"


def _twin(d: int, params: dict, B: int, steps: int, seed: int = 0):
    model = make_model("lorenz96", params, d)
    g = torch.Generator().manual_seed(seed)
    x = 8.0 + torch.randn(B, d, generator=g, dtype=torch.float64)
    for _ in range(300):
        x = model.to(torch.float64).transition_mean(x[:, None])[:, 0]
    stacked = type(model).stack([model] * B)
    xs, obs = stacked.to(torch.float64).simulate(steps, x, [torch.Generator().manual_seed(seed + b) for b in range(B)])
    return stacked, xs, obs.to(torch.float32)


def test_a_relocking_stream_carries_its_window_and_does_not_depend_on_its_batch(observer_name) -> None:
    d = 12
    model, xs, obs = _twin(d, SPANTINI, 2, 6)
    u = get_updater("ienkf", inflation=1.2, iterations=4, relock=observer_name)
    prior = GaussianMixture.gaussian(xs[:, 0], torch.eye(d, dtype=torch.float64).expand(2, d, d))
    both = u.init(prior, model, 16, seed=[5, 6])
    assert both.extras[relock.WINDOW].shape == (2, 4, d) and not bool(both.extras[relock.SEEN].any())
    assert finite_state(both)  # the service refuses (or falls back from) a state with a non-finite float
    one = u.init(GaussianMixture.gaussian(xs[1:, 0], torch.eye(d, dtype=torch.float64)[None]), model, 16, seed=[6])
    single = type(model).stack([make_model("lorenz96", SPANTINI, d)])
    for m in range(5):
        both, info = u.update(both, obs[:, m], model)
        one, _ = u.update(one, obs[1:, m], single)
        assert info.extras["relocked"].dtype == torch.bool
    assert torch.equal(both.particles[1:], one.particles)
    assert torch.equal(both.extras[relock.RATIO][1:], one.extras[relock.RATIO])
    assert finite_state(both)
    window = relock.observed_window(both.extras)
    assert torch.equal(window[:, -1, 0::2], obs[:, 4].double()) and bool(window[:, :, 1::2].isnan().all())
    again = ParticleState.from_bytes(both.unbind()[0].to_bytes())  # a snapshot keeps them
    for key in (relock.WINDOW, relock.SEEN, relock.RATIO):
        assert torch.equal(again.extras[key], both.extras[key][:1])
    gap, _ = u.update(both, torch.full_like(obs[:, 5], math.nan), model)  # a step without a measurement
    assert not bool(gap.extras[relock.SEEN][:, -1].any()) and finite_state(gap)
    torch.testing.assert_close(relock.observed_window(gap.extras)[:, :-1], window[:, 1:], equal_nan=True)
    taken = u.resume(u.to_particles(both), both, obs[:, 5], model)  # another method's step (a fall-back)
    assert torch.equal(relock.observed_window(taken.extras)[:, -1, 0::2], obs[:, 5].double())
    assert torch.equal(taken.extras[relock.RATIO], both.extras[relock.RATIO])
    fresh = u.from_particles(u.to_particles(both))
    assert not bool(fresh.extras[relock.SEEN].any()) and bool((fresh.extras[relock.RATIO] == 1).all())
    plain = get_updater("ienkf", iterations=4).step_work(model, 16).flops
    assert u.step_work(model, 16).flops > plain
    assert find_operator("lorenz96", 12) is None and find_operator("lorenz96", 12, include_named_only=True) is None


def test_the_ratio_is_about_one_when_the_ensemble_predicts_its_innovations() -> None:
    model = make_model("lorenz96", {"obs_every": 2, "R": 0.5}, 12).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(4000, 12, generator=g, dtype=torch.float64)
    ensemble = torch.randn(4000, 64, 12, generator=g, dtype=torch.float64)  # the truth's own distribution
    obs = truth[:, 0::2] + math.sqrt(0.5) * torch.randn(4000, 6, generator=g, dtype=torch.float64)
    stacked = type(model).stack([model] * 4000)
    assert relock.innovation_ratio(ensemble, obs, stacked).mean().item() == pytest.approx(1.0, abs=0.05)
    assert relock.innovation_ratio(ensemble + 3.0, obs, stacked).mean().item() > relock.THRESHOLD


def test_relock_is_a_registered_observer_and_only_for_lorenz96(observer_name) -> None:
    refuses_what_it_cannot_serve(
        "relock", observer_name, ["../ops/" + observer_name, "lorenz96-d12-v99", "lds-d2-v1", 3]
    )
    with pytest.raises(ValueError, match=r"options\.correction"):
        get_updater("ienkf", correction=observer_name)  # an observer is not a correction
    assert isinstance(RingObserver().flops(40), float)


def _rmse_after(u, model, xs, obs, prior, steps: int) -> tuple[torch.Tensor, int]:
    state = u.init(prior, model, 40, seed=list(range(xs.shape[0])))
    fired, errors = 0, []
    for m in range(steps):
        state, info = u.update(state, obs[:, m], model)
        fired += int(info.extras.get("relocked", torch.zeros(1)).sum())
        errors.append((state.particles.double().mean(1) - xs[:, m]).pow(2).mean(-1).sqrt())
    return torch.stack(errors[-10:], 1).mean(1), fired


def test_a_stream_that_lost_the_truth_relocks_with_the_shipped_observer() -> None:
    """Spantini regime, d = 40: a prior 5 away from the truth with sd 0.1 (a filter that lost it: overconfident). The
    IEnKF alone stays lost; re-locking, the streams re-seed from their observations and track again."""
    d, B, steps = 40, 4, 40
    model, xs, obs = _twin(d, SPANTINI, B, steps, seed=11)
    lost = GaussianMixture.gaussian(xs[:, 0] + 5.0, 0.01 * torch.eye(d, dtype=torch.float64).expand(B, d, d))
    alone, _ = _rmse_after(get_updater("ienkf", inflation=1.2, iterations=4), model, xs, obs, lost, steps)
    relocked, fired = _rmse_after(
        get_updater("ienkf", inflation=1.2, iterations=4, relock=SHIPPED), model, xs, obs, lost, steps
    )
    assert int((alone > 1.0).sum()) >= 2, alone  # the IEnKF alone recovers on some twins, not on most
    assert fired >= B and bool((relocked < 1.0).all()), (relocked, alone, fired)
