"""Samplers cached in the registry (``<root>/samplers/<name>/``, :mod:`mpflow.operators.registry`): GPVI generators
fitted to a prior density by ``mpflow fit-sampler`` (:mod:`mpflow.training.fit_sampler`), loaded for unlimited draws.

The generator is fitted in the prior's *whitened* coordinates. With the prior's exact mean m and covariance
C = L Lᵀ (L the lower Cholesky factor, float64), stored in ``config.json`` as
``"prior_moments": {"mean": [...], "cov": [[...]]}``,

    x = m + L y,    y = f_θ(z) = g_θ(z[:k]) + λ z,    z ~ N(0, I_d)                         (GPVI eq. 6)

and the target in y is p_y(y) = |L| p(m + L y), whose score is

    ∇_y log p_y(y) = Lᵀ ∇_x log p(m + L y)      (row vectors: s_x L).

KL(q ‖ p) is invariant under this affine change of variables, so fitting y is fitting x; whitening only puts
the target at the scale of the generator's start f(z) = λ z (a Gaussian prior is then matched exactly before
any training step). The stored moments are also the prior's moments that :meth:`CachedSampler.moments`
reports. A GPVI folder without ``prior_moments`` (e.g. written by :meth:`GPVIGenerator.save`) is read with
m = 0, L = I and Monte-Carlo moments from a fixed generator (seed 0, ``MC_DRAWS`` draws).

Example::

    from mpflow.operators.samplers.cached import load_sampler
    from mpflow.operators.rng import generator

    sampler = load_sampler("gpvi-d2-v1")          # searched in registry.default_dirs() ($MPFLOW_OPERATOR_DIRS)
    x = sampler.sample(10_000, generator(0))       # [10000, 2], unlimited: any n, any number of calls
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from mpflow.operators import gaussian, registry, rng, validation
from mpflow.operators.registry import OperatorRecord
from mpflow.operators.samplers.gpvi import GPVIGenerator, Score

F64 = torch.float64
MOMENTS_KEY = "prior_moments"
MC_DRAWS = 20_000


def score_in_whitened(score_x: Score, mean: torch.Tensor, chol: torch.Tensor) -> Score:
    """y ↦ Lᵀ ∇_x log p(m + L y) for ``score_x(x [n, d]) → [n, d]`` (module docstring), computed in float64
    and returned in y's dtype."""

    def score_y(y: torch.Tensor) -> torch.Tensor:
        x = mean + y.to(F64) @ chol.T
        return (score_x(x).to(F64) @ chol).to(y.dtype)

    return score_y


@dataclass(frozen=True, eq=False)
class CachedSampler:
    """A GPVI generator and its whitening map x = shift + y scaleᵀ (module docstring).

    ``shift`` [d], ``scale`` [d, d] (lower triangular), ``mean`` [d], ``cov`` [d, d]: all float64.
    """

    generator: GPVIGenerator
    shift: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor
    cov: torch.Tensor
    record: OperatorRecord | None = None

    @classmethod
    def whitened(
        cls, generator: GPVIGenerator, mean: torch.Tensor, cov: torch.Tensor, record: OperatorRecord | None = None
    ) -> CachedSampler:
        """A generator fitted in the coordinates whitened by the prior's exact (mean [d], cov [d, d])."""
        mean, cov = mean.to(F64), cov.to(F64)
        return cls(generator, mean, gaussian.cholesky(cov), mean, cov, record)

    @property
    def dim(self) -> int:
        return self.generator.dim

    @property
    def name(self) -> str | None:
        return None if self.record is None else self.record.name

    def to_x(self, y: torch.Tensor) -> torch.Tensor:
        """x = shift + L y for y [..., d] → float64."""
        return self.shift + y.to(F64) @ self.scale.T

    def sample(self, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """n draws [n, d] with the noise z from ``generator`` (any n: the draws are unlimited)."""
        return self.to_x(self.generator.sample(n, generator)).to(dtype)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prior's exact mean [d] and covariance [d, d] stored at fit time (float64)."""
        return self.mean.clone(), self.cov.clone()


def _from_record(record: OperatorRecord) -> CachedSampler:
    kind = record.config.get("kind")
    if kind != "gpvi":
        raise ValueError(f"sampler: {record.name} holds a {kind!r} sampler; only 'gpvi' samplers can be loaded")
    gen = GPVIGenerator.load(record.path).eval()
    for p in gen.parameters():
        p.requires_grad_(False)
    d = gen.dim
    stored = record.config.get(MOMENTS_KEY)
    if stored is None:  # a bare GPVI folder: identity whitening, Monte-Carlo moments with a fixed generator
        draws = gen.sample(MC_DRAWS, rng.generator(0)).to(F64)
        mean, cov = gaussian.moments(draws[None])
        eye = torch.eye(d, dtype=F64)
        return CachedSampler(gen, torch.zeros(d, dtype=F64), eye, mean[0], cov[0], record)
    where = f"sampler: {record.name}: config.{MOMENTS_KEY}"
    if not isinstance(stored, dict):
        raise ValueError(f"{where}: expected an object with 'mean' and 'cov'")
    mean = validation.vector(f"{where}.mean", stored.get("mean"), d, F64)
    cov = validation.covariance(f"{where}.cov", stored.get("cov"), d, F64)
    return CachedSampler.whitened(gen, mean, cov, record)


@functools.lru_cache(maxsize=16)
def _cached(record: OperatorRecord) -> CachedSampler:
    # keyed by the record: its hash is (kind, name, content hash, path), so a re-fitted folder is reloaded
    return _from_record(record)


def load_sampler(name_or_dir: str | Path | OperatorRecord, dirs: list[str | Path] | None = None) -> CachedSampler:
    """A cached sampler by registered name (searched in ``dirs``, default :func:`registry.default_dirs`, i.e.
    ``operators/pretrained/samplers`` and ``<dir>/samplers`` of each ``$MPFLOW_OPERATOR_DIRS`` folder), by
    folder path, or from its record. Loaded samplers are kept (up to 16) so streams share one copy.

    Raises ValueError: ``sampler: unknown sampler 'x'; available: [...]`` for an unknown name, ``path: ...``
    for a broken folder.
    """
    record = (
        name_or_dir if isinstance(name_or_dir, OperatorRecord) else registry.resolve(name_or_dir, dirs, kind="sampler")
    )
    if record.kind != "sampler":
        raise ValueError(f"sampler: {record.name} is an {record.kind}, not a sampler")
    return _cached(record)


__all__ = ["CachedSampler", "load_sampler", "score_in_whitened"]
