"""The method a stream gets when its request names none: the one ``benchmarks/equal_compute.py`` measured most
accurate for its (family, d), read from ``service/engine/default_methods.json`` (written by that benchmark's full run
and committed with it; ``tests/unit/test_default_methods.py`` checks that the service follows it).

An entry gives the method, its options (``mpf``'s ``operator`` and ``substeps``) and the particle count it was
measured with — used when the request gives none — and a one-line reason, which the stream document carries as
``method_reason``. A (family, d) the benchmark did not run takes the entry of the nearest measured d of the same
family (the reason says so); a family it never ran takes ``kalman`` when linear-Gaussian, else ``smc``.

Some families were measured in several regimes at one d (``benchmarks.lorenz96``: ``sakov2008`` with Δ = 0.05 and
every variable observed, ``spantini2019`` with Δ = 0.4 and every second one, where the best method differs). Such an
entry carries its ``regime``, the values of the model parameters in :data:`REGIME_KEYS` it was measured at; among the
entries of the nearest d a stream takes the one whose regime is nearest to its own parameters, in
Σ_k |log(p_k / p_k^entry)| (the parameters are positive scales: a time step, an observation stride), and the
reason says so when it is not an exact match.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent / "default_methods.json"
#: the model parameters an entry's ``regime`` may name (positive numbers)
REGIME_KEYS = ("delta", "obs_every")
#: a regime distance below this is an exact match (float rounding)
EXACT = 1e-5


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


def regime_distance(entry: dict[str, Any], params: dict[str, float]) -> float:
    """Σ_k |log(p_k / p_k^entry)| over the entry's regime parameters that ``params`` gives (0 with no regime)."""
    regime = entry.get("regime") or {}
    return sum(abs(math.log(params[k] / v)) for k, v in regime.items() if k in params and params[k] > 0 < v)


def default_method(
    family: str, state_dim: int, linear_gaussian: bool, entries=None, params: dict[str, float] | None = None
) -> DefaultMethod:
    """The default for (family, d) — and, among entries measured in several regimes, the model's ``params`` — per
    the module docstring."""
    entries = table() if entries is None else entries
    same = [e for e in entries if e["family"] == family]
    if not same:
        method = "kalman" if linear_gaussian else "smc"
        return DefaultMethod(method, reason=f"{family} was not benchmarked; {method} is the safe default")
    params = params or {}
    nearest_d = min(same, key=lambda e: (abs(e["state_dim"] - state_dim), e["state_dim"]))["state_dim"]
    entry = min((e for e in same if e["state_dim"] == nearest_d), key=lambda e: regime_distance(e, params))
    reason = entry["reason"]
    if regime_distance(entry, params) > EXACT:  # float32 parameters: 0.05 is not exactly 0.05
        measured = ", ".join(f"{k} = {v:g}" for k, v in entry["regime"].items())
        reason = f"as measured at {measured}, the nearest benchmarked regime: {reason}"
    if entry["state_dim"] != state_dim:
        reason = f"as measured at d = {entry['state_dim']}, the nearest benchmarked d: {reason}"
    return DefaultMethod(entry["method"], dict(entry.get("options") or {}), entry.get("num_particles"), reason)


def model_regime(params: dict[str, Any]) -> dict[str, float]:
    """The :data:`REGIME_KEYS` values of a one-stream model's parameters (tensors) that it has."""
    return {k: float(params[k].reshape(-1)[0]) for k in REGIME_KEYS if k in params}


__all__ = ["REGIME_KEYS", "TABLE", "DefaultMethod", "default_method", "model_regime", "regime_distance", "table"]
