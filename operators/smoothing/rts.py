"""The Rauch–Tung–Striebel smoother over Gaussian moments: exact for ``kalman``, the ensemble RTS smoother for the
ensemble and flow methods (``enkf``, ``ukf``, ``gpf``, ``svgd``, ``nvgd``, ``mpf``).

Window row of step s (float64): the filtered moments m_s, P_s of p(x_s | o_1..s), the predicted moments m⁻_s, P⁻_s
of p(x_s | o_1..s−1), and the cross-covariance D_s = Cov(x_{s−1}, x_s | o_1..s−1). The backward pass (Rauch, Tung
& Striebel 1965; Särkkä 2013, *Bayesian Filtering and Smoothing*, Thm 8.2, and its general Gaussian form with the
cross-covariance D, §9.1), from m^S_t = m_t, P^S_t = P_t down to the oldest row::

    G_s   = D_{s+1} (P⁻_{s+1})⁻¹
    m^S_s = m_s + G_s (m^S_{s+1} − m⁻_{s+1})
    P^S_s = P_s + G_s (P^S_{s+1} − P⁻_{s+1}) G_sᵀ

The moments of a step come from the method (``Updater.filtered_moments``: ``kalman`` and ``ukf`` their exact
Gaussian, the others their cloud's weighted moments) and the predicted ones from the model, with no random draw:

* affine transition x_s = F x_{s−1} + c + N(0, Q): m⁻ = F m + c, P⁻ = F P Fᵀ + Q, D = P Fᵀ — with ``kalman``'s
  exact moments this is the exact RTS smoother;
* nonlinear x_s = f(x_{s−1}) + N(0, Q): the previous cloud mapped by f, weighted — m⁻ = Σ w_i f(x_i),
  P⁻ = Cov_w(f(x)) + Q, D = Cov_w(x, f(x)) — the ensemble RTS smoother (Raanes 2016, *On the ensemble
  Rauch–Tung–Striebel smoother and its equivalence to the ensemble Kalman smoother*, eq. 8–10, with the ensemble's
  cross-covariance of consecutive steps);
* a static family (x_s = x_{s−1}): m⁻ = m, P⁻ = D = P, so every smoothed marginal is the newest filtered one.

(P⁻)⁻¹ is applied as a pseudo-inverse (a degenerate predicted covariance, e.g. a noiseless static state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from mpflow.operators import gaussian
from mpflow.operators.kept import Kept
from mpflow.operators.smoothing import FixedLagSmoother, Smoothed, field_name, valid_rows
from mpflow.operators.state import ParticleState, StepInfo

if TYPE_CHECKING:
    from mpflow.operators.models.base import ModelFamily
    from mpflow.operators.updaters.base import Updater

F64 = torch.float64


def predicted(
    model: ModelFamily, mean: torch.Tensor, cov: torch.Tensor, cloud: ParticleState
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m⁻ [B, d], P⁻ [B, d, d], D [B, d, d]) of one step from the filtered moments ``mean``, ``cov`` of the step
    before and its ``cloud`` (shared form; read for a nonlinear transition only) — module docstring."""
    if not model.dynamic:
        return mean, cov, cov
    if model.affine_transition:
        F, c, Q = (t.to(F64) for t in model.transition_affine())
        m, P = gaussian.affine_push(mean, cov, F, c, Q)
        return m, P, cov @ F.transpose(-1, -2)
    x = cloud.particles.to(F64)
    fx = model.to(F64).transition_mean(x)
    joint_mean, joint = gaussian.moments(torch.cat([x, fx], -1), cloud.log_weights)
    d = x.shape[-1]
    P = joint[:, d:, d:] + model.transition_noise().to(F64)
    return joint_mean[:, d:], 0.5 * (P + P.transpose(-1, -2)), joint[:, :d, d:]


def backward(
    means: torch.Tensor, covs: torch.Tensor, pred_means: torch.Tensor, pred_covs: torch.Tensor, cross: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RTS backward pass (module docstring) over n rows, oldest first: filtered ``means`` [n, d], ``covs``
    [n, d, d], and each row's predicted moments and cross-covariance with the row before (row 0's are not read)
    → smoothed means [n, d], covariances [n, d, d]."""
    m_s, P_s = [means[-1]], [covs[-1]]
    for s in range(means.shape[0] - 2, -1, -1):
        gain = cross[s + 1] @ torch.linalg.pinv(pred_covs[s + 1], hermitian=True)
        m = means[s] + gain @ (m_s[0] - pred_means[s + 1])
        P = covs[s] + gain @ (P_s[0] - pred_covs[s + 1]) @ gain.T
        m_s.insert(0, m)
        P_s.insert(0, 0.5 * (P + P.T))
    return torch.stack(m_s), torch.stack(P_s)


class GaussianRTS(FixedLagSmoother):
    """The RTS smoother over the method's Gaussian moments (module docstring)."""

    name = "rts"
    FIELDS = ("mean", "cov", "pred_mean", "pred_cov", "cross")

    def empty(self, state: ParticleState, lag: int) -> dict[str, torch.Tensor]:
        B, d = state.batch_size, state.dim
        vec, mat = torch.zeros(B, lag, d, dtype=F64), torch.zeros(B, lag, d, d, dtype=F64)
        return {"mean": vec, "cov": mat, "pred_mean": vec.clone(), "pred_cov": mat.clone(), "cross": mat.clone()}

    def entry(
        self, updater: Updater, before: ParticleState, after: ParticleState, info: StepInfo | None, model: ModelFamily
    ) -> dict[str, torch.Tensor]:
        m0, P0 = updater.filtered_moments(before)
        pm, pP, D = predicted(model, m0, P0, updater.to_particles(before))
        m1, P1 = updater.filtered_moments(after)
        return {"mean": m1, "cov": P1, "pred_mean": pm, "pred_cov": pP, "cross": D}

    def smooth(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Smoothed:
        t = int(state.step[0])
        n = valid_rows(window, t)
        rows = {k: v[0, v.shape[1] - n :] for k, v in window.items()}
        means, covs = backward(rows["mean"], rows["cov"], rows["pred_mean"], rows["pred_cov"], rows["cross"])
        return Smoothed(torch.arange(t - n + 1, t + 1), means, covs)

    def window_bytes(self, lag: int, n: int, d: int) -> float:
        return 8.0 * lag * (2 * d + 3 * d * d)

    def kept(self, updater: Updater, window: dict[str, torch.Tensor], state: ParticleState) -> Kept:
        """Besides the idle rows' zeros: each valid row's filtered and predicted covariances P_s, P⁻_s symmetric
        positive semi-definite (the means and cross-covariances are bounded as every number of a state is)."""
        kept = super().kept(updater, window, state)
        n = valid_rows(window, int(state.step[0]))
        for name in ("cov", "pred_cov"):
            kept.covariances[field_name(name)] = window[name][:, window[name].shape[1] - n :]
        return kept

    def smooth_flops(self, model: ModelFamily, lag: int, n: int) -> float:
        return lag * 40.0 * model.state_dim**3  # a pseudo-inverse (an eigendecomposition) and four products per row


__all__ = ["GaussianRTS", "backward", "predicted"]
