"""FFBSi by rejection (:mod:`mpflow.operators.smoothing.backward_simulation`): each of its three ways of drawing a
trajectory's index at step s — rejection, the exact fall-back, the Metropolis–Hastings fall-back — draws the
backward kernel P(J_s = i | J_{s+1} = j) ∝ w^i_s N(x^j_{s+1}; f(x^i_s), Q) (written out here in numpy), and a step
whose proposals are all rejected still ends within its bounded number of proposals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpflow.operators.smoothing import backward_simulation as bs

M = 40000  # trajectories: a frequency's sd is at most 0.0025


def link(seed: int = 0, far: float = 0.0):
    """One backward link in d = 2 with N = 6 particles; ``far`` moves x_{s+1} that many units off the cloud."""
    rng = np.random.default_rng(seed)
    N = 6
    lw_s = np.log(rng.dirichlet(np.ones(N)))
    fx, x_next = rng.normal(size=(N, 2)), rng.normal(size=(N, 2)) + far
    Q = np.array([[0.5, 0.1], [0.1, 0.3]])
    diff = x_next[None, :, :] - fx[:, None, :]
    log_k = -0.5 * np.einsum("ijk,kl,ijl->ij", diff, np.linalg.inv(Q), diff)  # log K[i, j] up to a constant
    log_exact = lw_s[:, None] + log_k
    exact = np.exp(log_exact - log_exact.max(0))
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    gen = torch.Generator().manual_seed(seed)
    sampler = bs.Sampler(t(lw_s), t(fx), t(x_next), torch.linalg.cholesky(t(Q)), gen)
    return sampler, exact / exact.sum(0)


def frequencies(sampler, j: int, ancestors=None) -> np.ndarray:
    n = sampler.lw_s.shape[0]
    targets = torch.full((M,), j, dtype=torch.int64)
    ancestors = torch.arange(n) if ancestors is None else ancestors
    out = bs.backward_step(sampler, targets, ancestors)
    return np.bincount(out.numpy(), minlength=n) / M


@pytest.mark.parametrize("way", ["rejection", "exact", "mh"])
def test_each_way_draws_the_backward_kernel(monkeypatch, way):
    if way != "rejection":  # no rejection round: every trajectory falls back
        monkeypatch.setattr(bs, "REJECTION_TRIALS", 0)
        monkeypatch.setattr(bs, "EXACT_FALLBACKS", M if way == "exact" else 0)
    else:
        monkeypatch.setattr(bs, "REJECTION_TRIALS", 10**4)
        monkeypatch.setattr(bs, "EXACT_FALLBACKS", 0)
    sampler, kernel = link()
    for j in (0, 3):
        # MH starts every chain at one index (the worst start): its moves must forget it
        got = frequencies(sampler, j, torch.zeros(6, dtype=torch.int64))
        assert np.abs(got - kernel[:, j]).max() < 0.015, (way, j, got, kernel[:, j])


def test_the_weights_matter():
    """The check above can fail: the kernel differs from the filter weights and from K alone."""
    sampler, kernel = link()
    w = torch.softmax(sampler.lw_s, 0).numpy()
    assert np.abs(w - kernel[:, 0]).max() > 0.1


def test_a_step_whose_proposals_are_all_rejected_is_bounded(monkeypatch):
    """x_{s+1} 60 units away from every f(x_s): K_ij / K̄ underflows, nothing is accepted; the step ends after
    REJECTION_TRIALS proposals each (in rounds of PROPOSALS_PER_ROUND), EXACT_FALLBACKS exact draws and MH_MOVES
    moves for the rest, within its priced work, and the exact draws still follow the kernel."""
    sampler, kernel = link(far=60.0)
    proposals = []
    draw = sampler.draw
    monkeypatch.setattr(sampler, "draw", lambda count: proposals.append(count) or draw(count))
    targets = torch.zeros(1000, dtype=torch.int64)
    out = bs.backward_step(sampler, targets, torch.arange(6))
    assert len(proposals) == bs.REJECTION_TRIALS // bs.PROPOSALS_PER_ROUND + bs.MH_MOVES
    assert sum(proposals) == 1000 * bs.REJECTION_TRIALS + (1000 - bs.EXACT_FALLBACKS) * bs.MH_MOVES
    assert ((out >= 0) & (out < 6)).all()
    exact_draws = np.bincount(out[: bs.EXACT_FALLBACKS].numpy(), minlength=6)
    assert exact_draws[np.argmax(kernel[:, 0])] >= bs.EXACT_FALLBACKS * kernel[:, 0].max() * 0.5
    assert bs.trajectory_flops(1000, 6, 2) >= sum(proposals) * (6 + bs.PROPOSAL_FLOPS)


def test_a_zero_weight_particle_is_never_drawn(monkeypatch):
    """Inverse-transform draws at the edge u = 0 (torch.rand may return it) land on the first particle with a
    weight, not on a zero-weight one before it (the window stores a zero weight as log −1e30)."""
    log_w = torch.tensor([-1e30, -1e30, 0.0, -1e30, 0.0], dtype=torch.float64)
    monkeypatch.setattr(bs.torch, "rand", lambda *shape, **kw: torch.zeros(*shape, dtype=torch.float64))
    assert bs.categorical(log_w, 3, torch.Generator()).tolist() == [2, 2, 2]
