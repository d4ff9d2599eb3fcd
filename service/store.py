"""The stream state store: Redis, written by compare-and-set on a per-stream version.

Keys (``<p>`` is the prefix, ``mpflow`` by default; ``{...}`` is the Redis Cluster hash tag, so one stream's
two keys live in one slot and a Lua script may touch both)::

    <p>:{<tenant>:<stream_id>}:meta   hash: one JSON-encoded value per meta field (model, method,
                                      num_particles, created_at, updated_at, step, ...) plus ``version``
                                      and the internal ``_index`` (the stream's index member)
    <p>:{<tenant>:<stream_id>}:state  string: ``ParticleState.to_bytes()``
    <p>:tenant:<tenant>:streams       sorted set, the tenant's listing index (see below)

Both stream keys carry the stream's TTL; every successful write refreshes it.

Exactly-once updates. ``create`` writes version 1. ``compare_and_set(expected_version)`` is one Lua script:
it writes only if the stored version equals ``expected_version`` and then stores version + 1, so of any
number of writers that read the same version exactly one wins. The service loops
read → compute → CAS; on ``False`` it re-reads and applies docs/API.md's ``seq`` rules (applied, duplicate, 409)
against the fresh ``step``. A write is acknowledged only after the script returns. The CAS may carry an event
``(channel, payload)`` (live viewers' update, :mod:`mpflow.service.dashboard.publish`): the script PUBLISHes it right
after its write and only then — one round trip, no event for a write that did not happen, and none lost between
the write and a separate PUBLISH. A channel is not a key, so this stays a single-slot script on Redis Cluster.

Listing index (decision). A sorted set per tenant, all scores 0, members ``<created_ms, 15 digits>:<stream_id>``
and range queries by lex order: this orders streams by creation time, breaks ties by id, and a page
cursor (the last member, base64url-encoded: opaque to clients) resumes exactly after it — no stream is
skipped or repeated when streams are added or removed between pages. SCAN was rejected: it walks the
whole keyspace, may return a key twice, and cannot be scoped to a tenant without a full walk. TTL
expiry does not remove index members; ``list`` drops (and ZREMs) members whose meta key is gone or
belongs to a newer stream of the same id, so a page may hold fewer than ``limit`` items (and the last
page may be empty). ``count`` sums the indexes' sizes, so it may include expired, not-yet-pruned streams.

Redis Cluster: the stream keys share a slot, but the tenant index does not; ``create`` and ``delete``
update it in the same script, which is atomic on one Redis (the embedded one, or a primary/replica
pair). On a Cluster the index write has to become a second step (list already tolerates stale members).

Connection failures (refused, reset, timeout, Redis loading) raise :class:`StoreUnavailable`, which the
API answers with 503 and ``Retry-After``. A *write* (create, compare-and-set, delete) that was sent but got no
answer — a timeout, or the connection lost mid-command — raises its subclass :class:`StoreOutcomeUnknown`: Redis
may still execute it (a frozen or overloaded server runs the command once it wakes), so "nothing was applied" is
not known; with ``seq`` a retry tells (``duplicate``). Measured in ``benchmarks/reliability.py`` (freeze).

The connection pool is a blocking one of at most ``MAX_CONNECTIONS``: a command that finds every connection
busy waits (up to the timeout) for one. redis-py's default pool (100 connections in redis-py 8) fails it at once
with "Too many connections", which under a soak of 100 concurrent streams shows as hundreds of spurious 503s.

Pooled connections are checked when taken from the pool, so that after a Redis restart (or a failover, or a
proxy's idle timeout) a connection the server closed is reopened instead of failing its next command: recent
redis-py (8.1 here) skips that check while "maintenance notifications" (a Redis Cloud/Enterprise feature, on by
default with RESP3) are enabled, so the store turns them off (measured: without it, every idle connection
answered one 503 after a restart; tests/reliability).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aredis
from redis import exceptions as rexc

_NAME = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")
_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# fields the store owns: callers' values for these are ignored
_RESERVED = ("version", "_index")

# KEYS: meta, state, index. ARGV: ttl, state bytes, index member, field, value, ...
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[3])
return 1
"""

# KEYS: meta, state. ARGV: expected version, ttl, state bytes, event channel ('' for no event), event payload,
# field, value, ... The event is published only after a write, in the same script (a channel is not a key).
_CAS = """
local v = redis.call('HGET', KEYS[1], 'version')
if (not v) or (v ~= ARGV[1]) then return 0 end
local nv = string.format('%d', tonumber(v) + 1)
if #ARGV > 5 then redis.call('HSET', KEYS[1], unpack(ARGV, 6)) end
redis.call('HSET', KEYS[1], 'version', nv)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[2])
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
return 1
"""

# KEYS: meta, state. A consistent snapshot of one stream: its meta hash and its state (a script runs
# atomically; one command costs the event loop less than a MULTI/EXEC pipeline of two)
_GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
"""

# KEYS: meta, state, index.
_DELETE = """
local idx = redis.call('HGET', KEYS[1], '_index')
redis.call('DEL', KEYS[1], KEYS[2])
if idx then
  redis.call('ZREM', KEYS[3], idx)
  return 1
end
return 0
"""


#: connections one store (one service process) opens to Redis at most (module docstring)
MAX_CONNECTIONS = 128
#: redis-py's messages for "no connection could be had": the command was never sent
_NO_CONNECTION = ("connecting to", "No connection available", "Too many connections")


def _pool_options() -> dict[str, Any]:
    """Connection-pool options: maintenance notifications off where redis-py has them (module docstring)."""
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # an older redis-py: no such notifications, the check always runs
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


class StoreUnavailable(RuntimeError):  # noqa: N818 (the name the API layer uses)
    """The store cannot be reached (connection refused/reset, timeout, Redis still loading)."""


class StoreOutcomeUnknown(StoreUnavailable):
    """A write was sent but its answer never came: it may or may not have been applied (module docstring)."""


def _not_sent(e: BaseException) -> bool:
    """True when the command cannot have reached Redis: no connection could be had (refused, no socket file, a
    connect timeout, the pool exhausted: redis-py's messages in ``_NO_CONNECTION``, wherever they sit in the
    exception chain) or Redis rejected it while loading its data."""
    seen = 0
    x: BaseException | None = e
    while x is not None and seen < 8:
        if isinstance(x, rexc.BusyLoadingError | ConnectionRefusedError | FileNotFoundError):
            return True
        if isinstance(x, rexc.ConnectionError | rexc.TimeoutError) and any(m in str(x) for m in _NO_CONNECTION):
            return True
        x, seen = x.__cause__ or x.__context__, seen + 1
    return False


@asynccontextmanager
async def _guard(write: bool = False) -> AsyncIterator[None]:
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
        if write and not _not_sent(e):
            raise StoreOutcomeUnknown(f"state store did not answer a write (it may have been applied): {e}") from e
        raise StoreUnavailable(f"state store unavailable: {e}") from e


def _check_name(field: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{field}: expected 1-128 characters from A-Z a-z 0-9 . _ ~ -, got {value!r}")


def _check_ttl(ttl: int) -> int:
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
        raise ValueError(f"ttl: expected a positive whole number of seconds, got {ttl!r}")
    return ttl


def _check_event(event: tuple[str, str] | None) -> tuple[str, str]:
    """The script's event arguments: ``(channel, payload)``, or ``("", "")`` for no event."""
    if event is None:
        return "", ""
    if not (isinstance(event, tuple) and len(event) == 2 and all(isinstance(x, str) for x in event) and event[0]):
        raise ValueError(f"event: expected (channel, payload) strings with a non-empty channel, got {event!r}")
    return event


def _encode_fields(meta: dict[str, Any]) -> list[str]:
    """Flatten meta into HSET arguments, one JSON value per field (store-owned fields dropped)."""
    args: list[str] = []
    for k, v in meta.items():
        if not isinstance(k, str) or k in _RESERVED:
            continue
        args += [k, json.dumps(v, separators=(",", ":"))]
    return args


def _decode_meta(raw: dict[bytes, bytes]) -> dict[str, Any]:
    return {k.decode(): json.loads(v) for k, v in raw.items() if k != b"_index"}


def _encode_cursor(member: bytes) -> str:
    return base64.urlsafe_b64encode(member).decode().rstrip("=")


def _decode_cursor(cursor: str) -> bytes:
    try:
        member = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, _, stream_id = member.decode().partition(":")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ValueError("cursor: not a cursor returned by a previous page") from None
    if not created.isdigit() or not _NAME.match(stream_id):
        raise ValueError("cursor: not a cursor returned by a previous page")
    return member


class StreamStore:
    """Per-tenant stream documents and particle states in Redis (see the module docstring).

    ``client`` must be a ``redis.asyncio.Redis`` with ``decode_responses=False`` (states are bytes).
    """

    def __init__(self, client: aredis.Redis, prefix: str = "mpflow"):
        if not _PREFIX.match(prefix):
            raise ValueError(f"prefix: expected 1-64 characters from A-Z a-z 0-9 . _ -, got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._create = client.register_script(_CREATE)
        self._cas = client.register_script(_CAS)
        self._delete = client.register_script(_DELETE)
        self._get = client.register_script(_GET)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "mpflow",
        timeout: float = 5.0,
        max_connections: int = MAX_CONNECTIONS,
        **kwargs: Any,
    ) -> StreamStore:
        """A store over a new connection pool to ``url`` (``redis://``, ``rediss://`` or ``unix://``) of at most
        ``max_connections`` connections; a command that finds them all busy waits up to ``timeout`` s for one."""
        pool = aredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            decode_responses=False,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            **{**_pool_options(), **kwargs},
        )
        return cls(aredis.Redis.from_pool(pool), prefix)

    async def aclose(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------ keys
    def _keys(self, tenant: str, stream_id: str) -> tuple[str, str]:
        _check_name("tenant", tenant)
        _check_name("stream_id", stream_id)
        tag = f"{self.prefix}:{{{tenant}:{stream_id}}}"
        return f"{tag}:meta", f"{tag}:state"

    def keys(self, tenant: str, stream_id: str) -> tuple[str, str]:
        """The ``(meta, state)`` key names of a stream, for operators' tools (``MEMORY USAGE``, ``TTL``, ...)."""
        return self._keys(tenant, stream_id)

    def _index(self, tenant: str) -> str:
        _check_name("tenant", tenant)
        return f"{self.prefix}:tenant:{tenant}:streams"

    # ------------------------------------------------------------------ operations
    async def create(self, tenant: str, stream_id: str, meta: dict[str, Any], state_bytes: bytes, ttl: int) -> bool:
        """Write a new stream at version 1; ``False`` (nothing written) if ``stream_id`` exists."""
        meta_key, state_key = self._keys(tenant, stream_id)
        member = f"{time.time_ns() // 1_000_000:015d}:{stream_id}"
        fields = [*_encode_fields(meta), "version", "1", "_index", member]
        args = [_check_ttl(ttl), bytes(state_bytes), member, *fields]
        async with _guard(write=True):
            return bool(await self._create(keys=[meta_key, state_key, self._index(tenant)], args=args))

    async def get(self, tenant: str, stream_id: str) -> tuple[dict[str, Any], bytes] | None:
        """``(meta, state_bytes)`` read by one script (a consistent snapshot), or ``None`` if absent."""
        meta_key, state_key = self._keys(tenant, stream_id)
        async with _guard():
            flat, state = await self._get(keys=[meta_key, state_key])
        if not flat or state is None:
            return None
        return _decode_meta(dict(zip(flat[::2], flat[1::2], strict=True))), state

    async def compare_and_set(
        self,
        tenant: str,
        stream_id: str,
        expected_version: int,
        new_meta: dict[str, Any],
        new_state_bytes: bytes,
        ttl: int,
        event: tuple[str, str] | None = None,
    ) -> bool:
        """Write iff the stored version is ``expected_version``; then version becomes expected + 1.

        ``new_meta`` fields are merged into the stored meta (fields not given keep their value; ``version``
        is the store's). ``False`` — nothing written — on a version mismatch or a missing stream.
        ``event``: ``(channel, payload)`` to PUBLISH, in the same script, once the write is done (never when
        nothing was written); the number of subscribers it reached is not reported.
        """
        if isinstance(expected_version, bool) or not isinstance(expected_version, int):
            raise ValueError(f"expected_version: expected an integer, got {expected_version!r}")
        meta_key, state_key = self._keys(tenant, stream_id)
        head = [str(expected_version), _check_ttl(ttl), bytes(new_state_bytes), *_check_event(event)]
        args = [*head, *_encode_fields(new_meta)]
        async with _guard(write=True):
            return bool(await self._cas(keys=[meta_key, state_key], args=args))

    async def delete(self, tenant: str, stream_id: str) -> bool:
        """Remove a stream (both keys and its index entry); ``False`` if it did not exist."""
        meta_key, state_key = self._keys(tenant, stream_id)
        async with _guard(write=True):
            return bool(await self._delete(keys=[meta_key, state_key, self._index(tenant)]))

    async def list(
        self, tenant: str, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the tenant's streams, oldest first: ``(items, next_cursor)``.

        Each item is the stream's meta plus ``stream_id``. ``next_cursor`` is ``None`` on the last page.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValueError(f"limit: expected an integer in 1..1000, got {limit!r}")
        index = self._index(tenant)
        start = b"-" if cursor is None else b"(" + _decode_cursor(cursor)
        items: list[dict[str, Any]] = []
        last: bytes | None = None
        async with _guard():
            while len(items) < limit:
                need = limit - len(items)
                members = await self.client.zrange(index, start, b"+", bylex=True, offset=0, num=need)
                if not members:
                    return items, None
                ids = [m.decode().partition(":")[2] for m in members]
                async with self.client.pipeline(transaction=False) as pipe:
                    for sid in ids:
                        pipe.hgetall(self._keys(tenant, sid)[0])
                    metas = await pipe.execute()
                stale = []
                for member, sid, raw in zip(members, ids, metas, strict=True):
                    if raw and raw.get(b"_index") == member:
                        items.append({"stream_id": sid, **_decode_meta(raw)})
                    else:  # expired, or an older stream of a re-created id
                        stale.append(member)
                if stale:
                    await self.client.zrem(index, *stale)
                last = members[-1]
                if len(members) < need:
                    return items, None
                start = b"(" + last
            more = await self.client.zlexcount(index, start, b"+")
        return items, (_encode_cursor(last) if more and last is not None else None)

    async def ping(self) -> bool:
        """``True`` when Redis answers; ``False`` (never raises) when it does not."""
        try:
            return bool(await self.client.ping())
        except (rexc.RedisError, OSError):
            return False

    async def count(self) -> int:
        """Streams over all tenants (sum of index sizes; may include expired, not yet pruned, streams)."""
        total = 0
        async with _guard():
            async for key in self.client.scan_iter(match=f"{self.prefix}:tenant:*:streams", count=500):
                total += await self.client.zcard(key)
        return total


__all__ = ["StoreOutcomeUnknown", "StoreUnavailable", "StreamStore"]
