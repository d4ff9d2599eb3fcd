"""The largest smoothing window a server accepts for an ``smc`` stream of the 2-D ``lds`` of :mod:`tests.harness.rts`:
:func:`mpflow.service.streams.costs.largest` of the stream's dearest request — its creation, a step with its window,
its window and ``/smoothed`` (:func:`~mpflow.service.streams.costs.smoothing_stream_cost`) — as the server checks
it at creation. The smoothing tests and ``benchmarks/smoothing_price.py`` size their windows with it.
"""

from __future__ import annotations

from mpflow.operators.models import make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import Prior, prior_from_spec
from mpflow.operators.updaters import Updater, get_updater
from mpflow.service.settings import Settings
from mpflow.service.streams import costs

from tests.harness.rts import PARAMS, PRIOR


def smc_stream() -> tuple[ModelFamily, Updater, Prior]:
    """(model, updater, prior) of an ``smc`` stream of the ``lds`` of :mod:`tests.harness.rts`, for the cost model."""
    return make_model("lds", PARAMS, 2), get_updater("smc"), prior_from_spec(PRIOR)


def largest_window(settings: Settings, lag: int) -> int:
    """The largest N (up to ``settings.max_particles``) of such a stream keeping ``lag`` steps that ``settings``
    accept."""
    model, updater, prior = smc_stream()
    return costs.largest(
        settings, settings.max_particles, lambda n: costs.smoothing_stream_cost(model, updater, prior, n, lag)
    )


__all__ = ["largest_window", "smc_stream"]
