"""Input validation shared by model families, priors and updaters.

Every check raises :class:`ValueError` whose message starts with the offending field's name and says how
to fix it, e.g. ``"R: covariance must be symmetric positive definite (smallest eigenvalue -1.0)"``.
The service turns these into 422 answers; nothing is mutated before all checks have passed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_DTYPE = torch.float32


def as_tensor(name: str, value, dtype: torch.dtype = DEFAULT_DTYPE) -> torch.Tensor:
    """Convert ``value`` (nested lists, numbers, numpy or torch) to a finite tensor of ``dtype``."""
    try:
        t = value.to(dtype) if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: expected numbers in a (nested) list of equal-length rows ({exc})") from None
    if not torch.isfinite(t).all():
        raise ValueError(f"{name}: contains NaN or infinite values; send finite numbers only")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> torch.Tensor:
    """Require ``t.shape`` to equal ``shape`` (``None`` matches any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape, strict=True))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    return t


def vector(name: str, value, dim: int | None = None, dtype: torch.dtype = DEFAULT_DTYPE) -> torch.Tensor:
    """A finite 1-D tensor of length ``dim`` (any length when ``dim`` is None)."""
    return check_shape(name, as_tensor(name, value, dtype), [dim])


def matrix(
    name: str, value, rows: int | None = None, cols: int | None = None, dtype: torch.dtype = DEFAULT_DTYPE
) -> torch.Tensor:
    """A finite 2-D tensor of shape [rows, cols]."""
    return check_shape(name, as_tensor(name, value, dtype), [rows, cols])


def covariance(name: str, value, dim: int | None = None, dtype: torch.dtype = DEFAULT_DTYPE) -> torch.Tensor:
    """A symmetric positive-definite [dim, dim] matrix (checked in float64, returned in ``dtype``)."""
    c = matrix(name, value, dim, dim, torch.float64)
    if c.shape[0] != c.shape[1]:
        raise ValueError(f"{name}: covariance must be square, got {list(c.shape)}")
    scale = c.abs().max().clamp_min(1.0)
    if not torch.allclose(c, c.T, atol=1e-8 * float(scale), rtol=1e-6):
        raise ValueError(f"{name}: covariance must be symmetric")
    eig_min = float(torch.linalg.eigvalsh(c).min())
    if eig_min <= 1e-12 * float(scale):
        raise ValueError(
            f"{name}: covariance must be symmetric positive definite (smallest eigenvalue {eig_min:.3g}); "
            "add a small multiple of the identity"
        )
    return c.to(dtype)


def positive(name: str, value, dtype: torch.dtype = DEFAULT_DTYPE) -> torch.Tensor:
    t = as_tensor(name, value, dtype)
    if t.dim() != 0:
        raise ValueError(f"{name}: expected a single number, got shape {list(t.shape)}")
    if float(t) <= 0:
        raise ValueError(f"{name}: must be positive, got {float(t)}")
    return t


def scalar(name: str, value, dtype: torch.dtype = DEFAULT_DTYPE) -> torch.Tensor:
    t = as_tensor(name, value, dtype)
    if t.dim() != 0:
        raise ValueError(f"{name}: expected a single number, got shape {list(t.shape)}")
    return t


def positive_int(name: str, value, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: at most {maximum}, got {value}")
    return value


def unknown_keys(name: str, given, allowed) -> None:
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise ValueError(f"{name}: unknown parameter(s) {extra}; allowed: {sorted(allowed)}")
