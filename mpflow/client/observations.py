"""Observations as the client sends them: numpy arrays, pandas DataFrames and Series, plain lists — checked and
turned into JSON values before anything is sent (docs/API.md, ``POST .../observations``).

* A missing entry is JSON ``null``: numpy/float NaN and ``None`` become ``null`` in an observation's value (a step
  conditions on its observed entries only; a value ``null`` everywhere is a step without a measurement).
* What JSON cannot carry or the API cannot use — ±inf, booleans, strings, other objects — raises
  :class:`~mpflow.client.errors.MpflowError` (``status`` None, code ``invalid_request``) naming the entry,
  ``observations[3][1]: +inf is not a number; send NaN/None for a missing entry``; the ``dt`` and ``u`` of a step
  take finite numbers only (NaN there is not a missing entry: refused too).
* A DataFrame's rows are the steps: its columns in order (or ``columns``: names, or positions when every item is
  an int), and a column named ``dt``, when there is one, is each step's ``dt`` (``{"value": row, "dt": dt}``).
  A Series is one step per element of a one-dimensional observation (``[x]``). pandas is imported only when one
  is passed (the client does not need it).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

from mpflow.client.errors import MpflowError

#: the DataFrame column read as each step's ``dt``
DT_COLUMN = "dt"
#: the keys of a step given as an object (any other dict is a value, e.g. ``logistic``'s ``{"x", "y"}``)
STEP_KEYS = frozenset({"value", "dt", "u"})


def step_lengths(times: Sequence[float]) -> list[float]:
    """Each step's ``dt`` from the times of its readings (one number per reading, in any unit): the differences
    t_m − t_{m−1}, the first step's the median difference (a typical step); [] for fewer than two readings. It
    checks nothing: a caller refuses or clamps a difference that is not positive."""
    diffs = [float(b - a) for a, b in itertools.pairwise(times)]
    return [statistics.median(diffs), *diffs] if diffs else []


def refuse(field: str, what: str) -> MpflowError:
    return MpflowError(None, "invalid_request", f"{field}: {what}")


def _number(value: Any, field: str, missing_ok: bool) -> Any:
    """A number as JSON: ints as ints, finite floats as floats, NaN as ``null`` where a missing entry may stand."""
    if isinstance(value, Integral):
        return int(value)
    number = float(value)
    if math.isnan(number):
        if missing_ok:
            return None
        raise refuse(field, "NaN is not a number here (only an observation's entries may be missing)")
    if math.isinf(number):
        hint = "; send NaN/None for a missing entry" if missing_ok else ""
        raise refuse(field, f"{'+' if number > 0 else '-'}inf is not a number{hint}")
    return number


def json_numbers(value: Any, field: str, missing_ok: bool = True) -> Any:
    """``value`` (numbers, lists, tuples, dicts, numpy arrays and scalars, anything with ``tolist()``) as JSON
    values; NaN and None as ``null`` when ``missing_ok``, else refused; anything else refused naming ``field``."""
    if value is None:
        if missing_ok:
            return None
        raise refuse(field, "null is not a number here")
    if isinstance(value, bool | np.bool_):
        raise refuse(field, f"a boolean ({value}) is not a number; send 0/1")
    if isinstance(value, str | bytes):
        raise refuse(field, f"a string ({str(value)[:40]!r}) is not a number")
    if isinstance(value, Real):
        return _number(value, field, missing_ok)
    if isinstance(value, dict):
        return {str(k): json_numbers(v, f"{field}.{k}", missing_ok) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_numbers(v, f"{field}[{i}]", missing_ok) for i, v in enumerate(value)]
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return json_numbers(value.tolist(), field, missing_ok)
    raise refuse(field, f"a value of type {type(value).__name__!r} is not a number or a list of numbers")


def step_json(item: Any, field: str) -> Any:
    """One step as JSON: a value (missing entries as ``null``), or ``{"value", "dt", "u"}`` (``dt``, ``u``
    finite numbers)."""
    if isinstance(item, dict) and "value" in item and set(item) <= STEP_KEYS:
        return {k: json_numbers(v, f"{field}.{k}", missing_ok=k == "value") for k, v in item.items()}
    return json_numbers(item, field)


def steps_json(items: Iterable[Any], field: str = "observations") -> list[Any]:
    """Every step of ``items`` as JSON (:func:`step_json`), named ``{field}[i]``."""
    return [step_json(item, f"{field}[{i}]") for i, item in enumerate(items)]


def _is_pandas(value: Any, kind: str) -> bool:
    """Whether ``value`` is a pandas ``kind`` ("DataFrame" or "Series"), without importing pandas."""
    cls = type(value)
    return cls.__module__.startswith("pandas") and any(c.__name__ == kind for c in cls.__mro__)


def is_table(observations: Any) -> bool:
    return _is_pandas(observations, "DataFrame") or _is_pandas(observations, "Series")


def _selected(frame: Any, columns: Sequence[Any] | None) -> Any:
    """The value columns of ``frame``: ``columns`` by name, or by position when every item is an int; without
    ``columns``, every column but ``dt``."""
    if columns is None:
        return frame.drop(columns=[DT_COLUMN]) if DT_COLUMN in frame.columns else frame
    columns = list(columns)
    if columns and all(isinstance(c, Integral) and not isinstance(c, bool) for c in columns):
        bad = [c for c in columns if not -frame.shape[1] <= c < frame.shape[1]]
        if bad:
            raise refuse("columns", f"position {bad[0]} is outside the DataFrame's {frame.shape[1]} columns")
        return frame.iloc[:, columns]
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise refuse("columns", f"{missing[0]!r} is not a column of the DataFrame (its columns: {list(frame.columns)})")
    return frame.loc[:, columns]


def _floats(frame: Any, field: str) -> Any:
    """``frame``'s values as a float array (missing values NaN), or refused naming ``field``."""
    try:
        return frame.to_numpy(dtype=float, na_value=float("nan"))
    except (TypeError, ValueError) as exc:
        raise refuse(field, f"the DataFrame's values must be numbers ({exc})") from None


def table_steps(observations: Any, columns: Sequence[Any] | None = None) -> list[Any]:
    """The steps of a DataFrame (its rows; ``{"value": row, "dt": dt}`` where it has a ``dt`` column) or a Series
    (``[x]`` per element), as numpy rows, not yet checked (:func:`steps_json` does)."""
    if _is_pandas(observations, "Series"):
        if columns is not None:
            raise refuse("columns", "a Series has no columns (it is one entry per step)")
        return [[x] for x in _floats(observations, "observations")]
    rows = list(_floats(_selected(observations, columns), "columns"))
    if DT_COLUMN not in observations.columns:
        return rows
    dts = _floats(observations[DT_COLUMN], DT_COLUMN)
    return [{"value": row, "dt": dt} for row, dt in zip(rows, dts, strict=True)]


def update_body(
    observations: Sequence[Any],
    seq: int | None,
    return_samples: int,
    per_step_params: bool = False,
    levels: Sequence[float] | None = None,
    per_step_cov: bool = False,
) -> dict[str, Any]:
    """The body of ``POST /v1/streams/{id}/observations`` — and the frame of the stream WebSocket — for ``observations``
    (each step checked and encoded by :func:`steps_json`), ``seq``, ``return_samples``, ``per_step_params``,
    ``levels`` and ``per_step_cov`` (each sent when set)."""
    body: dict[str, Any] = {"observations": steps_json(observations)}
    if seq is not None:
        body["seq"] = seq
    if return_samples:
        body["return_samples"] = return_samples
    if per_step_params:
        body["per_step_params"] = True
    if levels is not None:
        body["levels"] = [float(q) for q in levels]
    if per_step_cov:
        body["per_step_cov"] = True
    return body
