"""What the service can run: model families (``GET /v1/models``) and trained operators (``GET /v1/operators``).

Operators are listed once at start from :func:`mpflow.operators.trained_operators.operator_dirs` (the registry's
defaults plus ``MPFLOW_OPERATOR_DIRS``; :meth:`OperatorCatalogue.load`); problems with single folders are logged and
the folder skipped. The operator chosen for a new ``mpf`` stream is
:func:`mpflow.operators.trained_operators.find_operator` over the same dirs (the newest version for the family and
state dimension), memoised per (family, d) until the next :meth:`load`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from mpflow.operators import registry, trained_operators
from mpflow.operators.models import FAMILIES, spec
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.updaters import UPDATERS

log = logging.getLogger("mpflow.catalogue")


def methods_for(family: type[ModelFamily]) -> list[str]:
    """The methods that run the family with its parameters as values; ``smc2``, which runs it when some are priors
    (and only then), is the catalogue's ``unknown_params`` method."""
    return sorted(m for m, cls in UPDATERS.items() if cls.refusal(family) is None and not cls.unknown_params)


def models(max_state_dim: int) -> list[dict[str, Any]]:
    """The ``GET /v1/models`` entries: each family's spec (:func:`mpflow.operators.models.spec.catalogue_entry`:
    description, observation format, parameters with their kinds and defaults) and the methods that run it."""
    return [
        {**spec.catalogue_entry(FAMILIES[name], max_state_dim), "methods": methods_for(FAMILIES[name])}
        for name in sorted(FAMILIES)
    ]


def method_entries() -> dict[str, dict[str, Any]]:
    """The ``GET /v1/models`` ``capabilities``: every method's own :meth:`Updater.catalogue_entry` (what it does with
    its default options, and the options that make its cloud weighted), by name."""
    return {name: UPDATERS[name].catalogue_entry() for name in sorted(UPDATERS)}


class OperatorCatalogue:
    """Trained operators found on disk (module docstring)."""

    def __init__(self, extra_dirs: list[str] | None = None):
        self.dirs = trained_operators.operator_dirs(extra_dirs)
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
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", registry.RegistryWarning)  # reported by load()
                self._found[key] = trained_operators.find_operator(family, state_dim, dirs=self.dirs)
        return self._found[key]

    def by_name(self, name: str) -> registry.OperatorRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]


__all__ = ["OperatorCatalogue", "method_entries", "methods_for", "models"]
