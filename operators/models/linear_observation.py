"""The linear-Gaussian observation o ~ N(H x, R) shared by ``linear_gaussian`` and ``lds``.

log p(o|x) = −½ (o − Hx)ᵀ R⁻¹ (o − Hx) − ½ log|2πR|,   ∇x log p(o|x) = Hᵀ R⁻¹ (o − Hx).

Partial observations. With only the entries S of o observed, o_S ~ N(H_S x, R_SS) (a Gaussian's marginal: the rows
S of H, the block S×S of R). :meth:`LinearObservationFamily.observed_part` expresses it at the full shape, so streams
with different gaps still batch: H' = H with the unobserved rows zeroed, R' = R_SS on S and the identity on the
gaps (no correlation across), o' = o with 0 at the gaps. Then N(o'; H'x, R') = N(o_S; H_S x, R_SS) · N(0; 0, 1)^|gaps|,
a constant factor in x — the posterior is exact, and ``obs_log_offset`` = ½ log(2π)·|gaps| removes it from the
density (and from Kalman's evidence).
"""

from __future__ import annotations

import functools
import math

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.spec import parse_matrix
from mpflow.operators.rng import Generators, randn


class LinearObservationFamily(ModelFamily):
    linear_gaussian = True
    gaussian_observation = True
    #: the parameter names of the observation matrix and noise covariance
    obs_matrix_name = "H"
    obs_cov_name = "R"

    @classmethod
    def from_params(cls, params, state_dim: int, dtype: torch.dtype = torch.float32) -> ModelFamily:
        """As :meth:`ModelFamily.from_params`, except that the default noise covariance (scale·I) takes the
        observation dimension k — the rows of the given observation matrix — not the state dimension."""
        params = dict(params or {})
        h, r = cls.obs_matrix_name, cls.obs_cov_name
        if h in params and r not in params:
            H = parse_matrix(f"model.params.{h}", params[h], state_dim, dtype)
            params[r] = cls.spec.param(r).default(H.shape[0], dtype)
        return super().from_params(params, state_dim, dtype)

    @classmethod
    def param_unit(cls, name: str, params: dict, state_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The observation noise r·I has the observation's dimension k (the rows of the observation matrix)."""
        if name != cls.obs_cov_name or cls.obs_matrix_name not in params:
            return super().param_unit(name, params, state_dim, dtype)
        H = parse_matrix(f"model.params.{cls.obs_matrix_name}", params[cls.obs_matrix_name], state_dim, dtype)
        return torch.eye(H.shape[0], dtype=dtype)

    @property
    def H(self) -> torch.Tensor:
        return self.params[self.obs_matrix_name]

    @property
    def R(self) -> torch.Tensor:
        return self.params[self.obs_cov_name]

    @functools.cached_property
    def R_chol(self) -> torch.Tensor:
        """Cholesky factor of R, computed once per model (the parameters never change after validation)."""
        return gaussian.cholesky(self.R)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.H.shape[-2],)

    def check(self) -> None:
        h, r = self.obs_matrix_name, self.obs_cov_name
        k, d = self.H.shape[-2:]
        if d != self.state_dim:
            raise ValueError(
                f"model.params.{h}: expected {k}x{self.state_dim} (observation dim x state dim "
                f"{self.state_dim} of the prior), got {k}x{d}"
            )
        if self.R.shape[-1] != k:
            raise ValueError(
                f"model.params.{r}: expected {k}x{k} to match the rows of {h}, got {list(self.R.shape[1:])}"
            )

    def observation_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(H [B, k, d], R [B, k, k])."""
        return self.H, self.R

    def observation_function(self, x: torch.Tensor) -> torch.Tensor:
        """h(x) = H x (rows zeroed at a partial observation's gaps)."""
        return x @ self.H.transpose(-1, -2).to(x.dtype)

    def observation_noise(self) -> torch.Tensor:
        return self.R

    partial_observations = True

    def observed_part(self, obs: torch.Tensor) -> tuple[ModelFamily, torch.Tensor]:
        """The observed entries' likelihood N(o_S; H_S x, R_SS) at the full shape (module docstring)."""
        seen = (~torch.isnan(obs)).to(self.H.dtype)  # [B, k]
        params = self.expanded(obs.shape[0])
        h, r = self.obs_matrix_name, self.obs_cov_name
        params[h] = params[h] * seen[..., None]
        params[r] = params[r] * (seen[..., :, None] * seen[..., None, :]) + torch.diag_embed(1 - seen)
        params["obs_log_offset"] = 0.5 * math.log(2 * math.pi) * (1 - seen).sum(-1)
        return type(self)(params, self.state_dim), obs.nan_to_num(0.0)

    def observation_log_offset(self) -> torch.Tensor:
        offset = self.params.get("obs_log_offset")
        return offset if offset is not None else super().observation_log_offset()

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pred = x @ self.H.transpose(-1, -2)  # [B, N, k]
        # log N(o; Hx, R) = log N(Hx; o, R)
        ll = gaussian.log_prob(pred, obs, self.R_chol)
        offset = self.params.get("obs_log_offset")
        return ll if offset is None else ll + offset[:, None].to(ll.dtype)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        resid = obs[:, None, :] - x @ self.H.transpose(-1, -2)  # [B, N, k]
        return gaussian.precision_times(resid, self.R_chol) @ self.H

    def observation_draws(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """o_{b,i} = H_b x_{b,i} + L_b ξ_{b,i}, L_b L_bᵀ = R_b."""
        H, L = self.H.to(x.dtype), self.R_chol.to(x.dtype)
        xi = torch.randn(*x.shape[:2], H.shape[-2], generator=gen, dtype=x.dtype)
        return x @ H.transpose(-1, -2) + xi @ L.transpose(-1, -2)

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        L = torch.linalg.cholesky(self.R)
        noise = (L @ randn(gens, [self.H.shape[-2]], x.dtype)[..., None]).squeeze(-1)
        return torch.einsum("bkd,bd->bk", self.H, x) + noise
