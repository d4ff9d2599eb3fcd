"""Strictly proper scoring rules of a particle cloud against the true state: the training objectives of
``mpflow train --loss energy|crps`` (:func:`mpflow.training.meta_train.task_loss`).

A scoring rule S(Q, y) rates a forecast distribution Q by the outcome y; it is strictly proper when E_{y~P} S(Q, y)
is minimised by Q = P alone (Gneiting & Raftery 2007). Trained on (cloud, truth) pairs simulated from the task
distribution, E S is minimised by the true filtering distribution p(x_m | o_{1:m}) — a cloud too narrow is charged
for it, where KL(q ‖ p) rewards narrowness (mode seeking). Neither needs a density of the cloud, so a step needs no
divergence of the flow.

For an ensemble X = {X_1 … X_N} (each of weight 1/N), the *fair* estimators (Ferro 2014; the cloud is treated as N
draws from Q, so the expected score equals that of Q itself and is proper for every N):

* energy score  ES(X, y) = (1/N) Σ_i ‖X_i − y‖ − 1/(2N(N−1)) Σ_{i≠j} ‖X_i − X_j‖   (Gneiting et al. 2008);
* CRPS, summed over the dimensions: Σ_k [ (1/N) Σ_i |X_ik − y_k| − 1/(2N(N−1)) Σ_{i≠j} |X_ik − X_jk| ] — strictly
  proper for each marginal only (it does not see the dependence between coordinates).

The norm is made smooth at 0 (√(s + ε²)), so that the coinciding members of a collapsed cloud still give a finite
gradient.

The *predictive* log score rates the cloud by the next observation instead of the true state: with x̃_j the cloud
carried to the next step (the transition draw of a dynamic family, the cloud itself for a static one), its predictive
is the mixture Q̂(o) = (1/N) Σ_j p(o | x̃_j), and

    LS(Q̂, o) = −log (1/N) Σ_j p(o | x̃_j),

the logarithmic score (Good 1952; strictly proper: E_{o~P} LS(Q, o) − E LS(P, o) = KL(P ‖ Q), Gneiting & Raftery
2007 §4.1) of the observation's predictive — the negative of the step's log-evidence increment log p̂(o_m | o_<m)
estimated from the cloud. Its expectation over the simulated observations is minimised by a cloud whose predictive
is the true p(o_m | o_<m): the inclusive KL(P ‖ Q̂) charges a predictive too light in its tails, which the
exclusive KL(q ‖ p) of MPF eq. 19 does not. It needs the observations alone (no truth, no density of the cloud).
"""

from __future__ import annotations

import torch
from mpflow.operators.evidence import log_mean_exp

SCORES = ("energy", "crps")
#: the loss name of :func:`predictive_log_score` (it rates a cloud by the next observation, not by the truth)
PREDICTIVE = "predictive"
#: the smoothing ε of ‖·‖ = √(Σ (·)² + ε²), far below any cloud's spread
_EPS2 = 1e-12


def energy_score(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The fair energy score [B] of clouds x [B, N, d] (N ≥ 2) against truths y [B, d] (module docstring)."""
    N = x.shape[1]
    to_truth = ((x - y[:, None]).square().sum(-1) + _EPS2).sqrt().mean(1)
    pair = ((x[:, :, None] - x[:, None]).square().sum(-1) + _EPS2).sqrt()  # [B, N, N], ε on the diagonal
    spread = (pair.sum((1, 2)) - N * _EPS2**0.5) / (N * (N - 1))
    return to_truth - 0.5 * spread


def crps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The fair CRPS [B] of clouds x [B, N, d] against truths y [B, d], summed over the d coordinates."""
    N = x.shape[1]
    to_truth = ((x - y[:, None]).square() + _EPS2).sqrt().mean(1)  # [B, d]
    pair = ((x[:, :, None] - x[:, None]).square() + _EPS2).sqrt()  # [B, N, N, d]
    spread = (pair.sum((1, 2)) - N * _EPS2**0.5) / (N * (N - 1))
    return (to_truth - 0.5 * spread).sum(-1)


def predictive_log_score(log_lik: torch.Tensor) -> torch.Tensor:
    """LS = −log (1/N) Σ_j p(o | x̃_j) [B] from the log-likelihoods log p(o | x̃_j) [B, N] of the observation under
    the carried cloud's members (module docstring)."""
    return -log_mean_exp(log_lik)


def score(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``energy`` or ``crps`` of x [B, N, d] against y [B, d] → [B]."""
    if name == "energy":
        return energy_score(x, y)
    if name == "crps":
        return crps(x, y)
    raise ValueError(f"loss: expected one of {list(SCORES)}, got {name!r}")


__all__ = ["PREDICTIVE", "SCORES", "crps", "energy_score", "predictive_log_score", "score"]
