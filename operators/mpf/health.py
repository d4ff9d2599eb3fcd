"""The flow's own health signal: the effective sample size of the importance weights that would correct one
Bayes step of a particle flow (in the spirit of the particle-flow particle filter, Li & Coates 2017, "Particle
filtering with invertible particle flow", IEEE TSP 65(15), where the flow is a proposal and weights correct it).

A flow step moves a cloud with Gaussian fit N(m₀, C₀) towards the posterior; the step it is meant to compute is
the Bayes update of that Gaussian,
    π(x) ∝ p(o | x) N(x; m₀, C₀),
and the cloud it returns stands for the Gaussian fit N(m₁, C₁) of its particles x₁. With x₁ as draws of that fit,
the self-normalised weights
    w_i ∝ p(o | x₁ᵢ) N(x₁ᵢ; m₀, C₀) / N(x₁ᵢ; m₁, C₁)
correct it to π, and ESS = 1 / Σ w_i² (w normalised) says how well it already is π: N when the likelihood is
linear-Gaussian and the flow exact (then π = N(m₁, C₁)), falling as the likelihood's non-Gaussianity over the
cloud outgrows what the flow represents (a single Gaussian fit of a curved likelihood, a mode moved the wrong
way). It costs one likelihood evaluation and two Gaussian densities per particle. A low ESS is the cue to split
the step into more tempered stages (:mod:`mpflow.operators.models.tempered`) or to fall back.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily


def flow_ess(model: ModelFamily, obs: torch.Tensor, before: gaussian.Whitened, after: torch.Tensor) -> torch.Tensor:
    """ESS [B] (float64) of the weights of the module docstring: ``before`` is the float64 whitened form of the
    cloud the step started from (its mean m₀ and Cholesky factor of C₀), ``after`` the particles x₁ [B, N, d]."""
    x1 = after.detach().to(torch.float64)
    mean1, cov1 = gaussian.moments(x1)
    log_w = (
        model.log_likelihood(obs, after.detach()).to(torch.float64)
        + gaussian.log_prob(x1, before.mean, before.chol)
        - gaussian.log_prob(x1, mean1, gaussian.cholesky(cov1))
    )
    log_w = torch.nan_to_num(log_w, nan=-torch.inf)
    w = torch.softmax(log_w, -1)
    return 1.0 / (w * w).sum(-1)
