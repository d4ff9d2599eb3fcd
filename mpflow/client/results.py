"""What the Python client (:mod:`mpflow.client.http`) sends and gets, in numpy's terms.

* :func:`jsonable` — a request body or query with numpy arrays and scalars (or torch tensors: anything with
  ``tolist()``) anywhere in it, as plain JSON values;
* :class:`Posterior` — a stream document or an observation answer: the ``dict`` the API sends, plus numpy views of
  its summary (``mean``, ``std``, ``cov``, ``quantiles``, ...), its per-step summaries (:attr:`Posterior.steps`)
  and a per-dimension table (:meth:`Posterior.to_pandas`);
* :class:`StepTable` — per-step summaries (the ``per_step`` of one answer, or of many: :meth:`StepTable.of`) as
  numpy arrays, and as a pandas ``DataFrame`` where pandas is installed (it is optional: nothing else needs it);
* :class:`History` — a stream's kept history (``GET .../history``): its steps' summaries and observations;
* :class:`Smoothed` — a stream's fixed-lag smoothed marginals (``GET .../smoothed``) as numpy arrays and a table;
* :func:`forecast_arrays`, :func:`particles_arrays` — the answers of ``GET .../forecast`` and ``.../particles``
  with their numbers as numpy arrays (the same keys and shapes as the API's JSON).

Dimensions are named by the stream's ``state_names`` where the document carries them, else ``x0, x1, ...``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


def jsonable(value: Any) -> Any:
    """``value`` with every numpy array or scalar (anything with ``tolist()``) turned into lists and Python
    numbers, and tuples into lists; dicts and lists are copied, other values kept."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return value.tolist()
    return value


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError("to_pandas() needs pandas, which mpflow does not install: pip install pandas") from None
    return pandas


def state_names(document: dict[str, Any], dim: int) -> list[str]:
    """The names of the state's dimensions: the document's ``state_names`` when it has ``dim`` of them, else
    ``x0 .. x{dim-1}``."""
    names = document.get("state_names")
    if isinstance(names, list) and len(names) == dim:
        return [str(n) for n in names]
    return [f"x{i}" for i in range(dim)]


#: the statistics of a learned parameter's posterior in ``summary.params`` (docs/API.md "Unknown parameters")
PARAM_STATS = ("mean", "sd", "q025", "q05", "q95", "q975")


def _param_arrays(entries: Sequence[dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """``{name: {stat: [n]}}`` of the learned parameters of n summaries or per-step entries (empty without any; NaN
    for an entry without them: an answer gives them per step only when asked, ``per_step_params``)."""
    names = sorted({n for e in entries for n in e.get("params") or {}})
    return {
        n: {
            s: np.array([(e.get("params") or {}).get(n, {}).get(s, np.nan) for e in entries], dtype=np.float64)
            for s in PARAM_STATS
        }
        for n in names
    }


def _with_last_params(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """An answer's ``per_step`` entries, the last one given the answer's ``summary.params`` where it has none: the
    posterior after the answer's last step (an answer gives it per step only when asked, ``per_step_params``)."""
    per_step = list(answer.get("per_step") or [])
    params = (answer.get("summary") or {}).get("params")
    if per_step and params is not None and "params" not in per_step[-1]:
        per_step[-1] = {**per_step[-1], "params": params}
    return per_step


#: the decimals a quantile level is written with in the API's keys (the service's ``LEVEL_DECIMALS``)
LEVEL_DECIMALS = 6


def level_key(level: float | str) -> str:
    """A quantile level as the API's JSON keys write it, ``"0.975"``: its decimal digits, no trailing zeros (a
    string is taken as it is)."""
    if isinstance(level, str):
        return level
    return f"{float(level):.{LEVEL_DECIMALS}f}".rstrip("0").rstrip(".")


class Quantiles(dict):
    """Marginal quantiles per level, keyed as in the API's JSON — ``{"0.025": array, ..., "0.975": array}`` — where
    a number finds the same entry: ``q[0.975]`` is ``q["0.975"]``."""

    def __getitem__(self, level: Any) -> Any:
        return super().__getitem__(level_key(level))

    def __contains__(self, level: object) -> bool:
        return isinstance(level, str | int | float) and super().__contains__(level_key(level))  # type: ignore[arg-type]

    def get(self, level: Any, default: Any = None) -> Any:
        return super().get(level_key(level), default)


def _quantile_arrays(per_step: Sequence[dict[str, Any]], dim: int) -> Quantiles:
    """``{level: [n, d]}`` of the steps' quantiles (NaN where a step has none at that level)."""
    levels = sorted({k for s in per_step for k in s.get("quantiles") or {}}, key=float)
    nan = [np.nan] * dim
    return Quantiles(
        {
            q: np.array([(s.get("quantiles") or {}).get(q, nan) for s in per_step], dtype=np.float64).reshape(
                len(per_step), dim
            )
            for q in levels
        }
    )


def pit_array(per_step: Sequence[dict[str, Any]], field: str = "pit") -> np.ndarray:
    """The steps' predictive p-values [n, k] (NaN where an entry was not observed or a step has none); ``field``:
    another per-entry list of the steps (``log_tail_lower``, ``log_tail_upper``)."""
    k = max((len(s.get(field) or []) for s in per_step), default=0)
    rows = [[np.nan if u is None else u for u in (s.get(field) or [])] for s in per_step]
    return np.array([r + [np.nan] * (k - len(r)) for r in rows], dtype=np.float64).reshape(len(per_step), k)


def two_sided(pit: np.ndarray) -> np.ndarray:
    """The two-sided p-values 2 min(u, 1 − u) of predictive p-values u (NaN stays NaN): the API's ``pit_two_sided``,
    what to threshold — below the stream's ``pit_alert`` α exactly where it flags the entry."""
    return 2.0 * np.minimum(pit, 1.0 - pit)


def _number(value: Any) -> float:
    """A per-step number of the API as a float: NaN for null or absent."""
    return np.nan if value is None else float(value)


class StepTable:
    """Per-step posterior summaries as arrays: ``step`` [n], ``mean`` and ``std`` [n, d], ``ess`` [n] (NaN for
    ``kalman`` and ``ukf``, whose ESS is null),
    ``log_evidence_increment`` [n] (NaN where a step did not report one), ``log_evidence_sd`` [n] (its standard
    error where the method reports one — ``mpf``'s marginal filter —, else NaN), ``pit`` [n, k] (each observed
    entry's predictive p-value, NaN where not observed; entries named by their index j in the observation, as the
    table's ``pit_<j>`` columns), ``pit_two_sided`` [n, k] (2 min(pit, 1 − pit): the p-value to threshold),
    ``log_tail_lower`` and ``log_tail_upper`` [n, k] (ln P(O_j ≤ o_j | before) and ln P(O_j ≥ o_j | before), which do
    not saturate where pit does), ``surprise`` [n] (nats), ``anomaly_score`` [n] (in [0, 1]: the step's surprise
    ranked among the stream's earlier steps', or its change_score where larger; NaN during the stream's warm-up and
    where a step has none) and ``change_score`` [n] (the rank of the change CUSUMs as they rise),
    ``quantiles`` — ``{level: [n, d]}``, keyed as in the API
    (``"0.975"``; a number finds the same entry), NaN where a step has none —, ``cov`` [n, d, d] where the answers
    carry each step's covariance (``per_step_cov``; else None), ``names`` of the d dimensions, and ``params`` —
    ``{name: {"mean", "sd", "q025", "q05", "q95", "q975": [n]}}`` — for a stream that learns unknown parameters:
    every step's where the answers were asked for them (``per_step_params``), else each answer's last step's (from
    its summary) and NaN at the others."""

    def __init__(self, per_step: Sequence[dict[str, Any]], names: Sequence[str] | None = None):
        dim = len(per_step[0]["mean"]) if per_step else len(names or [])
        self.names = list(names) if names is not None else [f"x{i}" for i in range(dim)]
        self.step = np.array([s["step"] for s in per_step], dtype=np.int64)
        self.mean = np.array([s["mean"] for s in per_step], dtype=np.float64).reshape(len(per_step), dim)
        self.std = np.array([s["std"] for s in per_step], dtype=np.float64).reshape(len(per_step), dim)
        self.ess = np.array([_number(s.get("ess")) for s in per_step], dtype=np.float64)
        increments = [_number(s.get("log_evidence_increment")) for s in per_step]
        self.log_evidence_increment = np.array(increments, dtype=np.float64)
        self.log_evidence_sd = np.array([_number(s.get("log_evidence_sd")) for s in per_step], dtype=np.float64)
        self.params = _param_arrays(per_step)
        self.pit = pit_array(per_step)
        self.pit_two_sided = two_sided(self.pit)
        self.log_tail_lower = pit_array(per_step, "log_tail_lower")
        self.log_tail_upper = pit_array(per_step, "log_tail_upper")
        self.surprise = np.array([_number(s.get("surprise")) for s in per_step], dtype=np.float64)
        self.anomaly_score = np.array([_number(s.get("anomaly_score")) for s in per_step], dtype=np.float64)
        self.change_score = np.array([_number(s.get("change_score")) for s in per_step], dtype=np.float64)
        self.quantiles = _quantile_arrays(per_step, dim)
        covs = [s.get("cov") for s in per_step]
        self.cov = (
            np.array([np.full((dim, dim), np.nan) if c is None else c for c in covs], dtype=np.float64).reshape(
                len(per_step), dim, dim
            )
            if any(c is not None for c in covs)
            else None
        )

    @classmethod
    def of(cls, answers: Iterable[dict[str, Any]]) -> StepTable:
        """The steps of several observation answers in order (e.g. everything ``Stream.filter`` yielded)."""
        answers = list(answers)
        per_step = [s for a in answers for s in _with_last_params(a)]
        dim = len(per_step[0]["mean"]) if per_step else 0
        return cls(per_step, state_names(answers[-1], dim) if answers and per_step else None)

    def __len__(self) -> int:
        return len(self.step)

    def __repr__(self) -> str:
        return f"StepTable({len(self)} steps, dimensions {self.names})"

    def to_pandas(self) -> Any:
        """A ``DataFrame`` indexed by step: ``mean_<name>`` and ``std_<name>`` per dimension, ``ess``,
        ``log_evidence_increment`` and ``log_evidence_sd``, ``pit_<j>`` and ``pit_two_sided_<j>`` per observed
        entry j (its index in the observation, whatever the state's names), ``log_tail_lower_<j>`` and
        ``log_tail_upper_<j>`` likewise, ``surprise``, ``anomaly_score`` and ``change_score``, and
        ``param_<name>_<stat>`` per learned parameter (needs pandas)."""
        pd = _pandas()
        columns: dict[str, Any] = {}
        for i, name in enumerate(self.names):
            columns[f"mean_{name}"] = self.mean[:, i]
            columns[f"std_{name}"] = self.std[:, i]
        columns["ess"] = self.ess
        columns["log_evidence_increment"] = self.log_evidence_increment
        columns["log_evidence_sd"] = self.log_evidence_sd
        for name, stats in self.params.items():
            columns |= {f"param_{name}_{s}": v for s, v in stats.items()}
        for j in range(self.pit.shape[1]):
            columns[f"pit_{j}"] = self.pit[:, j]
        for j in range(self.pit.shape[1]):
            columns[f"pit_two_sided_{j}"] = self.pit_two_sided[:, j]
        for field in ("log_tail_lower", "log_tail_upper"):
            tails = getattr(self, field)
            columns |= {f"{field}_{j}": tails[:, j] for j in range(tails.shape[1])}
        columns["surprise"] = self.surprise
        columns["anomaly_score"] = self.anomaly_score
        columns["change_score"] = self.change_score
        return pd.DataFrame(columns, index=pd.Index(self.step, name="step"))


class History(StepTable):
    """A stream's kept history (``GET /v1/streams/{id}/history``) as arrays: the :class:`StepTable` of its steps
    (``steps`` [n] — also ``step`` —, ``mean`` and ``std`` [n, d], ``ess``, ``log_evidence_increment``), and
    ``observations`` (the n observations as posted: lists, numbers or None), ``dt`` [n] (NaN where a step gave
    none); ``stream_id``, ``current_step`` (the stream's step) and ``history_steps`` (the most steps kept)."""

    def __init__(self, answer: dict[str, Any], names: Sequence[str] | None = None):
        entries = answer["steps"]
        dim = len(entries[0]["mean"]) if entries else len(names or [])
        super().__init__(entries, names if names is not None and len(names) == dim else None)
        self.stream_id = str(answer["stream_id"])
        self.current_step = int(answer["step"])
        self.history_steps = int(answer["history_steps"])
        self.observations = [s.get("observation") for s in entries]
        self.dt = np.array([s.get("dt", np.nan) for s in entries], dtype=np.float64)

    @property
    def steps(self) -> np.ndarray:
        """The kept steps' numbers [n] (as ``step``)."""
        return self.step

    def __repr__(self) -> str:
        return f"History({self.stream_id!r}, {len(self)} steps, dimensions {self.names})"

    def to_pandas(self) -> Any:
        """The :meth:`StepTable.to_pandas` table with an ``observation`` column (as posted) and ``dt``."""
        frame = super().to_pandas()
        frame["observation"] = _pandas().Series(self.observations, index=frame.index, dtype=object)
        frame["dt"] = self.dt
        return frame


class Smoothed:
    """The fixed-lag smoothed marginals p(x_s | o_1..t) of ``GET /v1/streams/{id}/smoothed`` as arrays: ``steps``
    [n] (s, oldest first), ``means`` [n, d], ``covs`` [n, d, d], ``std`` [n, d]; ``stream_id``, ``step`` (t),
    ``lag`` (L) and the ``names`` of the d dimensions. ``steps, means, covs = stream.smoothed()`` unpacks it."""

    def __init__(self, answer: dict[str, Any], names: Sequence[str] | None = None):
        rows = answer["steps"]
        dim = len(rows[0]["mean"]) if rows else len(names or [])
        self.names = list(names) if names is not None and len(names) == dim else [f"x{i}" for i in range(dim)]
        self.stream_id = str(answer["stream_id"])
        self.step = int(answer["step"])
        self.lag = int(answer["lag"])
        self.steps = np.array([r["step"] for r in rows], dtype=np.int64)
        self.means = _floats([r["mean"] for r in rows]).reshape(len(rows), dim)
        self.covs = _floats([r["cov"] for r in rows]).reshape(len(rows), dim, dim)
        self.std = np.sqrt(np.clip(np.diagonal(self.covs, axis1=1, axis2=2), 0, None))

    def __iter__(self) -> Any:
        return iter((self.steps, self.means, self.covs))

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        return f"Smoothed({self.stream_id!r}, steps {self.steps.tolist()}, dimensions {self.names})"

    def to_pandas(self) -> Any:
        """A ``DataFrame`` indexed by step: ``mean_<name>`` and ``std_<name>`` per dimension (needs pandas)."""
        pd = _pandas()
        columns: dict[str, Any] = {}
        for i, name in enumerate(self.names):
            columns[f"mean_{name}"] = self.means[:, i]
            columns[f"std_{name}"] = self.std[:, i]
        return pd.DataFrame(columns, index=pd.Index(self.steps, name="step"))


def _floats(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _predictive_arrays(part: dict[str, Any] | None) -> dict[str, Any] | None:
    """One horizon's ``state`` or ``observation``: ``mean`` [d], ``cov`` [d, d], ``quantiles`` {"0.05": [d], ...},
    ``samples`` [n, d] as arrays (None stays None: ``logistic`` has no observation forecast)."""
    if part is None:
        return None
    out = {k: _floats(v) if k in ("mean", "cov", "samples") else v for k, v in part.items()}
    if "quantiles" in out:
        out["quantiles"] = Quantiles({q: _floats(v) for q, v in out["quantiles"].items()})
    return out


def forecast_arrays(answer: dict[str, Any]) -> dict[str, Any]:
    """``GET .../forecast``'s answer with each horizon's ``state`` and ``observation`` as numpy arrays."""
    horizons = [
        {**h, "state": _predictive_arrays(h["state"]), "observation": _predictive_arrays(h.get("observation"))}
        for h in answer["forecast"]
    ]
    return {**answer, "forecast": horizons}


def particles_arrays(answer: dict[str, Any]) -> dict[str, Any]:
    """``GET .../particles``'s answer with ``particles`` [N, d] and ``log_weights`` [N] as numpy arrays."""
    return {**answer, "particles": _floats(answer["particles"]), "log_weights": _floats(answer["log_weights"])}


class Posterior(dict):
    """A stream document or an observation answer, as the API sent it (a ``dict``: ``posterior["summary"]`` works
    as ever), with numpy views of the current posterior."""

    @property
    def step(self) -> int:
        """The stream's step: how many steps it has applied (0 before the first observation)."""
        return int(self["step"])

    @property
    def names(self) -> list[str]:
        """The names of the state's dimensions (``state_names``, else ``x0, x1, ...``)."""
        return state_names(self, len(self["summary"]["mean"]))

    @property
    def mean(self) -> np.ndarray:
        """The posterior mean [d]."""
        return np.asarray(self["summary"]["mean"], dtype=np.float64)

    @property
    def std(self) -> np.ndarray:
        """The posterior's marginal standard deviations [d]."""
        return np.asarray(self["summary"]["std"], dtype=np.float64)

    @property
    def cov(self) -> np.ndarray:
        """The posterior covariance [d, d]."""
        return np.asarray(self["summary"]["cov"], dtype=np.float64)

    @property
    def quantiles(self) -> Quantiles:
        """Marginal quantiles per level, keyed as in the API (``{"0.025": array, "0.05": ..., "0.975": ...}``: the
        bounds of the 95 % and 90 % central intervals and the median by default, or the levels the request asked
        for); a number finds the same entry (``quantiles[0.975]``)."""
        return Quantiles({q: np.asarray(v, dtype=np.float64) for q, v in self["summary"]["quantiles"].items()})

    @property
    def ess(self) -> float:
        """The particles' effective sample size; NaN for ``kalman`` and ``ukf`` (the API's null: a Gaussian, not a
        cloud)."""
        ess = self["summary"].get("ess")
        return float("nan") if ess is None else float(ess)

    @property
    def log_evidence(self) -> float:
        """The estimate of log p(o_1..o_step), the log marginal likelihood of every observation so far."""
        return float(self["summary"]["log_evidence"])

    @property
    def params(self) -> dict[str, dict[str, float]]:
        """The learned parameters' posteriors, ``{name: {"mean", "sd", "q025", "q05", "q95", "q975"}}`` (empty for
        a stream whose parameters are all given as values; NaN for a statistic the server does not give);
        :meth:`params_to_pandas` as a table."""
        return {
            n: {s: float(v.get(s, np.nan)) for s in PARAM_STATS}
            for n, v in (self["summary"].get("params") or {}).items()
        }

    def params_to_pandas(self) -> Any:
        """A ``DataFrame`` with one row per learned parameter: ``mean``, ``sd``, ``q025``, ``q05``, ``q95``,
        ``q975`` (needs pandas)."""
        params = self.params
        frame = _pandas().DataFrame([params[n] for n in params], index=list(params), columns=list(PARAM_STATS))
        frame.index.name = "parameter"
        return frame

    @property
    def pit(self) -> np.ndarray:
        """The latest observed step's predictive p-values [k] (NaN where not observed; empty before any)."""
        return np.array([np.nan if u is None else u for u in self["summary"].get("pit") or []], dtype=np.float64)

    @property
    def pit_two_sided(self) -> np.ndarray:
        """The latest observed step's two-sided p-values 2 min(pit, 1 − pit) [k] (NaN where not observed)."""
        return two_sided(self.pit)

    @property
    def pit_flagged(self) -> bool:
        """Whether the latest p-values are beyond the stream's ``pit_alert`` (two-sided)."""
        return bool(self["summary"].get("pit_flagged", False))

    @property
    def log_tail_lower(self) -> np.ndarray:
        """The latest observed step's ln P(O_j ≤ o_j | before) [k] (NaN where not observed; empty before any)."""
        return np.array([_number(v) for v in self["summary"].get("log_tail_lower") or []], dtype=np.float64)

    @property
    def log_tail_upper(self) -> np.ndarray:
        """The latest observed step's ln P(O_j ≥ o_j | before) [k] (NaN where not observed; empty before any)."""
        return np.array([_number(v) for v in self["summary"].get("log_tail_upper") or []], dtype=np.float64)

    @property
    def surprise(self) -> float:
        """The latest observed step's surprise in nats (NaN before any)."""
        return _number(self["summary"].get("surprise"))

    @property
    def anomaly_score(self) -> float:
        """The latest observed step's anomaly score in [0, 1] (NaN before any, and during the stream's warm-up)."""
        return _number(self["summary"].get("anomaly_score"))

    @property
    def samples(self) -> np.ndarray | None:
        """The draws asked for with ``return_samples`` [n, d], else None."""
        draws = self.get("samples")
        return None if draws is None else np.asarray(draws, dtype=np.float64)

    @property
    def steps(self) -> StepTable:
        """The per-step summaries of this answer (empty for a stream document or a duplicate)."""
        return StepTable(_with_last_params(self), self.names)

    def to_pandas(self) -> Any:
        """A ``DataFrame`` with one row per dimension: ``mean``, ``std`` and each quantile (needs pandas)."""
        pd = _pandas()
        columns = {"mean": self.mean, "std": self.std}
        columns |= {f"q{q}": v for q, v in self.quantiles.items()}
        return pd.DataFrame(columns, index=pd.Index(self.names, name="dimension"))


__all__ = [
    "LEVEL_DECIMALS",
    "PARAM_STATS",
    "History",
    "Posterior",
    "Quantiles",
    "StepTable",
    "forecast_arrays",
    "jsonable",
    "level_key",
    "particles_arrays",
    "state_names",
    "two_sided",
]
