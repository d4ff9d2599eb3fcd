"""Degraded shards: the store's primaries with fewer replicas in sync than replica acknowledgement needs.

With ``MPFLOW_REDIS_WAIT_REPLICAS = N`` a write is acknowledged only once N replicas have it
(:mod:`mpflow.service.store.stream_store`), so a primary with fewer than N replicas in sync answers every write of its
streams 503 ``store_outcome_unknown`` until a replica is back; the other primaries are unaffected. A shard with exactly
N replicas is degraded by its first failure: a replica lost, or its primary lost (a replica takes over and is left
with N - 1). N + 1 replicas per shard keep ``WAIT N`` writable through one failure (docs/operations.md, measured
in ``benchmarks/cluster_faults.py``).

:func:`replica_counts` asks each primary ``INFO replication`` (every primary the cluster client knows; on one
server, that server) and counts the replicas that are ``online`` and acknowledged within the last
``MAX_LAG_S`` s (a replica acknowledges every second: a frozen or cut-off one stops, long before the primary drops
its link); a primary that does not answer counts as ``None``. :class:`DegradedShards` looks at most once per
``REFRESH_S`` (``/readyz`` and ``/metrics`` ask it), keeps the answer for ``/readyz`` and the gauge
``mpflow_store_degraded_shards``, and logs once per change of the degraded set, not per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger("mpflow.service.store.replication")

#: a replica whose last acknowledgement is older than this (s) is not counted as in sync
MAX_LAG_S = 3
#: the shortest time (s) between two looks at the primaries
REFRESH_S = 1.0
#: how long (s) one look may take in all
LOOK_TIMEOUT_S = 2.0


def in_sync(info: dict[str, Any]) -> int:
    """The replicas an ``INFO replication`` answer of a primary lists as ``online`` with ``lag <= MAX_LAG_S``."""
    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return sum(1 for v in replicas if v.get("state") == "online" and int(v.get("lag", MAX_LAG_S + 1)) <= MAX_LAG_S)


async def replica_counts(client: Any) -> dict[str, int | None]:
    """``{primary "host:port": replicas in sync}`` (module docstring); ``None`` for a primary that did not answer
    (or a node that is no primary any more: its shard has no primary the client knows)."""
    if isinstance(client, RedisCluster):
        await client.initialize()  # a no-op once the client has its slot map
        nodes = [(node.name, node.execute_command) for node in client.get_primaries()]
    else:
        kwargs = client.connection_pool.connection_kwargs
        name = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        nodes = [(name, client.execute_command)]

    async def one(command: Any) -> int | None:
        try:
            info = await command("INFO", "replication")
        except (rexc.RedisError, OSError):
            return None
        return in_sync(info) if info.get("role") == "master" else None

    counts = await asyncio.gather(*(one(command) for _, command in nodes))
    return {name: n for (name, _), n in zip(nodes, counts, strict=True)}


class DegradedShards:
    """The primaries with fewer than ``needed`` replicas in sync, looked at most once per ``REFRESH_S``
    (module docstring). ``on_change(count)``: told the number of degraded shards after every look."""

    def __init__(self, client_of: Any, needed: int, on_change: Any = None):
        self._client_of = client_of  # a callable: the store's current client (it may be replaced once)
        self.needed = needed
        self._on_change = on_change
        self._lock = asyncio.Lock()
        self._at = float("-inf")
        #: ``{primary: replicas in sync or None}`` of the degraded primaries at the last look
        self.degraded: dict[str, int | None] = {}

    async def look(self) -> dict[str, int | None]:
        """The degraded primaries now (a cached answer when the last look is under ``REFRESH_S`` old). Nothing
        is degraded when no replica is needed; a look that fails keeps the last answer."""
        if not self.needed:
            return {}
        async with self._lock:
            if time.monotonic() - self._at < REFRESH_S:
                return self.degraded
            self._at = time.monotonic()
            with contextlib.suppress(rexc.RedisError, OSError, asyncio.TimeoutError):
                counts = await asyncio.wait_for(replica_counts(self._client_of()), LOOK_TIMEOUT_S)
                self._update({name: n for name, n in counts.items() if n is None or n < self.needed})
            return self.degraded

    def _update(self, degraded: dict[str, int | None]) -> None:
        if degraded.keys() != self.degraded.keys():
            if degraded:
                said = ", ".join(f"{name} ({'no answer' if n is None else n})" for name, n in sorted(degraded.items()))
                log.warning(
                    "state store: %d shard(s) with fewer than the %d replica(s) MPFLOW_REDIS_WAIT_REPLICAS needs; "
                    "their writes answer 503 until replicas are back: %s",
                    len(degraded),
                    self.needed,
                    said,
                )
            else:
                log.info("state store: every shard has its %d replica(s) again", self.needed)
        self.degraded = degraded
        if self._on_change is not None:
            self._on_change(len(degraded))


__all__ = ["LOOK_TIMEOUT_S", "MAX_LAG_S", "REFRESH_S", "DegradedShards", "in_sync", "replica_counts"]
