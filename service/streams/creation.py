"""A new stream: its request checked against the server's limits, the prior and model validated, the method chosen,
and the step-0 state drawn — before anything is written.

Validation errors of the operators package (``ValueError("field: ...")``: shapes against the family,
positive-definite covariances, method/model compatibility) are answered 422 with that message; a prior whose
particles or summary are not finite in float32 is refused the same way.
"""

from __future__ import annotations

import functools
import secrets
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import Prior, prior_from_spec
from mpflow.operators.state import ParticleState
from mpflow.operators.trained_operators import operator_domain, outside_domain
from mpflow.operators.updaters import UPDATERS, Updater
from mpflow.service.engine import anomaly
from mpflow.service.engine import summary as summaries
from mpflow.service.engine.methods import Choice, Methods
from mpflow.service.engine.numerics import finite_state, within_float32
from mpflow.service.engine.stepping import check_learning_time
from mpflow.service.errors import invalid, too_large
from mpflow.service.schemas import MAX_STATE_NAME_LENGTH, CreateStreamRequest
from mpflow.service.settings import Settings
from mpflow.service.streams import costs, pit
from mpflow.service.streams.documents import now

#: particles of a stream whose request names no count, whose prior is not a particle set and whose method was named
#: (a default method comes with the count it was measured with)
DEFAULT_PARTICLES = 256


def prior_dim_and_count(spec: dict[str, Any]) -> tuple[int, int | None]:
    """(state dimension, particle count of a particles prior) read off the prior's JSON, for the limits."""
    if spec["type"] == "sampler":  # its dimension is known once it is resolved (prior_from_spec checks it)
        return 0, None
    rows = {"gaussian": "mean", "particles": "particles", "mixture": "means"}[spec["type"]]
    value = spec[rows]
    if spec["type"] == "gaussian":
        return len(value), None
    d = len(value[0]) if value and isinstance(value[0], list) else 0
    return d, (len(value) if spec["type"] == "particles" else None)


def stored_prior(spec: dict[str, Any], n: int) -> dict[str, Any]:
    """The prior as the stream keeps it (for its snapshot, ``GET .../export``): the request's spec, except that a
    ``particles`` prior keeps its size only — the particles themselves are the step-0 state."""
    if spec["type"] == "particles":
        return {"type": "particles", "num_particles": n, "state_dim": len(spec["particles"][0])}
    return spec


def check_state_names(names: object, d: int) -> list[str] | None:
    """``names`` as a stream keeps them: None, or exactly ``d`` distinct non-empty strings of at most
    :data:`MAX_STATE_NAME_LENGTH` characters; anything else is a ``ValueError`` naming ``state_names``."""
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"state_names: a list of {d} strings, one per state dimension, or null")
    if len(names) != d:
        raise ValueError(f"state_names: the state has {d} dimensions, give {d} names (got {len(names)})")
    bad = [n for n in names if not 0 < len(n) <= MAX_STATE_NAME_LENGTH]
    if bad:
        raise ValueError(
            f"state_names: each name must have 1 to {MAX_STATE_NAME_LENGTH} characters, got {bad[0][:80]!r}"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"state_names: the names must be distinct; {repeated[0]!r} is given more than once")
    return list(names)


def state_size(state: ParticleState) -> int:
    """The bytes of a stream's tensors as the store keeps them (the stream document's ``state_bytes``; the encoding
    adds a header of a few hundred bytes). Fixed for the stream's life: no method's state grows with its steps."""
    return sum(t.numel() * t.element_size() for t in state.fields().values())


def check_limits(settings: Settings, n_particles: int, state_dim: int) -> None:
    """413 for more particles or a larger state than the server allows."""
    if n_particles > settings.max_particles:
        raise too_large(f"num_particles: at most {settings.max_particles} (MPFLOW_MAX_PARTICLES), got {n_particles}")
    if state_dim > settings.max_state_dim:
        raise too_large(
            f"prior: state dimension at most {settings.max_state_dim} (MPFLOW_MAX_STATE_DIM), got {state_dim}"
        )


def check_work(
    settings: Settings, model: ModelFamily, updater: Updater, prior: Prior, n: int, method: str
) -> costs.Cost:
    """The creation's estimated cost; 413 before any tensor work for a stream whose steps integrate in too many
    sub-steps, or whose creation is over the cost model's budget (:mod:`mpflow.service.streams.costs`; the field:
    ``num_particles``)."""
    costs.check_substeps(settings, model, 1.0, None)
    what = f"creating a {model.name} stream run by {method} with d = {model.state_dim}"
    return costs.check(settings, "num_particles", n, lambda m: costs.creation_cost(model, updater, prior, m), what)


def check_smoothing(settings: Settings, model: ModelFamily, updater: Updater, n: int, lag: int, method: str) -> None:
    """413 naming ``smoothing_lag`` for a window whose bytes (held while a request steps the stream) or whose
    ``GET .../smoothed`` is over the cost model's budget, with the largest lag that fits; 422 for a method without a
    smoother (:mod:`mpflow.operators.smoothing`)."""
    if lag == 0:
        return
    if not updater.smoothing:
        raise invalid(updater.smoothing_refusal())
    what = f"a smoothing window of {lag} steps of this {method} stream (N = {n}, d = {model.state_dim})"
    window = functools.partial(costs.smoothing_cost, model, updater, n)
    costs.check(settings, "smoothing_lag", lag, window, what, "; lower smoothing_lag or num_particles")


def model_dtype(method: str | None) -> torch.dtype:
    """The dtype a stream's model is built in before its method is chosen: the named method's
    (``Updater.model_dtype``: float64 for ``kalman`` and ``ukf``), so that it is built once; float32 for a default
    choice (rebuilt only when the default is a float64 method: choosing needs a model, and a float64 model must be
    parsed from the JSON in float64, not cast up from float32)."""
    named = UPDATERS.get(method) if method else None
    return named.model_dtype if named is not None else torch.float32


def smoothing_default(settings: Settings, model: ModelFamily, updater: Updater, prior: Prior, n: int, lag: int) -> int:
    """The particle count of a new stream that names none: ``n``, or for a smoothing stream (``lag`` ≥ 1) of a
    Monte Carlo method its measured ``Updater.smoothing_particles`` (docs/methods.md "Fixed-lag smoothing") — within
    the server's particle limit and the largest count at which every request of the stream fits the cost budgets:
    its creation (:func:`check_work`), a one-step observation with its window (:func:`costs.observations_cost`) and
    its window's bytes and ``/smoothed`` (:func:`costs.smoothing_cost`). Never below ``n``: a count over the budget
    is refused by those checks, naming ``num_particles`` or ``smoothing_lag``."""
    want = min(updater.smoothing_particles or 0, settings.max_particles)
    if lag == 0 or not updater.smoothing or want <= n:
        return n
    fits = costs.largest(settings, want, lambda m: costs.smoothing_stream_cost(model, updater, prior, m, lag))
    return max(n, fits)


def operator_domain_check(methods: Methods, choice: Choice, model: ModelFamily, prior: Prior) -> dict | None:
    """``{"inside": bool, "outside": [what lies outside, …]}`` for a stream run by a trained operator: its
    model and prior against the region the operator was trained on
    (:func:`~mpflow.operators.trained_operators.operator_domain`); None without an operator. The mean and covariance of
    the prior are what is compared (a mixture's or a particle set's overall moments). A network the method runs by
    name (:attr:`~mpflow.operators.updaters.base.Updater.learned_options`: ``ienkf``'s ``relock`` observer or
    ``correction``) counts as its trained operator here."""
    updater = UPDATERS.get(choice.method)
    learned = [choice.options.get(k) for k in (updater.learned_options if updater else ())]
    name = choice.operator or next((v for v in learned if isinstance(v, str)), None)
    record = methods.operators.by_name(name) if name else None
    if record is None:
        return None
    mean, cov = prior.moments()
    outside = outside_domain(model, operator_domain(record), mean[0], cov[0])
    return {"inside": not outside, "outside": outside}


def prepare(
    settings: Settings, methods: Methods, req: CreateStreamRequest
) -> tuple[dict[str, Any], ParticleState, dict[str, Any]]:
    """Validate and initialise a stream (blocking tensor work): (meta, state at step 0, summary)."""
    spec = req.prior.model_dump()
    d, given = prior_dim_and_count(spec)
    asked = req.num_particles or given
    check_limits(settings, asked or DEFAULT_PARTICLES, d)
    try:
        prior = prior_from_spec(spec, dirs=methods.operators.dirs)  # a sampler by its registered name only
        model_spec = req.model.model_dump()
        model = methods.model(model_spec, prior.dim, model_dtype(req.method))
        check_learning_time(model)  # unknown parameters with a model for steps of any dt: refused now, not per step
        choice = methods.choose(req, model)
        # the particle count the default was measured with, within this server's limit
        n = asked or min(choice.num_particles or DEFAULT_PARTICLES, settings.max_particles)
        updater = methods.updater(choice.method, choice.operator, choice.options)
        if updater.model_dtype != model_dtype(req.method):  # a default choice of kalman or ukf: float64
            model = methods.model(model_spec, prior.dim, updater.model_dtype)
        if not asked:
            n = smoothing_default(settings, model, updater, prior, n, req.smoothing_lag)
        updater.check_compatible(model, prior)
        names = check_state_names(req.state_names, prior.dim)
        domain = operator_domain_check(methods, choice, model, prior)
        check_work(settings, model, updater, prior, n, choice.method)
        check_smoothing(settings, model, updater, n, req.smoothing_lag, choice.method)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        state = updater.init(prior, model, n, seed, smoothing_lag=req.smoothing_lag)
    except ValueError as exc:
        message = str(exc)  # an updater names its option as options.NAME: the request's field is method_options.NAME
        raise invalid("method_" + message if message.startswith("options.") else message) from None
    summary = summaries.summary(state)
    if not (finite_state(state) and within_float32(summary)):  # e.g. a prior at the edge of float32's range
        raise invalid(
            "prior: the initial particles or their summary are not finite in float32 (|x| up to about 3.4e38, "
            "squares included); rescale the prior"
        )
    created = now()
    record = methods.operators.by_name(choice.operator) if choice.operator else None
    meta = {
        "model": model_spec,
        "prior": stored_prior(spec, n),
        "method": choice.method,
        "operator": choice.operator,
        "operator_content_hash": record.content_hash if record is not None else None,
        "method_options": choice.options,
        "method_reason": choice.reason,
        "operator_domain": domain,
        "num_particles": n,
        "state_bytes": state_size(state),
        "state_dim": prior.dim,
        "state_names": names,
        "seed": seed,
        "smoothing_lag": req.smoothing_lag,
        "pit_alert": req.pit_alert if req.pit_alert is not None else pit.DEFAULT_PIT_ALERT,
        "anomaly_memory": req.anomaly_memory or 0,
        "anomaly_warmup": req.anomaly_warmup if req.anomaly_warmup is not None else anomaly.DEFAULT_WARMUP,
        "ttl_seconds": req.ttl_seconds or settings.default_ttl_seconds,
        "step": 0,
        "log_evidence": 0.0,
        "created_at": created,
        "updated_at": created,
    }
    return meta, state, summary


__all__ = [
    "DEFAULT_PARTICLES",
    "check_limits",
    "check_smoothing",
    "check_state_names",
    "check_work",
    "model_dtype",
    "prepare",
    "prior_dim_and_count",
    "smoothing_default",
    "state_size",
    "stored_prior",
]
