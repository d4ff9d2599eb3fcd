"""One MPF Bayes step, shared by serving (:class:`operators.updaters.mpf.MPFUpdater`) and meta-training
(:func:`training.meta_train.task_loss`), so the two can never drift apart.

Given the particles x [B, N, d] of p(x | o_<m) (after any transition) and their log-density log q:
linearise the likelihood of o_m (:func:`operators.mpf.gaussian_flow.linearised_likelihood`), build the
network's context from the detached cloud (eq. 16), and integrate dx/dλ = f_θ(X_m, o_m, x(λ), λ) with
d log q/dλ = −∇·f over λ ∈ [0, 1] (eq. 4, 8). The likelihood score enters f along the path (§2.4 (ii)).
"""

from __future__ import annotations

import torch

from operators.models.base import ModelFamily
from operators.mpf.gaussian_flow import linearised_likelihood
from operators.mpf.network import MPFVelocity
from operators.mpf.ode import integrate


def flow_step(
    net: MPFVelocity,
    model: ModelFamily,
    obs: torch.Tensor,
    x: torch.Tensor,
    log_q: torch.Tensor | None,
    *,
    method: str = "rk4",
    steps: int = 1,
    divergence: str = "auto",
    create_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transport (x, log q) through one observation → (x1, log_q1). ``create_graph`` keeps the graph for
    training; serving calls it under ``torch.no_grad()``."""
    ctx = net.context(x, linearised_likelihood(model, obs, x))

    def velocity(xt: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        return net(xt, lam, model.score(obs, xt), ctx)

    return integrate(
        velocity, x, log_q, 0.0, 1.0, method=method, steps=steps, divergence=divergence, create_graph=create_graph
    )
