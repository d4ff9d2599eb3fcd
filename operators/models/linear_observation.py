"""The linear-Gaussian observation o ~ N(H x, R) shared by ``linear_gaussian`` and ``lds``.

log p(o|x) = −½ (o − Hx)ᵀ R⁻¹ (o − Hx) − ½ log|2πR|,   ∇x log p(o|x) = Hᵀ R⁻¹ (o − Hx).
"""

from __future__ import annotations

import functools

import torch
from mpflow.operators import gaussian
from mpflow.operators.models.base import ModelFamily, parse_matrix
from mpflow.operators.rng import Generators, randn


class LinearObservationFamily(ModelFamily):
    linear_gaussian = True
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
            default = {n: dflt for n, _, dflt in cls.param_specs}[r]
            params[r] = default(H.shape[0], dtype)
        return super().from_params(params, state_dim, dtype)

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

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pred = x @ self.H.transpose(-1, -2)  # [B, N, k]
        # log N(o; Hx, R) = log N(Hx; o, R)
        return gaussian.log_prob(pred, obs, self.R_chol)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        resid = obs[:, None, :] - x @ self.H.transpose(-1, -2)  # [B, N, k]
        return gaussian.precision_times(resid, self.R_chol) @ self.H

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        L = torch.linalg.cholesky(self.R)
        noise = (L @ randn(gens, [self.H.shape[-2]], x.dtype)[..., None]).squeeze(-1)
        return torch.einsum("bkd,bd->bk", self.H, x) + noise
