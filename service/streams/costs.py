"""The cost model: every request's work and memory estimated from what it asks — before any work — and refused with
413 ``limit_exceeded``, naming the field and the limit, when it is over the server's budget (docs/API.md "Limits").

Three budgets (:class:`~mpflow.service.settings.Settings`):

* ``max_request_flops`` (``MPFLOW_MAX_REQUEST_FLOPS``): the floating-point operations of one request;
* ``max_request_bytes`` (``MPFLOW_MAX_REQUEST_BYTES``): the bytes one request holds at its peak — its tensors and
  its JSON answer (about :data:`JSON_BYTES_PER_NUMBER` per number: a Python float, its list slot and its text);
* ``max_integration_substeps`` (``MPFLOW_MAX_INTEGRATION_SUBSTEPS``): the numerical-integration sub-steps of one
  step (Lorenz-96's RK4: ⌈Δ·dt / h⌉), checked at creation (dt = 1), per observation (its ``dt``) and per forecast.

Who knows what: a model family gives one particle's work (:meth:`ModelFamily.particle_flops`,
:meth:`~ModelFamily.integration_substeps`, :meth:`~ModelFamily.step_model_flops`), a prior its draws'
(``draw_flops``), an updater one step's and one forecast's (:meth:`Updater.step_work`,
:meth:`Updater.forecast_work`: svgd's n² kernel, kalman's d³, enkf's SVD, …); this module adds what the service
does around them (a summary per step, the JSON answer) and compares the total with the budgets.

The functions ``*_cost`` give a request's :class:`Cost` without refusing anything, so other parts of the service
can weigh a job (:func:`share`: the fraction of the budget it uses, ≤ 1 for every accepted request; :func:`heavy`);
:func:`check` refuses, with the largest value of the request's field that fits (:func:`largest`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpflow.operators.models.base import ModelFamily, check_dt, subfield
from mpflow.operators.models.priors import Prior
from mpflow.operators.updaters import Updater
from mpflow.operators.updaters.base import QUANTILE_FLOPS
from mpflow.service.engine.summary import QUANTILES
from mpflow.service.errors import invalid, too_large
from mpflow.service.settings import Settings

#: bytes a number of a JSON answer costs while it is built: a Python float (24), its list slot (8), its text with a
#: separator (about 20) and the encoder's buffers (measured: 78 to 80 bytes per number of the peak RSS for answers of
#: 4 million numbers, ``GET .../particles`` and ``GET .../samples``)
JSON_BYTES_PER_NUMBER = 80
#: the work of one number of a JSON answer (``tolist``, encoding, sending) in floating-point operations' worth:
#: measured, a GET .../particles of 4.3 million numbers takes as long as about 2e10 operations of a step
JSON_FLOPS_PER_NUMBER = 5000.0
#: the numbers of a summary of a d-dimensional state besides its covariance: mean, sd and 5 quantiles per dimension
SUMMARY_NUMBERS_PER_DIM = 7
#: :func:`heavy`'s default threshold: a request using more than this share of a budget
HEAVY_SHARE = 0.1


@dataclass(frozen=True)
class Cost:
    """A request's estimated floating-point operations and peak bytes."""

    flops: float
    bytes: float

    def then(self, other: Cost) -> Cost:
        """This work followed by ``other``: the operations add, the peak is the larger one's."""
        return Cost(self.flops + other.flops, max(self.bytes, other.bytes))

    def plus_bytes(self, extra: float) -> Cost:
        """The same work holding ``extra`` more bytes throughout (an answer being built)."""
        return Cost(self.flops, self.bytes + extra)


def share(settings: Settings, cost: Cost) -> float:
    """The fraction of this server's budget the request uses: the larger of its operations' and its bytes'."""
    return max(cost.flops / settings.max_request_flops, cost.bytes / settings.max_request_bytes)


def heavy(settings: Settings, cost: Cost, threshold: float = HEAVY_SHARE) -> bool:
    """Whether the request uses more than ``threshold`` of a budget (a scheduler's light/heavy split)."""
    return share(settings, cost) > threshold


class Budget:
    """One request's budget shared by several checks — a batch's updates (``POST /v1/observations:batch``), which
    run concurrently: each update's cost takes its :func:`share`, and an update that would take the total past
    the budget is refused (413 naming ``updates``) while those before it run. A retried check of the same update
    (the same ``update`` object) replaces its earlier share."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._shares: dict[int, tuple[object, float]] = {}  # id → (the update, kept alive so ids stay unique; share)

    def spend(self, update: object, cost: Cost) -> None:
        taken = sum(s for k, (_, s) in self._shares.items() if k != id(update))
        mine = share(self.settings, cost)
        if taken + mine > 1.0:
            raise too_large(
                f"updates: this update needs {mine:.0%} of the server's budget for one request "
                f"(MPFLOW_MAX_REQUEST_FLOPS, MPFLOW_MAX_REQUEST_BYTES), of which the batch's other updates already "
                f"take {taken:.0%}; send it in another batch"
            )
        self._shares[id(update)] = (update, mine)


def summary_cost(n: int, d: int, levels: int = len(QUANTILES)) -> Cost:
    """A summary of n particles in d dimensions (:mod:`mpflow.service.engine.summary`): weighted moments (2 n d²), the
    quantiles' sort (:data:`~mpflow.operators.updaters.base.QUANTILE_FLOPS` n d log₂ n, five float64 copies of the
    cloud) and its JSON (d² + 7 d numbers with the default quantile levels; each other ``levels`` count adds or
    takes d)."""
    numbers = d * d + (SUMMARY_NUMBERS_PER_DIM + levels - len(QUANTILES)) * d
    flops = 2.0 * n * d * d + QUANTILE_FLOPS * n * d * math.log2(max(n, 2)) + JSON_FLOPS_PER_NUMBER * numbers
    return Cost(flops, 8.0 * 5 * n * d + JSON_BYTES_PER_NUMBER * numbers)


def draws_cost(n_draws: int, d: int) -> Cost:
    """``n_draws`` draws of a d-dimensional state, as JSON (a product by a d × d factor each)."""
    return Cost((2.0 * d + JSON_FLOPS_PER_NUMBER) * n_draws * d, (8.0 * 2 + JSON_BYTES_PER_NUMBER) * n_draws * d)


def particles_cost(n: int, d: int) -> Cost:
    """``GET .../particles``: the n × d particles and n log-weights as JSON."""
    return Cost(JSON_FLOPS_PER_NUMBER * n * (d + 1), JSON_BYTES_PER_NUMBER * n * (d + 1) + 8.0 * n * d)


def smoothing_cost(model: ModelFamily, updater: Updater, n: int, lag: int) -> Cost:
    """A stream's smoothing window of ``lag`` steps (:mod:`mpflow.operators.smoothing`, the method's smoother):
    held about four times over while a request reads, steps and writes the state (decoded, batched, moved on by a
    step, encoded), plus ``GET .../smoothed`` — the backward pass (which depends on ``model``'s transition) and its
    answer of ``lag`` (d² + d) numbers."""
    if lag <= 0:
        return Cost(0.0, 0.0)
    smoother, d = updater.smoother, model.state_dim
    window = smoother.window_bytes(lag, n, d)
    numbers = lag * (d * d + d + 1)
    flops = smoother.smooth_flops(model, lag, n) + JSON_FLOPS_PER_NUMBER * numbers
    return Cost(flops, 4.0 * window + JSON_BYTES_PER_NUMBER * numbers)


def window_step_cost(updater: Updater, n: int, d: int, lag: int) -> Cost:
    """One step's work on a smoothing window of ``lag`` steps: the step's row (the method's moments: a few n d²)
    and the window shifted by one row (a copy of it), held twice."""
    if lag <= 0:
        return Cost(0.0, 0.0)
    window = updater.smoother.window_bytes(lag, n, d)
    return Cost(4.0 * n * d * d + 10.0 * d**3 + window / 8.0, 2.0 * window)


def smoothing_stream_cost(model: ModelFamily, updater: Updater, prior: Prior, n: int, lag: int) -> Cost:
    """The dearest request of a smoothing stream of n particles: its creation, a one-step observation with its
    window of ``lag`` steps, or its window and ``GET .../smoothed`` — the most operations and the most bytes of
    the three (each must fit the budgets on its own)."""
    each = [
        creation_cost(model, updater, prior, n),
        observations_cost(model, updater, n, [(1.0, None)], 0, lag),
        smoothing_cost(model, updater, n, lag),
    ]
    return Cost(max(c.flops for c in each), max(c.bytes for c in each))


def creation_cost(model: ModelFamily, updater: Updater, prior: Prior, n: int) -> Cost:
    """A new stream: the prior's n draws (``draw_flops``), the method's start (a moment match or a Gaussian fit:
    a few n d² and a d³ factorisation) and the step-0 summary, the state held in float64 a few times over — and
    its first step (:meth:`Updater.step_work`, dt = 1), so that a stream is never created that no update of
    could be accepted."""
    d = model.state_dim
    start = Cost(prior.draw_flops(n) + 4.0 * n * d * d + 10.0 * d**3, 8.0 * 8 * n * d)
    step = updater.step_work(model, n)
    return start.then(summary_cost(n, d)).then(Cost(step.flops, step.bytes))


def observations_cost(
    model: ModelFamily,
    updater: Updater,
    n: int,
    steps: list[tuple[float, int | None]],
    samples: int,
    lag: int = 0,
    levels: int | None = None,
    cov: bool = False,
) -> Cost:
    """Applying ``steps`` — (dt, entries observed) each — to n particles: each step's work
    (:meth:`Updater.step_work`) and its predictive p-values' (:meth:`Updater.pit_work`), its smoothing window's
    (``lag`` steps kept: :func:`window_step_cost`) and summary,
    its ``per_step`` entry in the answer, and ``samples`` draws. ``levels``: the count of quantile levels the
    request asked for (docs/API.md ``levels``; None: the defaults) — each step's quantiles computed again at them,
    a second sort, and ``levels`` numbers a dimension in its entry; ``cov``: each entry carries the d × d
    covariance (``per_step_cov``)."""
    d = model.state_dim
    total = Cost(0.0, 0.0)
    window = window_step_cost(updater, n, d, lag)
    for dt, k in steps:
        step, pit = updater.step_work(model, n, dt, k), updater.pit_work(model, n, dt, k)
        step_cost = Cost(step.flops + pit.flops + window.flops, max(step.bytes, pit.bytes) + window.bytes)
        total = total.then(step_cost).then(summary_cost(n, d))
        if levels is not None:  # the quantiles again, at the request's levels
            total = total.then(summary_cost(n, d, levels))
    # per_step: mean, sd and quantiles, and a few scalars (and the covariance on request)
    answer = len(steps) * ((2 + (len(QUANTILES) if levels is None else levels)) * d + 8 + (d * d if cov else 0))
    total = Cost(total.flops + JSON_FLOPS_PER_NUMBER * answer, total.bytes)
    return total.then(draws_cost(samples, d)).plus_bytes(JSON_BYTES_PER_NUMBER * answer)


def step_price(
    model: ModelFamily,
    updater: Updater,
    n: int,
    steps: list[tuple[float, int | None]],
    lag: int = 0,
    levels: int | None = None,
    cov: bool = False,
) -> Cost:
    """The price of the dearest of ``steps`` — (dt, entries observed) each — applied alone (its work, p-values,
    window, summary and ``per_step`` entry: :func:`observations_cost` of that one step): what the update engine's
    lanes read to place and stack a step, or a run of steps that hands its worker back between steps
    (:mod:`mpflow.service.engine.lanes`). Steps that differ only in their values cost the same, so each distinct
    (dt, k) is priced once."""
    priced = [observations_cost(model, updater, n, [step], 0, lag, levels, cov) for step in set(steps)]
    return Cost(max(c.flops for c in priced), max(c.bytes for c in priced))


def forecast_cost(model: ModelFamily, updater: Updater, n: int, steps: int, dt: float, samples: int) -> Cost:
    """``GET .../forecast``: the method's predictive over ``steps`` horizons (:meth:`Updater.forecast_work`) and the
    answer — per horizon the state's and the observation's mean, covariance and quantiles, and ``samples`` draws
    of each."""
    d, k = model.state_dim, model.observation_size()
    work = updater.forecast_work(model, n, steps, dt)
    numbers = steps * ((d * d + 6 * d) + (k * k + 6 * k) + samples * (d + k))
    flops = work.flops + 2.0 * steps * samples * (d * d + k * k) + JSON_FLOPS_PER_NUMBER * numbers
    return Cost(flops, work.bytes + JSON_BYTES_PER_NUMBER * numbers)


def largest(settings: Settings, value: int, cost_of: Callable[[int], Cost]) -> int:
    """The largest v ≤ ``value`` whose ``cost_of(v)`` is within the budgets (0 when not even 1 is; the cost grows
    with v): a bisection, about log₂ value estimates."""
    if share(settings, cost_of(value)) <= 1.0:
        return value
    low, high = 0, value  # cost_of(low) fits or low = 0; cost_of(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        if share(settings, cost_of(mid)) <= 1.0:
            low = mid
        else:
            high = mid
    return low


def check(
    settings: Settings, field: str, value: int, cost_of: Callable[[int], Cost], what: str, hint: str = ""
) -> Cost:
    """``cost_of(value)`` when it is within the budgets; else 413 naming ``field``, the estimate, the budget it is
    over and the largest value of ``field`` that fits (the cost grows with it), so the client knows what to send."""
    cost = cost_of(value)
    if share(settings, cost) <= 1.0:
        return cost
    low = largest(settings, value, cost_of)
    over = []
    if cost.flops > settings.max_request_flops:
        over.append(
            f"{cost.flops:.3g} floating-point operations (at most {settings.max_request_flops:.3g}, "
            "MPFLOW_MAX_REQUEST_FLOPS)"
        )
    if cost.bytes > settings.max_request_bytes:
        over.append(
            f"{cost.bytes / 2**20:,.0f} MiB (at most {settings.max_request_bytes / 2**20:,.0f} MiB, "
            "MPFLOW_MAX_REQUEST_BYTES)"
        )
    fits = f"at most {low} here" if low >= 1 else "even 1 is over the budget here"
    raise too_large(f"{field}: {what} needs about {' and '.join(over)}; {fits}{hint}")


def check_draws(settings: Settings, field: str, n_draws: int, meta: dict[str, Any]) -> Cost:
    """413 naming ``field`` for more draws of a stored stream (``meta``) than fit the budget, with its summary."""
    n, d = int(meta["num_particles"]), int(meta["state_dim"])
    what = f"{n_draws} draws of this stream's {d}-dimensional state"
    return check(settings, field, n_draws, lambda m: summary_cost(n, d).then(draws_cost(m, d)), what)


def check_substeps(settings: Settings, model: ModelFamily, dt: float, field: str) -> None:
    """413 when a step of duration ``dt`` integrates in more sub-steps than ``max_integration_substeps``, naming
    ``field``'s ``dt`` (``field`` None: the stream's own step, named by the family's parameters)."""
    steps = model.integration_substeps(dt)
    limit = settings.max_integration_substeps
    if steps <= limit:
        return
    params = " / ".join(f"model.params.{p}" for p in model.substep_params)
    if field is None:
        raise too_large(
            f"{', '.join(f'model.params.{p}' for p in model.substep_params)}: one step integrates in {steps:.3g} "
            f"sub-steps ({params}), at most {limit} (MPFLOW_MAX_INTEGRATION_SUBSTEPS)"
        )
    longest = limit / model.integration_substeps(1.0)
    raise too_large(
        f"{subfield(field, 'dt')}: a step of dt = {dt:.6g} integrates in {steps:.3g} sub-steps (dt × {params}), at "
        f"most {limit} (MPFLOW_MAX_INTEGRATION_SUBSTEPS): dt at most about {longest:.6g} for this stream"
    )


def requested_steps(observations: list[Any]) -> list[tuple[float, int | None]]:
    """(dt, entries observed) of each item of an observation request, read off its JSON before anything is parsed
    (422 naming the item's ``dt`` when it is not a positive number): what :func:`observations_cost` takes."""
    steps = []
    for i, item in enumerate(observations):
        value, dt = item, 1.0
        if isinstance(item, dict) and "value" in item:
            value, dt = item["value"], item.get("dt", 1.0)
        try:
            dt = check_dt(dt, f"observations[{i}]")
        except ValueError as exc:
            raise invalid(str(exc)) from None
        steps.append((dt, _entries(value)))
    return steps


def _entries(value: Any) -> int:
    """The numbers of a JSON observation (its leaves, ``null`` included; at least 1), without recursion."""
    count, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
        else:
            count += 1
    return max(1, count)


__all__ = [
    "HEAVY_SHARE",
    "JSON_BYTES_PER_NUMBER",
    "JSON_FLOPS_PER_NUMBER",
    "Budget",
    "Cost",
    "check",
    "check_draws",
    "check_substeps",
    "creation_cost",
    "draws_cost",
    "forecast_cost",
    "heavy",
    "largest",
    "observations_cost",
    "particles_cost",
    "requested_steps",
    "share",
    "smoothing_cost",
    "smoothing_stream_cost",
    "step_price",
    "summary_cost",
    "window_step_cost",
]
