"""Meta Particle Flow (Chen, Dai & Song): a learned Bayes operator that moves particles from p(x | o_1..m)
to p(x | o_1..m+1) along a neural ODE dx/dt = f (eq. 4) while tracking their log-density,
log q_{m+1}(x_{m+1}) = log q_m(x_m) − ∫ ∇ₓ·f dt (eq. 8).

- :mod:`mpflow.operators.mpf.daum_huang` — the exact Daum–Huang flow (the base velocity) and the statistical
  linearisation of a likelihood from particle scores;
- :mod:`mpflow.operators.mpf.network` — f_θ (eq. 16–18): DeepSet context, gated time-conditioned layers, score
  input, a zero-initialised residual on the base flow;
- :mod:`mpflow.operators.mpf.step` — :func:`flow_step`: one Bayes step, shared by serving and meta-training;
- :mod:`mpflow.operators.mpf.divergence` — ∇ₓ·f exactly (d autograd calls) or by Hutchinson probes;
- :mod:`mpflow.operators.mpf.ode` — :func:`integrate`: the (x, log q) ODE with torchdiffeq, per-stream time spans,
  plain or adjoint gradients, detached outputs for serving.
"""

from mpflow.operators.mpf.divergence import (
    DIVERGENCE_METHODS,
    EXACT_MAX_DIM,
    divergence_exact,
    divergence_hutchinson,
    rademacher_probes,
    velocity_and_divergence,
)
from mpflow.operators.mpf.ode import ADAPTIVE_METHODS, FIXED_STEP_METHODS, ODE_METHODS, integrate

__all__ = [
    "ADAPTIVE_METHODS",
    "DIVERGENCE_METHODS",
    "EXACT_MAX_DIM",
    "FIXED_STEP_METHODS",
    "ODE_METHODS",
    "divergence_exact",
    "divergence_hutchinson",
    "integrate",
    "rademacher_probes",
    "velocity_and_divergence",
]
