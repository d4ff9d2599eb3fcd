"""Per-step estimates as one flat table: the ``per_step`` entries of observation answers (docs/API.md), one row per
step, one column per number — what ``stream.filter(DataFrame)`` returns and ``mpflow filter --data`` writes.

Columns, in order: ``step`` (the index), then each field of the entries in the order it first appears, flattened:

* a list of the state's d numbers (``mean``, ``std``) → ``mean_<name>`` … per dimension (``state_names``, else
  ``x0, x1, ...``);
* an object → one column per key, ``<field>_<key>`` (``quantiles`` → ``q0.025_<name>``, ``q0.05_<name>``,
  ``q0.5_<name>``, ``q0.95_<name>``, ``q0.975_<name>``; ``{"params": {"R": {"mean", "sd"}}}`` →
  ``params_R_mean``, ``params_R_sd``), recursively;
* any other list → ``<field>_0``, ``<field>_1`` … — the observation's entries' p-values (``pit``,
  ``pit_two_sided``) and log tails (``log_tail_lower``, ``log_tail_upper``) so too, by their index in the
  observation (``pit_0``), never by a state dimension's name, whatever the observation's size; a number, a bool or
  a string → ``<field>`` (``surprise``, ``anomaly_score``).

A field that only some steps carry (``fallback``, ``acceptance``) is empty (NaN / None) on the others. Fields the
service adds later become columns the same way, with nothing here to change. pandas is imported only here (the
client does not need it otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: the columns' prefix for each quantile level of ``quantiles`` (``q0.05_x0``)
QUANTILE_PREFIX = "q"


def _flatten(prefix: str, value: Any, names: Sequence[str], out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, v in value.items():
            _flatten(f"{prefix}_{key}", v, names, out)
    elif isinstance(value, list | tuple):
        labels = names if len(value) == len(names) else [str(i) for i in range(len(value))]
        for label, v in zip(labels, value, strict=True):
            _flatten(f"{prefix}_{label}", v, names, out)
    else:
        out[prefix] = value


#: the fields of a ``per_step`` entry about the observation's entries, not the state's dimensions: their columns are
#: named by index (``pit_0``), never by ``state_names``
OBSERVATION_FIELDS = frozenset({"pit", "pit_two_sided", "log_tail_lower", "log_tail_upper"})


def step_row(entry: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """One ``per_step`` entry as ``{column: value}`` (module docstring), ``step`` included."""
    out: dict[str, Any] = {}
    for field, value in entry.items():
        if field in OBSERVATION_FIELDS:
            _flatten(field, value, (), out)
        elif field == "quantiles" and isinstance(value, dict):
            for level, row in value.items():
                _flatten(f"{QUANTILE_PREFIX}{level}", row, names, out)
        elif field == "step":
            out["step"] = int(value)
        else:
            _flatten(field, value, names, out)
    return out


def steps_frame(per_step: Sequence[dict[str, Any]], names: Sequence[str]) -> Any:
    """The entries as a ``pandas.DataFrame`` indexed by ``step`` (module docstring); ``names``: the state's
    dimensions."""
    import pandas as pd

    rows = [step_row(entry, names) for entry in per_step]
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    frame = pd.DataFrame.from_records(rows, columns=list(columns) or ["step"])
    return frame.set_index("step")


__all__ = ["OBSERVATION_FIELDS", "QUANTILE_PREFIX", "step_row", "steps_frame"]
