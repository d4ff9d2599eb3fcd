"""What the service can run: model families (``GET /v1/models``) and trained operators (``GET /v1/operators``).

Operators are listed once at start from ``operators.registry.default_dirs()`` plus ``MPFLOW_OPERATOR_DIRS``
(:meth:`OperatorCatalogue.load`); problems with single folders are logged and the folder skipped. The operator
chosen for a new ``mpf`` stream is :func:`operators.updaters.mpf.find_operator` over the same dirs (the newest
version for the family and state dimension), memoised per (family, d) until the next :meth:`load`.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from operators import registry
from operators.models import FAMILIES
from operators.models import base as model_base
from operators.models.base import ModelFamily
from operators.updaters import UPDATERS

log = logging.getLogger("mpflow.catalogue")

_DESCRIPTIONS = {
    "linear_gaussian": "o ~ N(H x, R); static",
    "lds": "x_m = A x_{m-1} + N(0, Q); o_m = B x_m + N(0, R)",
    "gmm": "o ~ ½ N(x1, s²) + ½ N(x1 + x2, s²); static, bimodal posterior",
    "logistic": "y ~ Bernoulli(sigmoid(w·x)) on streamed minibatches; static",
    "stochastic_volatility": "x_m = mu + phi (x_{m-1} − mu) + sigma N(0, I); o ~ N(0, diag(exp(x_m)))",
}
_OBSERVATIONS = {
    "linear_gaussian": "vector of length k (the rows of H; k = d by default)",
    "lds": "vector of length k (the rows of B)",
    "gmm": "a number (or [number])",
    "logistic": 'a minibatch {"x": [[d features], ...], "y": [0 or 1, ...]}',
    "stochastic_volatility": "vector of length d",
}
_KINDS = {
    model_base.parse_matrix: "matrix",
    model_base.parse_cov: "covariance matrix (symmetric positive definite)",
    model_base.parse_per_dim: "number or vector of length d",
    model_base.parse_positive: "positive number",
}


def _describe_default(default) -> str | None:
    """The default of a parameter in words, read off the family's default at d = 2 (c·I, or a value)."""
    if default is None:
        return None
    t = default(2, torch.float64)
    if t.dim() == 2 and torch.equal(t, t[0, 0] * torch.eye(2, dtype=t.dtype)):
        return f"{t[0, 0].item():g}·I"
    if t.dim() == 1 and bool((t == t[0]).all()):
        return f"{t[0].item():g}"
    if t.dim() == 0:
        return f"{t.item():g}"
    return str(t.tolist())


def methods_for(family: type[ModelFamily]) -> list[str]:
    return sorted(m for m, cls in UPDATERS.items() if family.linear_gaussian or not cls.needs_linear_gaussian)


def models(max_state_dim: int) -> list[dict[str, Any]]:
    """The ``GET /v1/models`` entries."""
    out = []
    for name in sorted(FAMILIES):
        cls = FAMILIES[name]
        fixed = cls.fixed_state_dim
        out.append(
            {
                "family": name,
                "dynamic": cls.dynamic,
                "linear_gaussian": cls.linear_gaussian,
                "description": _DESCRIPTIONS.get(name, ""),
                "state_dim": {"fixed": fixed, "min": fixed or 1, "max": fixed or max_state_dim},
                "observation": _OBSERVATIONS.get(name, ""),
                "parameters": [
                    {
                        "name": p,
                        "kind": _KINDS.get(parse, "value"),
                        "required": default is None,
                        "default": _describe_default(default),
                    }
                    for p, parse, default in cls.param_specs
                ],
                "methods": methods_for(cls),
            }
        )
    return out


class OperatorCatalogue:
    """Trained operators found on disk (module docstring)."""

    def __init__(self, extra_dirs: list[str] | None = None):
        dirs: list[Path] = []
        for d in [*registry.default_dirs(), *map(Path, extra_dirs or [])]:
            d = d.expanduser()
            if d.resolve() not in {x.resolve() for x in dirs}:
                dirs.append(d)
        self.dirs = dirs
        self.records: list[registry.OperatorRecord] = []
        self.loaded = False
        self._found: dict[tuple[str, int], registry.OperatorRecord | None] = {}

    def load(self) -> None:
        """(Re)list the operators; blocking (reads and hashes files)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", registry.RegistryWarning)
            records = registry.list_operators(self.dirs)
        for w in caught:
            log.warning("operator registry: %s", w.message)
        self.records = [r for r in records if r.kind == "operator"]
        self._found.clear()
        self.loaded = True
        log.info("operators loaded: %s", [r.name for r in self.records] or "none")

    def find(self, family: str, state_dim: int) -> registry.OperatorRecord | None:
        """The newest operator for (family, d), or None."""
        key = (family, state_dim)
        if key not in self._found:
            from operators.updaters.mpf import find_operator

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", registry.RegistryWarning)  # reported by load()
                self._found[key] = find_operator(family, state_dim, dirs=self.dirs)
        return self._found[key]

    def by_name(self, name: str) -> registry.OperatorRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]


__all__ = ["OperatorCatalogue", "methods_for", "models"]
