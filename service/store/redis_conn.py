"""Connections to the state store's Redis: one server or a Redis Cluster, told apart from the URL alone.

:func:`detect_cluster` asks the node at ``MPFLOW_REDIS_URL`` ``INFO cluster``: ``cluster_enabled:1`` means a node
of a Redis Cluster (any node will do, a replica too), and the store then talks to the whole cluster through
redis-py's :class:`redis.asyncio.cluster.RedisCluster`, which learns the slot map from that node (``CLUSTER
SLOTS``), follows ``MOVED``/``ASK`` redirections while slots migrate and re-reads the map after a failover. No
other setting is needed. A node that does not answer yet leaves the mode undecided (``None``); the store decides
at its first command that gets an answer.

:func:`open_client` builds the client for either mode with the store's pool rules
(:mod:`mpflow.service.store.stream_store`):
a blocking pool of at most ``max_connections`` for one server; for a cluster, a pool of that size per node.

Acknowledged writes (:func:`run_acknowledged`). With ``wait_replicas = N > 0`` a write script is followed, on the
same connection, by ``WAIT N timeout_ms``: Redis answers once N replicas have acknowledged every write that
connection made (or the timeout passed) with the number that did. The write counts as acknowledged only when
that number is ≥ N; otherwise :class:`ReplicasBehind` is raised — the write *is* on the primary, so the service
answers 503 ``store_outcome_unknown`` and a retry with the same ``seq`` is answered ``duplicate``. On a cluster
the script and the ``WAIT`` are written together on one connection to the primary that owns the keys' slot;
a redirection (the slot moved, or is moving) means the script did not run there, so the pair is sent again after
the slot map is refreshed.

Live feeds (:class:`Subscription`). On one server an update event is ``PUBLISH``-ed and a feed ``SUBSCRIBE``-s; on
a cluster the event is ``SPUBLISH``-ed (sharded pub/sub, Redis ≥ 7) on a channel that carries the stream's hash
tag, so it lives on the stream's own shard — the CAS script may publish it, single-slot — and a feed
``SSUBSCRIBE``-s on the primary that owns that slot (redis-py moves the subscription when the slot moves).
Classic ``PUBLISH`` on a cluster would be broadcast to every node over the cluster bus.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis
import redis.asyncio as aredis
from redis import exceptions as rexc
from redis.asyncio.cluster import PipelineCommand, RedisCluster

#: tries of an acknowledged cluster write whose slot was redirected (each after a slot-map refresh)
REDIRECT_TRIES = 20
REDIRECT_PAUSE_S = 0.05
_REDIRECTED = (rexc.MovedError, rexc.AskError, rexc.TryAgainError)


class ReplicasBehind(rexc.ConnectionError):
    """A write was applied on the primary but fewer replicas than asked acknowledged it within the timeout."""


def pool_options() -> dict[str, Any]:
    """Connection options: maintenance notifications off where redis-py has them
    (:mod:`mpflow.service.store.stream_store`)."""
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # an older redis-py: no such notifications, the check always runs
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def detect_cluster(url: str, timeout: float = 2.0) -> bool | None:
    """``True`` when the node at ``url`` is in cluster mode, ``False`` when it is a plain server, ``None`` when
    it does not answer (blocking; at most ``timeout`` s)."""
    try:
        with redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=None) as r:
            return bool(r.info("cluster").get("cluster_enabled"))
    except (rexc.RedisError, OSError):
        return None


async def detect_cluster_async(client: aredis.Redis) -> bool:
    """:func:`detect_cluster` over an open client (raises the client's errors when it does not answer)."""
    return bool((await client.info("cluster")).get("cluster_enabled"))


def open_client(url: str, cluster: bool, timeout: float, max_connections: int, **kwargs: Any) -> Any:
    """A ``redis.asyncio`` client for ``url``: :class:`RedisCluster` when ``cluster``, else a
    :class:`redis.asyncio.Redis` over a blocking pool (module docstring). States are bytes (no decoding)."""
    options = {"socket_connect_timeout": timeout, "socket_timeout": timeout, **pool_options(), **kwargs}
    if cluster:
        return RedisCluster.from_url(url, max_connections=max_connections, decode_responses=False, **options)
    pool = aredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, decode_responses=False, **options
    )
    return aredis.Redis.from_pool(pool)


async def run_acknowledged(
    client: Any, script: str, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
) -> Any:
    """Run ``script`` (``EVAL``) then ``WAIT replicas timeout_ms`` on one connection; the script's answer once at
    least ``replicas`` replicas acknowledged it, else :class:`ReplicasBehind` (module docstring)."""
    if isinstance(client, RedisCluster):
        result, acked = await _cluster_pipeline(client, script, keys, args, replicas, timeout_ms)
    else:
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVAL", script, len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            result, acked = await pipe.execute(raise_on_error=False)
    if isinstance(result, Exception):
        raise result
    if isinstance(acked, Exception):
        raise ReplicasBehind(f"the write was applied on the primary; WAIT failed: {acked}")
    if int(acked) < replicas:
        raise ReplicasBehind(
            f"the write was applied on the primary but {acked} of {replicas} replicas acknowledged it "
            f"within {timeout_ms} ms"
        )
    return result


async def _cluster_pipeline(
    client: RedisCluster, script: str, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
) -> tuple[Any, Any]:
    """The script and its ``WAIT`` written together on one connection to the primary of the keys' slot, and both
    answers read (``ClusterNode.execute_pipeline``: no retry that could send the ``WAIT`` elsewhere); re-sent
    after a redirection — nothing ran there — once the slot map is re-read, until the slot settles. A connection
    error propagates (the write's outcome is unknown) once the slot map is re-read."""
    for _ in range(REDIRECT_TRIES):
        await client.initialize()  # a no-op once the client has its slot map
        node = client.get_node_from_key(keys[0])
        commands = [
            PipelineCommand(0, "EVAL", script, len(keys), *keys, *args),
            PipelineCommand(1, "WAIT", replicas, timeout_ms),
        ]
        try:
            await node.execute_pipeline(commands)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError):
            await _refresh_slot_map(client)
            raise
        result, acked = commands[0].result, commands[1].result
        if isinstance(result, rexc.ConnectionError | rexc.TimeoutError):
            await _refresh_slot_map(client)
        if not isinstance(result, _REDIRECTED):
            return result, acked
        await asyncio.sleep(REDIRECT_PAUSE_S)
        await client.nodes_manager.initialize()  # re-read the slot map
    raise rexc.TryAgainError(f"the slot of {keys[0]!r} kept moving")


async def _refresh_slot_map(client: RedisCluster) -> None:
    """Re-read the slot map after a node did not answer (a failover may have moved its slots); a cluster that
    does not answer yet is asked again at the next write."""
    with contextlib.suppress(rexc.RedisError, OSError):
        await client.nodes_manager.initialize()


class Subscription:
    """One feed's subscription to one channel: ``SUBSCRIBE`` on one server, ``SSUBSCRIBE`` on a cluster."""

    def __init__(self, client: Any, channel: str):
        self.sharded = isinstance(client, RedisCluster)
        self.channel = channel
        self._client = client
        self._pubsub = client.pubsub()

    async def start(self) -> None:
        if self.sharded:
            await self._client.initialize()  # the slot map, which a new cluster client reads at its first command
            await self._pubsub.ssubscribe(self.channel)
        else:
            await self._pubsub.subscribe(self.channel)

    async def next_message(self, timeout: float) -> bytes | None:
        """The next message's payload, or ``None`` when none came within ``timeout`` s (subscription
        confirmations are skipped)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            if self.sharded:
                message = await self._pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=left)
            else:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            if message is not None and message.get("type") in (b"message", "message", b"smessage", "smessage"):
                return bytes(message["data"])
        return None

    async def aclose(self) -> None:
        await self._pubsub.aclose()


__all__ = [
    "ReplicasBehind",
    "Subscription",
    "detect_cluster",
    "detect_cluster_async",
    "open_client",
    "pool_options",
    "run_acknowledged",
]
