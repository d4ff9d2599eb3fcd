"""The methods and models of streams: which method a new stream gets, and the updater and model a stored stream
runs with — built once and cached (updaters per method, operator and stream options; models per JSON spec; neither
is mutated).

The updater cache is an LRU of ``Settings.updater_cache_size`` entries (``MPFLOW_UPDATER_CACHE_SIZE``, default 64):
every distinct ``method_options`` of a stream is a key, so a client creating streams with ever new options grew it
without end (issue 34: +43 KB per option set, never released). An evicted updater is rebuilt at its stream's next
update (microseconds without an operator; an operator's network stays cached by :mod:`mpflow.operators.updaters.mpf`).

A request that names no method gets the one ``benchmarks/equal_compute.py`` measured most accurate for its
(family, d) (:mod:`mpflow.service.engine.default_methods`), with that method's measured options (``mpf``'s ``substeps``)
and particle count, and the stream keeps the reason. Updaters get the options of ``Settings.method_options`` for
their method, then the stream's own (``method_options`` in its metadata); ``mpf`` loads its trained operator from
the operator catalogue's folder (the first use of an operator reads it from disk, hence :meth:`Methods.loaded`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.registry import NAME_RE
from mpflow.operators.updaters import UPDATERS, Updater, get_updater
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.default_methods import default_method, model_regime
from mpflow.service.errors import invalid
from mpflow.service.schemas import CreateStreamRequest
from mpflow.service.settings import Settings
from mpflow.service.stream_errors import OperatorUnavailableError, StoredModelInvalidError

_MODEL_CACHE_SIZE = 4096


def check_method_options(options: dict[str, dict[str, Any]]) -> None:
    """Fail at start, naming the field, on unknown methods or options in ``Settings.method_options``."""
    for method, opts in options.items():
        try:
            get_updater(method, **opts)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"method_options.{method}: {exc}") from None


@dataclass(frozen=True)
class Choice:
    """The method of a new stream: its operator (``mpf``), the stream's own options, the particle count to use
    when the request gives none, and why the server chose it (None when the request named the method)."""

    method: str
    operator: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    num_particles: int | None = None
    reason: str | None = None


def check_stream_options(method: str, options: dict[str, Any]) -> None:
    """422 naming the field for options a client may not set on its stream (``Updater.stream_options``) or whose
    values the method refuses."""
    allowed = UPDATERS[method].stream_options
    refused = sorted(set(options) - allowed)
    if refused:
        hint = f"it accepts {sorted(allowed)}" if allowed else "it takes none"
        raise invalid(f"method_options: {refused} cannot be set per stream for {method}; {hint}")
    try:
        get_updater(method, **options)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise invalid("method_" + message if message.startswith("options.") else f"method_options: {message}") from None


def options_key(options: dict[str, Any] | None) -> str:
    """A stream's own method options as part of an updater's cache (and micro-batch) key."""
    return json.dumps(options, sort_keys=True) if options else ""


def updater_key(meta: dict[str, Any]) -> tuple[str, str | None, str]:
    """The cache and micro-batch key of a stored stream's updater: (method, operator, options)."""
    return meta["method"], meta.get("operator"), options_key(meta.get("method_options"))


def capabilities(meta: dict[str, Any]) -> dict[str, bool] | None:
    """What a stored stream's method does under the stream's own options (:meth:`Updater.capabilities_with`: a
    weighted cloud, exact, forecasts, ...), as its document publishes it; None for a method this server does not
    know."""
    method = UPDATERS.get(meta["method"])
    return None if method is None else method.capabilities_with(meta.get("method_options") or {})


def weighted(meta: dict[str, Any]) -> bool:
    """Whether a stored stream's particles carry weights under its own options (``mpf`` with ``flow_fraction:
    "auto"`` does, ``mpf`` without it does not: :func:`capabilities`); a method this server does not know: assume
    so."""
    caps = capabilities(meta)
    return True if caps is None else caps["weighted"]


class LRU:
    """At most ``size`` updaters by key, the least recently used dropped first; safe to share between the event
    loop and the engine's worker threads (one lock around each operation)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Updater] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Updater | None:
        with self._lock:
            updater = self._items.get(key)
            if updater is not None:
                self._items.move_to_end(key)
            return updater

    def put(self, key: Hashable, updater: Updater) -> None:
        with self._lock:
            self._items[key] = updater
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class Methods:
    """Updaters and models of streams, cached (module docstring)."""

    def __init__(self, settings: Settings, operators: OperatorCatalogue) -> None:
        self.settings = settings
        self.operators = operators
        self._updaters = LRU(settings.updater_cache_size)
        self._models: dict[str, ModelFamily] = {}

    def loaded(self, meta: dict[str, Any]) -> bool:
        """Whether :meth:`updater` has a stored stream's updater already (else building it may read an operator
        from disk)."""
        return updater_key(meta) in self._updaters

    def updater(self, method: str, operator: str | None, options: dict[str, Any] | None = None) -> Updater:
        """A cached updater per (method, operator name, the stream's options); mpf loads the operator from its
        folder."""
        key = (method, operator, options_key(options))
        updater = self._updaters.get(key)
        if updater is None:
            if operator is None:
                updater = self._configured(method, options)
            else:
                record = self.operators.by_name(operator)
                if record is None:
                    raise OperatorUnavailableError(
                        f"operator: {operator!r} is not installed on this server; GET /v1/operators lists them"
                    )
                updater = self._configured(method, {**(options or {}), "operator": str(record.path)})
            self._updaters.put(key, updater)
        return updater

    def _configured(self, method: str, options: dict[str, Any] | None) -> Updater:
        """A new updater of ``method`` with this server's options for it (``MPFLOW_METHOD_OPTIONS``) under the
        stream's ``options``."""
        return get_updater(method, **{**self.settings.method_options.get(method, {}), **(options or {})})

    def uniform_weight_updater(self, method: str) -> tuple[Updater, Hashable]:
        """(updater, engine key) of ``method`` configured to return uniformly weighted particles
        (:attr:`~mpflow.operators.updaters.Updater.uniform_weight_options`), for a stream that reads its particles
        unweighted; the plain updater of a method whose particles are always uniform."""
        if not UPDATERS[method].weighted:
            return self.updater(method, None), (method, None)
        key = (method, "uniform-weights")
        updater = self._updaters.get(key)
        if updater is None:
            options = {**self.settings.method_options.get(method, {}), **UPDATERS[method].uniform_weight_options}
            updater = get_updater(method, **options)
            self._updaters.put(key, updater)
        return updater, key

    def model(self, spec: dict[str, Any], state_dim: int, dtype: torch.dtype = torch.float32) -> ModelFamily:
        """The validated one-stream model in ``dtype`` (the method's ``Updater.model_dtype``: float64 for ``kalman``
        and ``ukf``), cached by its JSON: models are never mutated."""
        key = json.dumps([spec["family"], spec.get("params") or {}, state_dim, str(dtype)], sort_keys=True)
        model = self._models.get(key)
        if model is None:
            model = make_model(spec["family"], spec.get("params") or {}, state_dim, dtype)
            if len(self._models) >= _MODEL_CACHE_SIZE:
                self._models.clear()
            self._models[key] = model
        return model

    def choose(self, req: CreateStreamRequest, model: ModelFamily) -> Choice:
        """The method of a new stream per docs/API.md: the one named (mpf with the newest fitting operator, or the
        one named), else the measured default of :mod:`mpflow.service.engine.default_methods`; the request's
        ``method_options`` over the choice's own."""
        choice = self._choose(req, model)
        if UPDATERS[choice.method].unknown_params and not model.unknown:
            raise invalid(
                f"method: {choice.method} learns unknown model parameters; give at least one of model.params as a "
                'prior ({"prior": {"type": "lognormal", "mean": 0, "sd": 1}}), or use another method'
            )
        if not req.method_options:
            return choice
        options = {**choice.options, **req.method_options}
        check_stream_options(choice.method, options)
        operator = choice.operator
        if operator is not None and req.operator is None and not UPDATERS["mpf"].runs_operator(options):
            operator = None  # an operator this server picked, which the stream's options rule out: the base flow
        return Choice(choice.method, operator, options, choice.num_particles, choice.reason)

    def _choose(self, req: CreateStreamRequest, model: ModelFamily) -> Choice:
        method = req.method
        if req.operator is not None:
            if method not in (None, "mpf"):
                raise invalid(f"operator: only used by method mpf, not {method}")
            if not NAME_RE.match(req.operator):  # one answer for any path, whether or not it exists
                raise invalid(
                    "operator: expected a registered operator name <family>-d<d>-v<k> (GET /v1/operators lists "
                    "them); paths and other names are not accepted"
                )
            if self.operators.by_name(req.operator) is None:
                raise invalid(f"operator: unknown operator {req.operator!r}; GET /v1/operators lists them")
            return Choice("mpf", req.operator)
        if method is None and model.unknown:
            return self._learning(model)
        if method is None:
            return self.default(model, req.method_options)
        if method == "mpf":  # a trained operator when one fits; else the untrained (Daum–Huang) base flow
            return Choice("mpf", self._fitting_operator(model))
        return Choice(method)

    @staticmethod
    def _learning(model: ModelFamily) -> Choice:
        """The method of a model with unknown parameters (given as priors): the one that learns them, ``smc2``, with
        the particle count (θ × x) ``benchmarks/params.py`` measured for an exact (Kalman) or particle inner filter."""
        smc2 = UPDATERS["smc2"]
        names = ", ".join(sorted(model.unknown))
        reason = (
            f"model.params {names} given as priors: smc2 learns them with the state (SMC² with nested-filter "
            "jittering, the bounded rejuvenation measured best in benchmarks/params.py)"
        )
        return Choice("smc2", None, {}, smc2.default_particles(model), reason)

    def _fitting_operator(self, model: ModelFamily) -> str | None:
        record = self.operators.find(model.name, model.state_dim)
        return record.name if record is not None else None

    def default(self, model: ModelFamily, requested: dict[str, Any] | None = None) -> Choice:
        """The measured default for ``model`` (:mod:`mpflow.service.engine.default_methods`), or ``smc`` where the
        default's options, under the ``requested`` ones, cannot run the model's parameters (measured at the benchmark's:
        lorenz96's measured flow_fraction needs a linear observation, which arctan is not)."""
        dm = default_method(model.name, model.state_dim, model.linear_gaussian, params=model_regime(model.params))
        options = {k: v for k, v in dm.options.items() if k != "operator"}
        try:
            default = self._configured(dm.method, {**options, **(requested or {})})
        except ValueError:
            default = None  # options the method refuses: choose() names them, against the measured default
        try:
            if default is not None:
                default.check_compatible(model)
        except ValueError as exc:
            reason = f"{dm.reason}. That default does not run these parameters ({exc}), so smc, the safe default"
            return Choice("smc", None, {}, None, reason)
        if dm.method != "mpf":
            return Choice(dm.method, None, options, dm.num_particles, dm.reason)
        # the benchmark's operator when this server has it; a newer fitting one otherwise (or the base flow)
        wanted = dm.options.get("operator")
        operator = wanted if wanted and self.operators.by_name(wanted) is not None else None
        if wanted and operator is None:
            operator = self._fitting_operator(model)
        return Choice("mpf", operator, options, dm.num_particles, dm.reason)

    def resolve(self, meta: dict[str, Any]) -> tuple[ModelFamily, Updater]:
        """(model, updater) of a stored stream (blocking when it loads an operator: see :meth:`loaded`)."""
        try:
            model = self.model(meta["model"], meta["state_dim"], UPDATERS[meta["method"]].model_dtype)
        except ValueError as exc:  # a stored model that does not validate on this (stricter) server version
            raise StoredModelInvalidError(str(exc)) from None
        return model, self.updater(meta["method"], meta.get("operator"), meta.get("method_options"))


__all__ = [
    "LRU",
    "Choice",
    "Methods",
    "check_method_options",
    "check_stream_options",
    "options_key",
    "updater_key",
    "weighted",
]
