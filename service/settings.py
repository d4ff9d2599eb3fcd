"""Service settings from the environment (``MPFLOW_*``), via pydantic-settings.

Every field reads ``MPFLOW_<FIELD>`` (case-insensitive), e.g. ``MPFLOW_REDIS_URL=redis://host:6379/0``,
``MPFLOW_MAX_PARTICLES=4096``. Limits default to docs/API.md "Limits"; numeric limits must be positive and a
bad value fails at start with a message naming the field.

- ``redis_url``: the state store; ``None`` means the embedded local Redis (docs/DESIGN.md "Service internals"). Any
  node of a Redis Cluster works too: the service asks the node and then uses the whole cluster.
- ``redis_wait_replicas``: ``N > 0`` acknowledges a write (create, update, delete) only once N replicas have it
  (Redis ``WAIT``, up to ``redis_wait_timeout_ms``, below the store's 5 s command timeout; fewer in time: 503
  ``store_outcome_unknown``), and so every answer that acknowledges one (a retried ``duplicate`` too). 0 (default):
  acknowledged once the primary has it — a failover may then lose the writes its replica had not received.
- ``api_keys``: ``"tenantA:key1,tenantB:key2"``; empty means open (no auth, one tenant).
- ``operator_dirs``: extra folders of trained operators, separated by ``,`` or the OS path separator.
- ``redis_prefix``: the key prefix of every stream key (several services, or tests, may share one Redis).
- ``batching``: micro-batch updates across streams (``false``: one stream per operator call, for benchmarks).
- ``method_options``: per-method updater options as JSON, e.g. ``{"nvgd": {"max_iters": 30}}`` (the keys of each
  updater's ``defaults``; checked when the app starts).
- ``history_steps``: the per-step history each stream keeps, its last N steps (``GET /v1/streams/{id}/history``;
  :mod:`mpflow.service.streams.history`).
- ``max_request_flops``, ``max_request_bytes``, ``max_integration_substeps``: the cost model's budgets
  (:mod:`mpflow.service.streams.costs`): a request's estimated floating-point operations and peak bytes, and the
  numerical-integration sub-steps of one step (Lorenz-96's RK4 over Δ·dt).
- ``metrics_public``: ``true`` (default) serves ``GET /metrics`` without an API key, for a Prometheus scraper
  inside the cluster; ``false`` makes it need a valid key (any tenant's) when ``api_keys`` is set. With auth on,
  ``/healthz`` and ``/readyz`` (and ``/metrics`` when public) are the only API routes answered without a key.
- ``snapshot_key``: the secret that signs stream snapshots (HMAC-SHA256,
:mod:`mpflow.service.streams.snapshot_signing`), at
  least 32 characters; unset (default), a random key is generated once and kept in the store, so every replica
  of a deployment signs and verifies with the same one.
- ``updater_cache_size``: updaters kept per process, one per distinct (method, operator, stream options), least
  recently used dropped first (:mod:`mpflow.service.engine.methods`).
- ``body_read_timeout_s``: a request body not fully received this long after its first read is answered 408
  ``body_timeout`` and its connection closed; ``max_body_bytes_in_flight``: the request bodies one process holds
  at once (one tenant at most half of it: 429; all tenants: 503 ``server_busy``); ``max_streams_per_tenant``,
  ``max_stored_bytes_per_tenant``, ``max_feeds_per_tenant``, ``max_websockets_per_tenant`` (per process) and
  ``max_websockets`` (per process, all tenants): the quotas of :mod:`mpflow.service.store.quotas`, 429
  ``quota_exceeded`` with ``Retry-After`` past them.
- ``loop_lag_limit_seconds``, ``worker_deadline_seconds``: ``/readyz`` answers 503 while the event loop lags
  beyond the first (and for a few seconds after), or a compute worker has been on one job longer than the second
  (:mod:`mpflow.service.engine.watchdog`).
- ``header_timeout_s``, ``max_connections``: what a connection may hold of a process before it has sent a request
  (:mod:`mpflow.service.connection_guard`, ``mpflow serve``'s protocol): a request head (request line and headers)
  not complete this long after the connection opened, or after its previous response, is answered 408
  ``header_timeout`` and closed; a connection past the process's ``max_connections`` (HTTP and WebSocket) is answered
  503 ``too_many_connections`` and closed.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: the variable prometheus_client reads for the directory of the workers' shared metric files: ``mpflow serve``
#: sets it before it spawns several workers (:func:`mpflow.cli.serve.shared_metrics_dir`), here so that its
#: supervising process reads it without importing the API (and torch)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
#: the shortest ``snapshot_key`` accepted (characters)
MIN_SNAPSHOT_KEY_LENGTH = 32

_POSITIVE = (
    "max_particles",
    "max_state_dim",
    "max_observations_per_request",
    "max_body_bytes",
    "max_samples_per_request",
    "batch_max_size",
    "batch_max_wait_ms",
    "default_ttl_seconds",
    "max_forecast_steps",
    "redis_wait_timeout_ms",
    "history_steps",
    "updater_cache_size",
    "body_read_timeout_s",
    "max_body_bytes_in_flight",
    "max_streams_per_tenant",
    "max_stored_bytes_per_tenant",
    "max_feeds_per_tenant",
    "max_websockets",
    "max_websockets_per_tenant",
    "max_request_flops",
    "max_request_bytes",
    "max_integration_substeps",
    "loop_lag_limit_seconds",
    "worker_deadline_seconds",
    "header_timeout_s",
    "max_connections",
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MPFLOW_", case_sensitive=False, extra="ignore")

    redis_url: str | None = None
    api_keys: str = ""
    max_particles: int = 65536
    max_state_dim: int = 512
    max_observations_per_request: int = 1000
    max_body_bytes: int = 8 * 1024 * 1024
    max_samples_per_request: int = 100_000
    max_forecast_steps: int = 1000
    batch_max_size: int = 64
    batch_max_wait_ms: float = 2.0
    operator_dirs: str = ""
    log_level: str = "INFO"
    default_ttl_seconds: int = 86400
    data_dir: str = "./data"
    redis_prefix: str = "mpflow"
    batching: bool = True
    method_options: dict[str, dict[str, Any]] = {}
    metrics_public: bool = True
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 1000
    history_steps: int = 500
    # -- snapshots and updater cache (issue 34)
    snapshot_key: SecretStr | None = None
    updater_cache_size: int = 64
    # request deadline and per-tenant quotas (docs/API.md "Limits"; mpflow.service.store.quotas)
    body_read_timeout_s: float = 20.0
    max_body_bytes_in_flight: int = 256 * 1024 * 1024
    max_streams_per_tenant: int = 10_000
    max_stored_bytes_per_tenant: int = 256 * 1024 * 1024
    max_feeds_per_tenant: int = 16
    max_websockets: int = 1024
    max_websockets_per_tenant: int = 128
    # the cost model's budgets (mpflow.service.streams.costs; docs/API.md "Limits")
    max_request_flops: float = 2.5e10
    max_request_bytes: int = 384 * 1024 * 1024
    max_integration_substeps: int = 1000
    # truthful health (service/engine/watchdog.py)
    loop_lag_limit_seconds: float = 1.0
    worker_deadline_seconds: float = 30.0
    # connections before their request (service/connection_guard.py; issue 54)
    header_timeout_s: float = Field(
        10.0, description="seconds a connection has to send a whole request head, from its start or previous answer"
    )
    max_connections: int = Field(
        2000, description="open connections (HTTP and WebSocket) per process; past it 503 too_many_connections"
    )

    @field_validator(*_POSITIVE)
    @classmethod
    def _positive(cls, v: Any, info: ValidationInfo) -> Any:
        if not v > 0:
            raise ValueError(f"{info.field_name}: must be positive, got {v}")
        return v

    @field_validator("redis_wait_timeout_ms")
    @classmethod
    def _below_command_timeout(cls, v: int) -> int:
        if v >= 5000:
            raise ValueError(f"redis_wait_timeout_ms: must be below 5000 (the store's command timeout), got {v}")
        return v

    @field_validator("redis_wait_replicas")
    @classmethod
    def _not_negative(cls, v: int, info: ValidationInfo) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name}: must be 0 or more, got {v}")
        return v

    @field_validator("redis_url")
    @classmethod
    def _empty_url_is_none(cls, v: str | None) -> str | None:
        return (v.strip() or None) if v is not None else None

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        level = v.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {v!r}")
        return level

    @field_validator("snapshot_key")
    @classmethod
    def _snapshot_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None or not v.get_secret_value().strip():
            return None
        if len(v.get_secret_value()) < MIN_SNAPSHOT_KEY_LENGTH:
            raise ValueError(f"snapshot_key: at least {MIN_SNAPSHOT_KEY_LENGTH} characters (a random secret)")
        return v

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: str) -> str:
        parse_api_keys(v)  # raises ValueError naming the field
        return v

    @property
    def api_key_tenants(self) -> dict[str, str]:
        """``{api_key: tenant}``; empty when auth is off."""
        return parse_api_keys(self.api_keys)

    @property
    def operator_dir_list(self) -> list[str]:
        parts = self.operator_dirs.replace(os.pathsep, ",").split(",")
        return [p.strip() for p in parts if p.strip()]


def parse_api_keys(spec: str) -> dict[str, str]:
    """Parse ``"tenantA:key1,tenantB:key2"`` into ``{key: tenant}`` (keys must be unique)."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        tenant, sep, key = entry.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not tenant or not key:
            raise ValueError("api_keys: expected 'tenant:key' pairs separated by commas")
        if key in out:
            raise ValueError(f"api_keys: a key is listed twice (tenants {out[key]!r} and {tenant!r})")
        out[key] = tenant
    return out
