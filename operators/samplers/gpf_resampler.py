"""Unlimited draws from the Gaussian a particle cloud represents (GPF, Galy-Fajou et al., §3.4, eq. 16).

A cloud {x_i} with normalised weights w_i (w_i = 1/N when unweighted) represents q = N(m, C) with

    m = Σ_i w_i x_i,    C = Σ_i w_i (x_i − m)(x_i − m)ᵀ    (GPF eq. 15; :func:`mpflow.operators.gaussian.moments`).

New samples need no factorisation of C (eq. 16):

    x = m + Σ_i √w_i (x_i − m) ξ_i,      ξ_i ~ N(0, 1) i.i.d. SCALARS
      = m + (1/√N) Σ_i (x_i − m) ξ_i     (unweighted).

The paper writes "(x_i − m) ∘ ξ_i" with ξ_i ~ N(0, I_D), but its own argument — the deviation matrix D
with columns D_i = √w_i (x_i − m) satisfies D Dᵀ = C, so x = m + D ξ with ξ ~ N(0, I_N) has covariance C —
needs one scalar ξ_i per particle: an element-wise product with a vector ξ_i would give the diagonal of C
only and lose every correlation. The rank of the represented covariance is at most min(N − 1, d).

Cost: O(n N d) time for n draws. The n × N matrix of ξ is drawn in chunks of at most ``max_elements // N``
rows, so memory stays O(B · max_elements + B n d) even for n = 10⁵ draws from N = 65 536 particles. The
chunk size depends only on N, never on the batch size B, so a stream's draws are the same (up to float
rounding of m and D) alone or micro-batched.
"""

from __future__ import annotations

import torch
from mpflow.operators import gaussian, rng
from mpflow.operators.rng import Generators
from mpflow.operators.validation import positive_int

DEFAULT_MAX_ELEMENTS = 1 << 22  # ξ entries per stream per chunk (16 MiB in float32)


class GaussianFlowResampler:
    """Draws from N(m, C) of a batched particle cloud by GPF eq. (16).

    ``particles`` [B, N, d]; ``log_weights`` [B, N] (optional, unnormalised; −inf marks a zero weight).
    """

    def __init__(
        self,
        particles: torch.Tensor,
        log_weights: torch.Tensor | None = None,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        if not isinstance(particles, torch.Tensor) or particles.dim() != 3:
            shape = list(particles.shape) if isinstance(particles, torch.Tensor) else type(particles).__name__
            raise ValueError(f"particles: expected a tensor of shape [B, N, d], got {shape}")
        if particles.shape[0] == 0 or particles.shape[1] == 0 or particles.shape[2] == 0:
            raise ValueError(f"particles: every dimension must be non-empty, got {list(particles.shape)}")
        if not torch.isfinite(particles).all():
            raise ValueError("particles: contains NaN or infinite values")
        if log_weights is not None:
            if log_weights.shape != particles.shape[:2]:
                raise ValueError(
                    f"log_weights: expected shape {list(particles.shape[:2])}, got {list(log_weights.shape)}"
                )
            if torch.isnan(log_weights).any() or (log_weights == float("inf")).any():
                raise ValueError("log_weights: contains NaN or +inf values")
            if (log_weights == float("-inf")).all(-1).any():
                raise ValueError("log_weights: every stream needs at least one finite log-weight")
        self.max_elements = positive_int("max_elements", max_elements)
        self.mean, self.cov = gaussian.moments(particles, log_weights)  # [B, d], [B, d, d]
        if log_weights is None:
            sqrt_w = torch.full(particles.shape[:2], particles.shape[1] ** -0.5, dtype=particles.dtype)
        else:
            sqrt_w = torch.softmax(log_weights.to(particles.dtype), dim=-1).sqrt()
        # Rows of the deviation matrix: D_i = √w_i (x_i − m), so Dᵀ D = C.   [B, N, d]
        self.deviations = sqrt_w[..., None] * (particles - self.mean[:, None, :])

    @property
    def batch_size(self) -> int:
        return self.deviations.shape[0]

    @property
    def num_particles(self) -> int:
        return self.deviations.shape[1]

    @property
    def dim(self) -> int:
        return self.deviations.shape[2]

    def chunk_size(self) -> int:
        """Draws per chunk: at most ``max_elements`` ξ entries per stream (depends on N only)."""
        return max(1, self.max_elements // self.num_particles)

    def sample(self, n: int, gens: Generators) -> torch.Tensor:
        """n draws per stream → [B, n, d]; stream b's noise comes from ``gens[b]`` (eq. 16)."""
        n = positive_int("n", n)
        if len(gens) != self.batch_size:
            raise ValueError(f"gens: expected {self.batch_size} generators (one per stream), got {len(gens)}")
        dtype = self.deviations.dtype
        out = torch.empty(self.batch_size, n, self.dim, dtype=dtype)
        step = self.chunk_size()
        for start in range(0, n, step):
            rows = min(step, n - start)
            xi = rng.randn(gens, (rows, self.num_particles), dtype)  # [B, rows, N]
            out[:, start : start + rows] = torch.baddbmm(self.mean[:, None, :], xi, self.deviations)
        return out
