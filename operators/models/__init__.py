"""Model families, by the names of docs/API.md. ``FAMILIES`` is the registry; ``make_model`` validates
the API's parameters for one stream.

A family is a :class:`ModelFamily` subclass carrying the likelihood and dynamics, with its parameters and catalogue
text as its ``spec`` (:mod:`mpflow.operators.models.spec`; its meta-training tasks, evaluation and benchmark settings
are :mod:`mpflow.training.task_distribution`'s), registered under the entry-point group ``mpflow.families``: the
built-ins by this package's own ``pyproject.toml``, any other family by the distribution that ships it
(:mod:`mpflow.operators.models.plugins`; ``examples/plugin_family/``). ``FAMILIES`` holds every family that loaded
and passed its admission check (built-ins first, in catalogue order: the order of ``mpflow info``, the
meta-training families and the benchmarks); the service, ``mpflow filter``/``train``/``evaluate`` and the
benchmarks run every family in it. ``FAMILY_ERRORS`` names each plugin left out and why."""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.plugins import load_families

FAMILIES: dict[str, type[ModelFamily]]
#: plugin name → why it was left out (import error, failed admission check)
FAMILY_ERRORS: dict[str, str]
FAMILIES, FAMILY_ERRORS = load_families()


def family(name: str) -> type[ModelFamily]:
    try:
        return FAMILIES[name]
    except KeyError:
        why = f" (the plugin of that name was left out: {FAMILY_ERRORS[name]})" if name in FAMILY_ERRORS else ""
        raise ValueError(f"model.family: unknown family {name!r}; choose one of {sorted(FAMILIES)}{why}") from None


def make_model(
    name: str, params: dict[str, Any] | None, state_dim: int, dtype: torch.dtype = torch.float32
) -> ModelFamily:
    """Build and validate a one-stream (B = 1) model of family ``name``."""
    return family(name).from_params(params, state_dim, dtype)


__all__ = ["FAMILIES", "FAMILY_ERRORS", "ModelFamily", "family", "make_model"]
