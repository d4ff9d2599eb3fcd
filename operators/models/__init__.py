"""Model families, by the names of docs/API.md. ``FAMILIES`` is the registry; ``make_model`` validates
the API's parameters for one stream.

A family is one module here: its :class:`ModelFamily` subclass carries the likelihood and dynamics and everything
else the project knows about it (catalogue text, task distribution, evaluation and benchmark defaults; see
:mod:`mpflow.operators.models.base`). Listing the class in ``FAMILIES`` below (the order is the order of
``mpflow info``, the meta-training families and the benchmarks) makes the service, ``mpflow filter``/``train``/
``evaluate`` and the benchmarks run it."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.gmm import GMM
from mpflow.operators.models.lds import LDS
from mpflow.operators.models.linear_gaussian import LinearGaussian
from mpflow.operators.models.logistic import Logistic
from mpflow.operators.models.stochastic_volatility import StochasticVolatility

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
