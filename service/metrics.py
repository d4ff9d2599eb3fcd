"""Prometheus metrics named by API.md "Operations", in a per-app :class:`CollectorRegistry` (so tests and
benchmarks can build many apps in one process).

=========================================== ========= ==============================================
``mpflow_http_requests_total``              counter   route (template), method, status
``mpflow_http_request_duration_seconds``    histogram route
``mpflow_updates_total``                    counter   family, method — stream-steps applied by operators
``mpflow_update_duration_seconds``          histogram method — operator compute of one (batched) call
``mpflow_batch_size``                       histogram streams per operator call (micro-batch size)
``mpflow_streams``                          gauge     streams in the store (refreshed at each scrape)
``mpflow_store_errors_total``               counter   requests that found the store unreachable
``mpflow_update_fallbacks_total``           counter   family, method, fallback — steps whose method failed
                                                      numerically and were computed by ``fallback``
                                                      (``none``: every fall-back failed too, 422); like
                                                      ``mpflow_updates_total`` it counts computations (a
                                                      step re-run after a lost write race counts again)
=========================================== ========= ==============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
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
        self.streams = Gauge("mpflow_streams", "streams in the store", registry=r)
        self.store_errors = Counter(
            "mpflow_store_errors_total", "requests that found the store unreachable", registry=r
        )
        self.fallbacks = Counter(
            "mpflow_update_fallbacks_total",
            "steps whose method failed numerically, by the method that computed them instead (none: all failed)",
            ["family", "method", "fallback"],
            registry=r,
        )

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

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
