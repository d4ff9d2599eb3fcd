"""Prometheus metrics named by docs/API.md "Operations", in a per-app :class:`CollectorRegistry` (so tests and
benchmarks can build many apps in one process).

=========================================== ========= ==============================================
``mpflow_http_requests_total``              counter   route (template), method, status
``mpflow_http_request_duration_seconds``    histogram route
``mpflow_updates_total``                    counter   family, method — stream-steps applied by operators
``mpflow_update_duration_seconds``          histogram method — operator compute of one (batched) call
``mpflow_batch_size``                       histogram streams per operator call (micro-batch size)
``mpflow_streams``                          gauge     streams in the store (refreshed at each scrape)
``mpflow_store_errors_total``               counter   requests that found the store unreachable
``mpflow_store_degraded_shards``            gauge     primaries with fewer replicas in sync than
                                                      ``MPFLOW_REDIS_WAIT_REPLICAS`` needs (their writes
                                                      answer 503; :mod:`mpflow.service.store.replication`)
``mpflow_update_fallbacks_total``           counter   family, method, fallback — steps whose method failed
                                                      numerically and were computed by ``fallback``
                                                      (``none``: every fall-back failed too, 422); like
                                                      ``mpflow_updates_total`` it counts computations (a
                                                      step re-run after a lost write race counts again)
=========================================== ========= ==============================================

``mpflow_update_ess_fraction`` (histogram; method) is each stream-step's effective sample size over N: for ``smc``
its weights' before resampling, for ``mpf`` the flow's health (the ESS of the weights that would correct its step,
:mod:`mpflow.operators.mpf.health`), 1 for methods with uniform particles.
``mpflow_update_theta_ess_fraction`` (histogram; method) is, for a stream that learns unknown parameters
(``smc2``), each stream-step's ESS of its parameter particles over their number M after the step's reweighting and
before any resampling (:func:`mpflow.operators.updaters.smc2.cloud_health` says what is left after): near 1/M the
parameter cloud collapsed onto one value at that step.
``mpflow_update_move_acceptance`` (histogram; method) is the acceptance rate of the posterior moves of each stream-step
that ran them (:mod:`mpflow.operators.mpf.posterior_moves`): a second health signal, near 0 when the moves stall.
``mpflow_update_rescues_total`` (counter; method) counts the stream-steps whose observation was inconsistent with
the predictive, so that the step inflated the cloud before its flow pulled it back (``mpf`` with ``flow_fraction:
"auto"``, :mod:`mpflow.operators.mpf.consistency`): a filter that had lost the truth.
``mpflow_streams_outside_operator_domain_total`` (counter; family, operator) counts the streams created with a
model or prior outside their trained operator's training domain (the stream document's ``operator_domain``).
``mpflow_event_loop_lag_seconds`` (gauge) and ``mpflow_worker_busy_seconds`` (gauge; worker: ``fast``, ``slow``,
``aux``) are the watchdog's figures (:mod:`mpflow.service.engine.watchdog`): how late the event loop runs a callback,
and how long each compute worker has been on its current job (0 when idle; the longest of the auxiliary threads).

**Several workers** (``python -m mpflow serve --workers N``, N > 1; see :mod:`mpflow.cli.serve`). Each uvicorn worker is
a process with its own metrics, so with a registry per process a scrape would show only the counts of the one
worker that answered it. There the service runs prometheus_client's multiprocess mode: ``serve`` points
``PROMETHEUS_MULTIPROC_DIR`` at a private temporary directory before the workers start (prometheus_client
chooses its value class at import), every worker writes its samples to memory-mapped files there, and
:meth:`Metrics.render` reads them all through a :class:`~prometheus_client.multiprocess.MultiProcessCollector`
in a fresh registry: counters and histograms are summed over the workers (a dead or restarted worker's counts
stay in the sum, so totals never go back). The watchdog's two gauges are per process (``multiprocess_mode="all"``:
one series per worker, labelled ``pid``), since each worker has its own loop and compute threads.
``mpflow_streams`` is set from the store at each scrape, so the gauge
uses ``multiprocess_mode="mostrecent"`` (the value of the latest scrape, whichever worker made it; a non-``live``
mode, so no ``mark_process_dead`` book-keeping is needed). Names and labels are the same (but the watchdog
gauges' ``pid``); multiprocess mode
exports no ``*_created`` samples, and ``mpflow_streams`` only once a scrape has read the store. Without
``PROMETHEUS_MULTIPROC_DIR`` (one worker, tests) a :class:`Metrics` renders its own registry.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mpflow.service.settings import MULTIPROC_ENV
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    import torch

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_ESS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_ACCEPTANCE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def multiprocess_dir() -> str | None:
    """The directory shared by the workers' metric files (``PROMETHEUS_MULTIPROC_DIR``), or None when unset.

    RuntimeError when it is set but prometheus_client was imported before it was: this process's samples
    would then stay in memory, and the aggregate read from the files would silently miss them."""
    path = os.environ.get(MULTIPROC_ENV) or None
    if path is not None and values.ValueClass is values.MutexValue:
        raise RuntimeError(f"{MULTIPROC_ENV} was set after prometheus_client was imported; set it before")
    return path


class Metrics:
    """The service's metrics: recorded into a per-app registry; rendered from it, or from every worker's
    files in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set when the Metrics is built)."""

    def __init__(self) -> None:
        self.multiprocess_dir = multiprocess_dir()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "mpflow_http_requests_total", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.http_duration = Histogram(
            "mpflow_http_request_duration_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.updates = Counter("mpflow_updates_total", "stream-steps applied", ["family", "method"], registry=r)
        self.update_duration = Histogram(
            "mpflow_update_duration_seconds",
            "operator compute per (batched) call",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "mpflow_batch_size", "streams per operator call", buckets=_BATCH_BUCKETS, registry=r
        )
        # set from the store at each scrape: across workers the latest scrape's value is the count
        self.streams = Gauge("mpflow_streams", "streams in the store", multiprocess_mode="mostrecent", registry=r)
        self.store_errors = Counter(
            "mpflow_store_errors_total", "requests that found the store unreachable", registry=r
        )
        # set at each look at the store's replicas (/readyz, /metrics): like mpflow_streams, the latest look counts
        self.degraded_shards = Gauge(
            "mpflow_store_degraded_shards",
            "primaries with fewer replicas in sync than MPFLOW_REDIS_WAIT_REPLICAS needs (their writes answer 503)",
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.fallbacks = Counter(
            "mpflow_update_fallbacks_total",
            "steps whose method failed numerically, by the method that computed them instead (none: all failed)",
            ["family", "method", "fallback"],
            registry=r,
        )
        self.ess_fraction = Histogram(
            "mpflow_update_ess_fraction",
            "per stream-step: the effective sample size over N (smc: its weights; mpf: the flow's health, the ESS "
            "of the weights that would correct its step; 1 for the others)",
            ["method"],
            buckets=_ESS_BUCKETS,
            registry=r,
        )
        self.theta_ess_fraction = Histogram(
            "mpflow_update_theta_ess_fraction",
            "per stream-step of a stream that learns unknown parameters (smc2): the effective sample size of its "
            "parameter particles over their number, after the step's reweighting, before any resampling",
            ["method"],
            buckets=_ESS_BUCKETS,
            registry=r,
        )
        self.move_acceptance = Histogram(
            "mpflow_update_move_acceptance",
            "per stream-step that ran posterior moves (mpf on a static family): the Metropolis acceptance rate of its "
            "MALA moves (0.5-0.6 when healthy)",
            ["method"],
            buckets=_ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.rescues = Counter(
            "mpflow_update_rescues_total",
            "stream-steps whose observation was inconsistent with the predictive (a chi-square test at 1e-7), so the "
            'step inflated the cloud before its flow pulled it back (mpf with flow_fraction "auto")',
            ["method"],
            registry=r,
        )
        self.outside_domain = Counter(
            "mpflow_streams_outside_operator_domain_total",
            "streams created whose model or prior lies outside their trained operator's training domain",
            ["family", "operator"],
            registry=r,
        )

        # the watchdog's figures, set every tick from its thread (service/engine/watchdog.py)
        self.loop_lag = Gauge(
            "mpflow_event_loop_lag_seconds",
            "how late the event loop runs a callback posted to it (the watchdog's beat)",
            multiprocess_mode="all",
            registry=r,
        )
        self.worker_busy = Gauge(
            "mpflow_worker_busy_seconds",
            "how long each compute worker has been on its current job (0 when idle)",
            ["worker"],
            multiprocess_mode="all",
            registry=r,
        )

    def zero_series(self, runs: dict[str, list[str]]) -> None:
        """Every series labelled by family and method alone (not the fall-backs', whose third label is open), at 0,
        before the first update: ``runs`` maps each family to the methods that run it (``GET /v1/models``).
        ``rate()`` and alerts see a series from the start instead of one that appears with its first sample; every
        worker calls it (in multiprocess mode a ``labels()`` call writes the 0 to the worker's file)."""
        methods = sorted({m for ms in runs.values() for m in ms})
        for family, family_methods in runs.items():
            for method in family_methods:
                self.updates.labels(family, method)
        for method in methods:
            for per_method in (
                self.update_duration,
                self.ess_fraction,
                self.theta_ess_fraction,
                self.move_acceptance,
                self.rescues,
            ):
                per_method.labels(method)

    def observe_watchdog(self, lag: float, busy: dict[str, float]) -> None:
        """The watchdog's hook: the loop's lag and each worker's seconds on its current job."""
        self.loop_lag.set(lag)
        for worker, seconds in busy.items():
            self.worker_busy.labels(worker).set(seconds)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(seconds)

    def observe_batch(self, method: str, family: str, batch: int, seconds: float) -> None:
        """The engine's observer: one operator call over ``batch`` streams."""
        self.updates.labels(family, method).inc(batch)
        self.update_duration.labels(method).observe(seconds)
        self.batch_size.observe(batch)

    def observe_fallback(self, family: str, method: str, fallback: str) -> None:
        """The stream service's hook: one step of ``method`` fell back to ``fallback`` (or ``"none"``)."""
        self.fallbacks.labels(family, method, fallback).inc()

    def observe_health(
        self, method: str, ess_fraction: torch.Tensor, extras: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The engine's health observer: ESS / N of every stream of one operator call and, from the call's
        ``extras``, the θ-ESS / M of a stream learning its parameters, the acceptance rates of its posterior moves
        and the streams it rescued."""
        extras = extras or {}
        rescued = extras.get("rescued")
        if rescued is not None and bool(rescued.any()):
            self.rescues.labels(method).inc(int(rescued.sum()))
        for histogram, rates in (
            (self.ess_fraction, ess_fraction),
            (self.theta_ess_fraction, extras.get("theta_ess_fraction")),
            (self.move_acceptance, extras.get("acceptance")),
        ):
            if rates is not None:
                labelled = histogram.labels(method)
                for value in rates.tolist():
                    labelled.observe(value)

    def observe_outside_domain(self, family: str, operator: str) -> None:
        """The stream service's hook: a stream of ``family`` was created outside ``operator``'s domain."""
        self.outside_domain.labels(family, operator).inc()

    def render(self) -> bytes:
        """Prometheus text: this app's registry, or with several workers the sum over all their files
        (a fresh registry per scrape, as prometheus_client advises, so no live metric is counted twice)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "MULTIPROC_ENV", "Metrics", "multiprocess_dir"]
