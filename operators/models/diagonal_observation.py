"""An observation o = h(x) + N(0, diag(s²)) with independent entries, some of them angles — shared by
``range_bearing`` and ``lorenz96``.

    log p(o | x) = Σ_k [ −½ (r_k / s_k)² − log s_k − ½ log 2π ],    r = o ⊖ h(x),

where ⊖ is the plain difference except on the family's angular entries, where it is wrapped into [−π, π)
(:func:`wrap_angle`): the nearest branch of the wrapped normal, exact to within e^{−2π²/s²} relative for s ≤ 1 rad.
Every residual of the family — the likelihood, and the innovations of ``enkf`` and ``ukf``
(:meth:`~mpflow.operators.models.base.ModelFamily.observation_residual`) — is formed this way, so an angle crossing
±π never produces a 2π jump.

Partial observations: the entries are independent, so the observed ones S condition alone, log p(o_S | x) =
Σ_{k∈S} (…). :meth:`DiagonalGaussianObservation.observed_part` keeps the full shape (``seen`` [B, k], 1 on S): the
likelihood sums over S; ``observation_function`` is 0 and ``observation_noise`` 1 at the gaps, with
``observation_log_offset`` = ½ log(2π)·|gaps|, so a Gaussian filter's innovation there is exactly 0 and its evidence
that of o_S (the convention of :mod:`mpflow.operators.models.linear_observation`).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import Generators, randn


def wrap_angle(a: torch.Tensor) -> torch.Tensor:
    """a wrapped into [−π, π) (gradient 1 everywhere except at the jump)."""
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


@functools.lru_cache(maxsize=32)
def _angular_mask(k: int, angular: tuple[int, ...]) -> torch.Tensor:
    """[k] bool: True at the angular entries (shared and never written to)."""
    mask = torch.zeros(k, dtype=torch.bool)
    mask[list(angular)] = True
    return mask


class DiagonalGaussianObservation(ModelFamily):
    gaussian_observation = True
    partial_observations = True
    #: which entries of the observation are angles (wrapped at ±π)
    angular: ClassVar[tuple[int, ...]] = ()

    # what a family gives
    def observed_mean(self, x: torch.Tensor) -> torch.Tensor:
        """h(x) [B, N, k] for x [B, N, d], every entry (no gaps)."""
        raise NotImplementedError

    def observation_sd(self) -> torch.Tensor:
        """s [B, k]: each entry's noise standard deviation."""
        raise NotImplementedError

    # derived
    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.observation_sd().shape[-1],)

    def _seen(self, like: torch.Tensor) -> torch.Tensor:
        """[B, k]: 1 where the entry is observed (all of them outside :meth:`observed_part`)."""
        seen = self.params.get("seen")
        return torch.ones(self.observation_sd().shape, dtype=like.dtype) if seen is None else seen.to(like.dtype)

    def _wrapped(self, r: torch.Tensor) -> torch.Tensor:
        """r [..., k] with the angular entries wrapped (a mask, not an indexed copy: this runs on every step)."""
        if not self.angular:
            return r
        return torch.where(_angular_mask(r.shape[-1], self.angular), wrap_angle(r), r)

    def _weighted_by_seen(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, N, k] with the entries a partial observation does not have set to 0 (t itself when all are)."""
        seen = self.params.get("seen")
        return t if seen is None else t * seen.to(t.dtype)[:, None]

    def observation_residual(self, obs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """o ⊖ y: the angular entries wrapped into [−π, π)."""
        return self._wrapped(obs[:, None] - y)

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = self.observation_sd().to(x.dtype)[:, None]
        r = self.observation_residual(obs.to(x.dtype), self.observed_mean(x))
        terms = -0.5 * (r / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)
        return self._weighted_by_seen(terms).sum(-1)

    def observation_function(self, x: torch.Tensor) -> torch.Tensor:
        """h(x), 0 at the gaps of a partial observation."""
        return self._weighted_by_seen(self.observed_mean(x))

    def observation_noise(self) -> torch.Tensor:
        """diag(s²), 1 at the gaps of a partial observation."""
        s = self.observation_sd()
        seen = self._seen(s)
        return torch.diag_embed(seen * s**2 + (1 - seen))

    def observation_log_offset(self) -> torch.Tensor:
        s = self.observation_sd()
        return 0.5 * math.log(2 * math.pi) * (1 - self._seen(s)).sum(-1)

    def observed_part(self, obs: torch.Tensor) -> tuple[ModelFamily, torch.Tensor]:
        """The observed entries' likelihood at the full shape (module docstring)."""
        params = self.expanded(obs.shape[0])
        seen = (~torch.isnan(obs)).to(self.observation_sd().dtype)
        params["seen"] = seen if "seen" not in params else params["seen"] * seen
        return type(self)(params, self.state_dim), obs.nan_to_num(0.0)

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """o = h(x) + s ⊙ ξ for true states x [B, d], the angles wrapped."""
        s = self.observation_sd().to(x.dtype)
        o = self.observed_mean(x[:, None])[:, 0] + s * randn(gens, [s.shape[-1]], x.dtype)
        return self._wrapped(o)

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """o_{b,i} = h(x_{b,i}) + s_b ⊙ ξ_{b,i} for the states x [B, N, d], the angles wrapped."""
        s = self.observation_sd().to(x.dtype)[:, None]
        h = self.observed_mean(x)
        return self._wrapped(h + s * torch.randn(h.shape, generator=gen, dtype=x.dtype))
