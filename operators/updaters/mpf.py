"""``mpf``: the Meta Particle Flow updater (Chen, Dai & Song, §2–3): one short ODE integration per observation
moves the particles from p(x | o_<m) to p(x | o_≤m) and carries their log-density (eq. 4, 8).

Per step, for each stream:
  1. predict   dynamic families move the particles through the transition (MPF §5 LDS: "predict with the
               transition, then apply F"), mapped affinely onto the pushed moments (F m + c, F C Fᵀ + Q) of
               the previous cloud; their log-density becomes that Gaussian's at the predicted particles;
  2. linearise the likelihood: exactly (Hᵀ R⁻¹ H, Hᵀ R⁻¹ o) for linear-Gaussian families, else by Stein's
               identity from the scores at the particles (:mod:`operators.mpf.gaussian_flow`);
  3. flow      integrate dx/dλ = f_θ(X_m, o, x(λ), λ) over λ ∈ [0, 1] with ``solver`` (RK4 with ``steps``
               equal steps by default: the reference used one) and d log q/dλ = −∇·f;
  4. evidence  log p(o_m | o_<m) ≈ log mean_i p(o_m | x_i) over the predicted particles.

f_θ is :class:`operators.mpf.network.MPFVelocity`: the exact Daum–Huang flow plus a learned residual. With
``network=None`` the residual is zero — the updater is then the exact Daum–Huang filter, exact for
linear-Gaussian models up to the ODE error — and a trained operator (see :mod:`operators.registry`)
supplies θ. At step 0 with a Gaussian prior and N > d the particles are mapped onto the prior's exact mean
and covariance and their log-density is the prior's.

Not registered in ``UPDATERS`` until trained operators ship (the API's ``mpf`` means "a trained operator").
"""

from __future__ import annotations

import torch

from operators import evidence, gaussian
from operators.models.base import ModelFamily
from operators.models.priors import GaussianMixture, Prior
from operators.mpf.network import MPFVelocity
from operators.mpf.step import flow_step
from operators.rng import Generators
from operators.state import ParticleState, StepInfo
from operators.updaters.base import Updater


class MPFUpdater(Updater):
    name = "mpf"
    defaults = {"network": None, "solver": "rk4", "steps": 1, "divergence": "auto"}

    def __init__(self, **options):
        super().__init__(**options)
        net = self.options["network"]
        if net is not None and not isinstance(net, MPFVelocity):
            raise ValueError("options.network: expected an MPFVelocity (load one with operators.registry)")
        self._untrained: dict[int, MPFVelocity] = {}

    def network(self, dim: int) -> MPFVelocity:
        net = self.options["network"]
        if net is None:  # the zero residual: the exact Daum–Huang flow
            net = self._untrained.setdefault(dim, MPFVelocity(dim).eval())
        if net.dim != dim:
            raise ValueError(f"options.network: the operator is for d = {net.dim}, the model has d = {dim}")
        return net

    def _init(self, state: ParticleState, prior: Prior, model: ModelFamily, gens: Generators) -> ParticleState:
        x = state.particles
        if isinstance(prior, GaussianMixture):
            if prior.weights.shape[1] == 1:
                x = gaussian.moment_matched(x, *prior.moments())
            log_q = prior.to(torch.float64).log_prob(x.double()).to(x.dtype)
        else:  # a particle prior has no density: use its fitted Gaussian's
            mean, cov = gaussian.moments(x.double())
            log_q = gaussian.log_prob(x.double(), mean, gaussian.cholesky(cov)).to(x.dtype)
        return state.replace(particles=x, log_density=log_q)

    def _predict(self, state: ParticleState, model: ModelFamily, gens: Generators):
        x, log_q = state.particles, state.log_density
        if not model.dynamic:
            return x, log_q
        mean, cov = gaussian.moments(x.double(), state.log_weights)
        mean, cov = gaussian.affine_push(mean, cov, *(t.double() for t in model.transition_affine()))
        x = gaussian.moment_matched(model.transition(x, gens), mean, cov)  # no Monte Carlo noise in the moments
        return x, gaussian.log_prob(x.double(), mean, gaussian.cholesky(cov)).to(x.dtype)

    def _update(self, state: ParticleState, obs: torch.Tensor, model: ModelFamily, gens: Generators):
        B, N, d = state.particles.shape
        x, log_q = self._predict(state, model, gens)
        o = self.options
        with torch.no_grad():
            inc = evidence.predictive(model.log_likelihood(obs, x))
            x1, log_q1 = flow_step(
                self.network(d), model, obs, x, log_q, method=o["solver"], steps=o["steps"], divergence=o["divergence"]
            )
        n_eff = torch.full((B,), float(N), dtype=torch.float64)
        return state.replace(particles=x1, log_density=log_q1), StepInfo(inc, n_eff)
