"""Model families, by the names of API.md. ``FAMILIES`` is the registry; ``make_model`` validates
the API's parameters for one stream."""

from __future__ import annotations

from typing import Any

import torch

from operators.models.base import ModelFamily
from operators.models.gmm import GMM
from operators.models.lds import LDS
from operators.models.linear_gaussian import LinearGaussian
from operators.models.logistic import Logistic
from operators.models.stochastic_volatility import StochasticVolatility

FAMILIES: dict[str, type[ModelFamily]] = {
    cls.name: cls for cls in (LinearGaussian, LDS, GMM, Logistic, StochasticVolatility)
}


def family(name: str) -> type[ModelFamily]:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family: unknown family {name!r}; choose one of {sorted(FAMILIES)}") from None


def make_model(
    name: str, params: dict[str, Any] | None, state_dim: int, dtype: torch.dtype = torch.float32
) -> ModelFamily:
    """Build and validate a one-stream (B = 1) model of family ``name``."""
    return family(name).from_params(params, state_dim, dtype)


__all__ = ["FAMILIES", "ModelFamily", "family", "make_model"]
