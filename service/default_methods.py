"""The method a stream gets when its request names none: the one ``benchmarks/equal_compute.py`` measured most
accurate for its (family, d), read from ``service/default_methods.json`` (written by that benchmark's full run and
committed with it; ``tests/unit/test_default_methods.py`` checks that the service follows it).

An entry gives the method, its options (``mpf``'s ``operator`` and ``substeps``) and the particle count it was
measured with — used when the request gives none — and a one-line reason, which the stream document carries as
``method_reason``. A (family, d) the benchmark did not run takes the entry of the nearest measured d of the same
family (the reason says so); a family it never ran takes ``kalman`` when linear-Gaussian, else ``smc``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent / "default_methods.json"


@dataclass(frozen=True)
class DefaultMethod:
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    num_particles: int | None = None
    reason: str = ""


@lru_cache(maxsize=1)
def table(path: Path = TABLE) -> tuple[dict[str, Any], ...]:
    """The benchmark's entries (empty when the file is missing)."""
    if not path.exists():
        return ()
    return tuple(json.loads(path.read_text())["defaults"])


def default_method(family: str, state_dim: int, linear_gaussian: bool, entries=None) -> DefaultMethod:
    """The default for (family, d) per the module docstring."""
    entries = table() if entries is None else entries
    same = [e for e in entries if e["family"] == family]
    if not same:
        method = "kalman" if linear_gaussian else "smc"
        return DefaultMethod(method, reason=f"{family} was not benchmarked; {method} is the safe default")
    entry = min(same, key=lambda e: (abs(e["state_dim"] - state_dim), e["state_dim"]))
    reason = entry["reason"]
    if entry["state_dim"] != state_dim:
        reason = f"as measured at d = {entry['state_dim']}, the nearest benchmarked d: {reason}"
    return DefaultMethod(entry["method"], dict(entry.get("options") or {}), entry.get("num_particles"), reason)


__all__ = ["TABLE", "DefaultMethod", "default_method", "table"]
