"""The stream state store: Redis, written by compare-and-set on a per-stream version.

Keys (``<p>`` is the prefix, ``mpflow`` by default; ``{...}`` is the Redis Cluster hash tag, so one stream's
keys, and its event channel, live in one slot and a Lua script may touch them all)::

    <p>:{<tenant>:<stream_id>}:meta   hash: one JSON-encoded value per meta field (model, method,
                                      num_particles, created_at, updated_at, step, the current ``summary``,
                                      ...) plus ``version`` and the internal ``_index`` (the stream's index member)
    <p>:{<tenant>:<stream_id>}:state  string: ``ParticleState.to_bytes()``
    <p>:{<tenant>:<stream_id>}:history list: the per-step history, one JSON entry per applied step, oldest first,
                                      capped to the last ``history_steps`` (``MPFLOW_HISTORY_STEPS``); it exists
                                      from the first update on (:mod:`mpflow.service.streams.history`)
    <p>:{<tenant>:<stream_id>}:ack    never left set: what a script that changes nothing writes (set and
                                      deleted at once) so that ``WAIT`` covers it ("Replica acknowledgement")
    <p>:tenant:<tenant>:streams       sorted set, the tenant's listing index (see below); one key, so any
                                      command on it is single-slot
    <p>:readyz                        string: what ``/readyz`` writes to check that the store takes writes
    <p>:secret:<name>                 string: a deployment's generated secret (the snapshot key,
                                      :mod:`mpflow.service.streams.snapshot_signing`), set once, no TTL

One server or a Redis Cluster: the mode is told from the URL alone (:mod:`mpflow.service.store.redis_conn`). Every
script touches the keys of one stream only (one slot); the listing index is written by commands of its own.

Every key of a stream carries the stream's TTL; every successful write refreshes it. The history is written by
the compare-and-set script itself (RPUSH then LTRIM to the cap), so it holds exactly the steps of the writes that
happened — never a step of a write that lost its race, never one twice — and it is deleted with the stream.

Exactly-once updates. ``create`` writes version 1. ``compare_and_set(expected_version)`` is one Lua script:
it writes only if the stored version equals ``expected_version`` and then stores version + 1, so of any
number of writers that read the same version exactly one wins. The service loops
read → compute → CAS; on ``False`` it re-reads and applies docs/API.md's ``seq`` rules (applied, duplicate, 409)
against the fresh ``step``. A write is acknowledged only after the script returns. The CAS may carry an event
``(channel, payload)`` (live viewers' update, :mod:`mpflow.service.streams.publish`): the script PUBLISHes it right
after its write and only then — one round trip, no event for a write that did not happen, and none lost between
the write and a separate PUBLISH. On a Redis Cluster the script SPUBLISHes (sharded pub/sub) on a channel that
carries the stream's hash tag, so the script stays single-slot and the event stays on the stream's shard.

Reads. ``get`` is one script (a consistent snapshot of meta and state) for a state of at most
:data:`INLINE_STATE_BYTES`; a larger state is never passed through Lua — a script that answers an 84 MB string held
Redis 0.45 s, every other client waiting, a ``GET`` of it 45 ms (measured) — but fetched by ``GET`` after the script
answered the meta and the state's size, and kept only when the stream's version and index member read after it are
unchanged (else read again). ``peek`` is that script alone: the meta and the state's size, without the state when it
is larger than asked (what a read prices itself by before fetching it, :mod:`mpflow.service.streams.state_reads`).
``remember`` sets meta fields derived from a version's state (a summary) while the stream is at that version.

Replica acknowledgement (``wait_replicas = N > 0``): every write (create, compare-and-set, delete) is followed on
its connection by ``WAIT N wait_timeout_ms`` and acknowledged only when N replicas have it; otherwise the write
is on the primary only and :class:`StoreOutcomeUnknown` is raised
(:func:`mpflow.service.store.redis_conn.run_acknowledged`). So is every answer that acknowledges a write without making
one — a ``duplicate`` (:meth:`StreamStore.confirm`), a create that finds the stream, a delete that finds none (what a
client retrying after a 503 is told). Those scripts write too, something that changes nothing (``_NO_CHANGE``: a scratch
key of the stream's slot set and deleted), because ``WAIT`` proves nothing about another connection's writes: Redis
keeps, per connection, the replication offset after that connection's last write and waits for the replicas to reach it
— a connection that wrote nothing waits for offset 0, which every connected replica has. The no-change write's offset
lies past every write the primary ran before it, the acknowledged one included (the script sees it there), and a replica
at that offset holds the primary's data as of then (one ordered replication stream). The script checks the stream on the
same node in the same atomic step: a failover between the service's read and the proof that lost the write shows as
a changed version (``confirm`` answers ``False``: read again, and the step is applied anew), never as a proof
from a primary that does not have it. Measured in ``benchmarks/cluster_faults.py``.

Listing index (decision). A sorted set per tenant, all scores 0, members ``<created_ms, 15 digits>:<stream_id>``
and range queries by lex order: this orders streams by creation time, breaks ties by id, and a page
cursor (the last member, base64url-encoded: opaque to clients) resumes exactly after it — no stream is
skipped or repeated when streams are added or removed between pages. SCAN was rejected: it walks the
whole keyspace, may return a key twice, and cannot be scoped to a tenant without a full walk. TTL
expiry does not remove index members; ``list`` drops (and ZREMs) members whose meta key is gone or
belongs to a newer stream of the same id, so a page may hold fewer than ``limit`` items (and the last
page may be empty). ``count`` sums the indexes' sizes, so it may include expired, not-yet-pruned streams.

The index and the stream are two writes (on a cluster they are in different slots, and a script or transaction
may not span slots), ordered so that the index is never *missing* a stored stream: ``create`` adds the index
member first and then runs the create script (and removes its member again when the id exists already);
``delete`` runs the delete script first and then removes the member. A crash in between leaves at worst a stale
member, which ``list`` prunes like an expired stream's. One code path on one server and on a cluster.

Connection failures (refused, reset, timeout, Redis loading, a connection closed while a command used it) and a
Redis that refuses writes (a read-only replica, out of memory, a failed RDB save, a cluster that is down or whose
slot is moving) raise :class:`StoreUnavailable`, which the API answers with 503 and ``Retry-After``. A *write*
(create, compare-and-set, delete) that was sent but got no answer — a timeout, or the connection lost mid-command —
raises its subclass :class:`StoreOutcomeUnknown`: Redis may still execute it (a frozen or overloaded server runs the
command once it wakes), so "nothing was applied" is not known; with ``seq`` a retry tells (``duplicate``). Measured
in ``benchmarks/reliability.py`` (freeze).

On one server the connection pool is a blocking one of at most ``MAX_CONNECTIONS`` (on a cluster, a pool of that
size per node): a command that finds every connection busy waits (up to the timeout) for one. redis-py's default
pool (100 connections in redis-py 8) fails it at once with "Too many connections", which under a soak of 100
concurrent streams shows as hundreds of spurious 503s.

Pooled connections are checked when taken from the pool, so that after a Redis restart (or a failover, or a
proxy's idle timeout) a connection the server closed is reopened instead of failing its next command: recent
redis-py (8.1 here) skips that check while "maintenance notifications" (a Redis Cloud/Enterprise feature, on by
default with RESP3) are enabled, so the store turns them off (measured: without it, every idle connection
answered one 503 after a restart; tests/reliability).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import re
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from mpflow.service.store.redis_conn import (
    Subscription,
    detect_cluster,
    detect_cluster_async,
    open_client,
    run_acknowledged,
)
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

#: what a name that is part of a store key may be (a tenant, a stream id): the one id pattern of the API too
#: (``mpflow.service.schemas.STREAM_ID_PATTERN``), so that no name reaches another's keys or hash tag
NAME_PATTERN = r"^[A-Za-z0-9._~-]{1,128}$"
_NAME = re.compile(NAME_PATTERN)
_PREFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# fields the store owns: callers' values for these are ignored
_RESERVED = ("version", "_index")

# What a script writes when it changes nothing, so that the WAIT after it still covers every write before it:
# a scratch key of the stream's slot (KEYS[4]) set and deleted (module docstring, "Replica acknowledgement")
_NO_CHANGE = "redis.call('SET', KEYS[4], '1') redis.call('DEL', KEYS[4])"

# KEYS: meta, state, history, scratch. ARGV: ttl, state bytes, field, value, ... Answers 1, or the existing
# stream's index member. A new stream starts without history (none of an earlier stream of the same id is kept).
_CREATE = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then {_NO_CHANGE} return redis.call('HGET', KEYS[1], '_index') or '' end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1])
return 1
"""

# KEYS: meta, state, history. ARGV: expected version, ttl, state bytes, event channel ('' for no event), event
# payload, history cap, number k of history entries, the k entries, field, value, ... The event is published only
# after a write, in the same script; PUBLISH becomes SPUBLISH on a cluster (the channel then carries the stream's
# hash tag: the same slot as the keys).
_CAS = """
local v = redis.call('HGET', KEYS[1], 'version')
if (not v) or (v ~= ARGV[1]) then return 0 end
local nv = string.format('%d', tonumber(v) + 1)
local k = tonumber(ARGV[7])
if #ARGV > 7 + k then redis.call('HSET', KEYS[1], unpack(ARGV, 8 + k)) end
redis.call('HSET', KEYS[1], 'version', nv)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[2])
if k > 0 then
  for i = 8, 7 + k, 1000 do redis.call('RPUSH', KEYS[3], unpack(ARGV, i, math.min(i + 999, 7 + k))) end
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[6]), -1)
end
redis.call('EXPIRE', KEYS[3], ARGV[2])
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
return 1
"""

# KEYS: the secret's key. ARGV: a candidate value. The value kept: the candidate when none was, else the first one
# set (SET NX and GET in one script: every replica that races gets the same answer; one key, so one slot)
_SECRET = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""

# KEYS: meta, state. ARGV: the most state bytes to answer. A consistent snapshot of one stream: its meta hash and
# its state (a script runs atomically; one command costs the event loop less than a MULTI/EXEC pipeline of two) —
# or, for a state of more than ARGV[1] bytes, its size instead (a string passed through Lua is copied twice while
# Redis serves no one else: 0.45 s for 84 MB, measured; :meth:`StreamStore.peek`)
_GET = """
local meta = redis.call('HGETALL', KEYS[1])
local size = redis.call('STRLEN', KEYS[2])
if size > tonumber(ARGV[1]) then return {meta, size} end
return {meta, redis.call('GET', KEYS[2])}
"""

# KEYS: meta. ARGV: the version read, field, value, ... Sets the fields when the stream is still at that version (a
# value derived from that version's state: a summary computed for a stream stored without one); answers 1 or 0
_REMEMBER = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""

# KEYS: meta, state, history, scratch. Answers the deleted stream's index member, or 0 when there was none.
_DELETE = f"""
local idx = redis.call('HGET', KEYS[1], '_index')
if redis.call('DEL', KEYS[1], KEYS[2], KEYS[3]) == 0 then {_NO_CHANGE} end
return idx or 0
"""

# KEYS: meta, _, _, scratch. ARGV: the version the caller read. Answers 1 when the stream is still at that version,
# else 0 (another write came, or a failover lost the one read); a write that changes nothing either way.
_CONFIRM = f"""
{_NO_CHANGE}
if redis.call('HGET', KEYS[1], 'version') == ARGV[1] then return 1 end
return 0
"""

# KEYS: meta, history. ARGV: how many of the latest entries. Answers false for no stream, else {its step (JSON;
# 'null' when its meta has none), the entries, oldest first}
_HISTORY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local step = redis.call('HGET', KEYS[1], 'step') or 'null'
return {step, redis.call('LRANGE', KEYS[2], -tonumber(ARGV[1]), -1)}
"""

# KEYS: the readiness key. ARGV: a value. A write as small as it gets, through the same path as every write.
_PROBE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)
return 1
"""


#: connections one store (one service process) opens to Redis at most (module docstring)
MAX_CONNECTIONS = 128
#: the most state bytes a read takes through the read script; a larger state is fetched by a plain GET (``_GET``)
INLINE_STATE_BYTES = 256 * 1024
#: reads of a large state, each retried when the stream changed between its meta and its state (:meth:`StreamStore.get`)
STATE_READ_TRIES = 5
#: redis-py's messages for "no connection could be had": the command was never sent
_NO_CONNECTION = ("connecting to", "No connection available", "Too many connections")
#: Redis refused a command before running it: it takes no writes now (a replica, a cluster down or resharding)
_REFUSED = (rexc.ReadOnlyError, rexc.ClusterDownError, rexc.TryAgainError, rexc.SlotNotCoveredError)
#: the same, told by the error's first word (out of memory, a failed RDB save, too few replicas for min-replicas)
_REFUSED_CODES = ("OOM", "MISCONF", "NOREPLICAS", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "MASTERDOWN")


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


def _torn_down(e: BaseException) -> bool:
    """True for what redis-py's asyncio connections raise when a connection is closed while a command uses it
    (``'NoneType' object has no attribute 'writelines'``, uvloop's "the handler is closed", ...) instead of a
    ``ConnectionError`` (redis-py issue 4287; on a cluster, a topology refresh closes the connections of every
    node at once): the error comes from inside redis-py's or asyncio's connection code, not from the store's."""
    frames = traceback.extract_tb(e.__traceback__)
    where = frames[-1].filename.replace(os.sep, "/") if frames else ""
    stdlib_asyncio = "/asyncio/" in where and "/site-packages/" not in where
    return "/redis/asyncio/" in where or stdlib_asyncio or "uvloop/" in where


@asynccontextmanager
async def guard(write: bool = False) -> AsyncIterator[None]:
    """Around the store's Redis commands (its own and those of :mod:`.quotas`): a connection failure, a torn-down
    connection or a refusing server becomes :class:`StoreUnavailable` (503, nothing applied) — or, for a ``write``
    that may have reached the server, :class:`StoreOutcomeUnknown` (503, retry with the same seq to learn)."""
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
        if write and not _not_sent(e):
            raise StoreOutcomeUnknown(f"state store did not answer a write (it may have been applied): {e}") from e
        raise StoreUnavailable(f"state store unavailable: {e}") from e
    except (AttributeError, TypeError, RuntimeError) as e:
        if not _torn_down(e):
            raise
        if write:
            raise StoreOutcomeUnknown(
                f"state store connection closed under a write (it may have been applied): {e}"
            ) from e
        raise StoreUnavailable(f"state store connection closed under a command: {e}") from e
    except _REFUSED as e:
        raise StoreUnavailable(f"state store refuses commands now: {e}") from e
    except rexc.ResponseError as e:
        if str(e).split(" ", 1)[0] in _REFUSED_CODES:
            raise StoreUnavailable(f"state store refuses writes now: {e}") from e
        raise


def check_name(field: str, value: str) -> None:
    """ValueError unless ``value`` may be part of a key (a tenant, a stream id): 1-128 characters of
    ``[A-Za-z0-9._~-]``, so that no name reaches another's keys or hash tag."""
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

    ``client`` must be a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster`` with
    ``decode_responses=False`` (states are bytes). ``wait_replicas``/``wait_timeout_ms``: replica acknowledgement
    of every write (module docstring; 0: none). ``reopen(cluster)``: a new client for the store's URL, for a store
    whose mode (one server or a cluster) was not known when it was made: the first command that gets an answer
    decides it (:meth:`from_url`).
    """

    def __init__(
        self,
        client: Any,
        prefix: str = "mpflow",
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        reopen: Any = None,
    ):
        if not _PREFIX.match(prefix):
            raise ValueError(f"prefix: expected 1-64 characters from A-Z a-z 0-9 . _ -, got {prefix!r}")
        if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int) or wait_replicas < 0:
            raise ValueError(f"wait_replicas: expected a whole number >= 0, got {wait_replicas!r}")
        if isinstance(wait_timeout_ms, bool) or not isinstance(wait_timeout_ms, int) or wait_timeout_ms <= 0:
            raise ValueError(f"wait_timeout_ms: expected a positive whole number, got {wait_timeout_ms!r}")
        self.prefix = prefix
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._reopen = reopen
        self._deciding = asyncio.Lock()
        self._use(client)

    def _use(self, client: Any) -> None:
        """Talk through ``client`` from now on (its scripts registered on it)."""
        self.client = client
        #: True on a Redis Cluster: scripts SPUBLISH and feeds SSUBSCRIBE
        self.cluster = isinstance(client, RedisCluster)
        publish = "SPUBLISH" if self.cluster else "PUBLISH"
        self._create = client.register_script(_CREATE)
        self._cas = client.register_script(_CAS.replace("'PUBLISH'", f"'{publish}'"))
        self._delete = client.register_script(_DELETE)
        self._confirm = client.register_script(_CONFIRM)
        self._get = client.register_script(_GET)
        self._remember = client.register_script(_REMEMBER)
        self._history = client.register_script(_HISTORY)
        self._probe = client.register_script(_PROBE)
        self._secret = client.register_script(_SECRET)

    async def _decided(self) -> None:
        """Decide between one server and a cluster if :meth:`from_url` could not (its node did not answer)."""
        if self._reopen is None:
            return
        async with self._deciding:
            if self._reopen is None:
                return
            async with guard():
                cluster = await detect_cluster_async(self.client)
            if cluster:
                old = self.client
                self._use(self._reopen(True))
                await old.aclose()
            self._reopen = None

    async def _write(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a write script, followed by ``WAIT`` when replica acknowledgement is on (module docstring)."""
        if not self.wait_replicas:
            return await script(keys=keys, args=args)
        return await run_acknowledged(self.client, script.script, keys, args, self.wait_replicas, self.wait_timeout_ms)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "mpflow",
        timeout: float = 5.0,
        max_connections: int = MAX_CONNECTIONS,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        cluster: bool | None = None,
        **kwargs: Any,
    ) -> StreamStore:
        """A store over new connections to ``url`` (``redis://``, ``rediss://`` or ``unix://``), at most
        ``max_connections`` (per node on a cluster); on one server a command that finds them all busy waits up to
        ``timeout`` s for one. ``cluster``: ``None`` asks the node (blocking, at most 2 s; a node that does not
        answer leaves it to the first command that gets an answer)."""
        if wait_replicas and wait_timeout_ms >= 1000 * timeout:
            raise ValueError(
                f"wait_timeout_ms: must be below the store's command timeout ({1000 * timeout:.0f} ms), "
                f"got {wait_timeout_ms}"
            )
        if cluster is None:
            cluster = detect_cluster(url, min(timeout, 2.0))
        decided = cluster is not None

        def reopen(as_cluster: bool) -> Any:
            return open_client(url, as_cluster, timeout, max_connections, **kwargs)

        return cls(
            reopen(bool(cluster)),
            prefix,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
            reopen=None if decided else reopen,
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------ keys
    def _keys(self, tenant: str, stream_id: str) -> tuple[str, str]:
        check_name("tenant", tenant)
        check_name("stream_id", stream_id)
        tag = f"{self.prefix}:{{{tenant}:{stream_id}}}"
        return f"{tag}:meta", f"{tag}:state"

    def keys(self, tenant: str, stream_id: str) -> tuple[str, str]:
        """The ``(meta, state)`` key names of a stream, for operators' tools (``MEMORY USAGE``, ``TTL``, ...)."""
        return self._keys(tenant, stream_id)

    def history_key(self, tenant: str, stream_id: str) -> str:
        """The key of a stream's per-step history (same hash tag, so the same slot, as its other keys)."""
        return self._script_keys(tenant, stream_id)[2]

    def _script_keys(self, tenant: str, stream_id: str) -> list[str]:
        """The write scripts' KEYS: meta, state, history and the scratch key of ``_NO_CHANGE`` (never left set)."""
        meta_key, state_key = self._keys(tenant, stream_id)
        tag = meta_key.removesuffix(":meta")
        return [meta_key, state_key, f"{tag}:history", f"{tag}:ack"]

    def _index(self, tenant: str) -> str:
        check_name("tenant", tenant)
        return f"{self.prefix}:tenant:{tenant}:streams"

    # ------------------------------------------------------------------ operations
    async def create(self, tenant: str, stream_id: str, meta: dict[str, Any], state_bytes: bytes, ttl: int) -> bool:
        """Write a new stream at version 1; ``False`` (nothing written) if ``stream_id`` exists — an answer that,
        with replica acknowledgement, also waits until the existing stream is on the replicas."""
        index = self._index(tenant)
        member = f"{time.time_ns() // 1_000_000:015d}:{stream_id}"
        fields = [*_encode_fields(meta), "version", "1", "_index", member]
        args = [_check_ttl(ttl), bytes(state_bytes), *fields]
        await self._decided()
        async with guard(write=True):
            await self.client.zadd(index, {member: 0})  # first: the index never misses a stored stream
            result = await self._write(self._create, self._script_keys(tenant, stream_id), args)
            if result == 1:
                return True
            if result != member.encode():  # the id exists: our member goes (unless it is the existing stream's)
                await self.client.zrem(index, member)
            return False

    async def get(self, tenant: str, stream_id: str) -> tuple[dict[str, Any], bytes] | None:
        """``(meta, state_bytes)``, a consistent snapshot, or ``None`` if absent: read by one script, or — a state of
        more than :data:`INLINE_STATE_BYTES` — its meta by the script and its state by ``GET``, kept only when the
        stream's version and index member are unchanged after it (every write changes the version, a re-created
        stream its member); else read again, :data:`STATE_READ_TRIES` times at most (then 503)."""
        meta_key, state_key = self._keys(tenant, stream_id)
        for _ in range(STATE_READ_TRIES):
            got = await self._read(meta_key, state_key, INLINE_STATE_BYTES)
            if got is None:
                return None
            raw, state, _ = got
            if state is None:
                async with guard():
                    state = await self.client.get(state_key)
                    now = await self.client.hmget(meta_key, ["version", "_index"])
                if now != [raw.get(b"version"), raw.get(b"_index")]:
                    state = None
            if state is not None:
                return _decode_meta(raw), state
        raise StoreUnavailable(f"stream {stream_id!r} changed under each of {STATE_READ_TRIES} reads of its state")

    async def peek(
        self, tenant: str, stream_id: str, inline_bytes: int = INLINE_STATE_BYTES
    ) -> tuple[dict[str, Any], bytes | None, int] | None:
        """``(meta, state_bytes, size)`` read by one script, without fetching a state of more than ``inline_bytes``
        (``None`` in its place; :meth:`get` reads it), or ``None`` if absent; ``inline_bytes`` -1: never the state.
        What a read prices its work by before it fetches the state (``size``: the state's bytes)."""
        got = await self._read(*self._keys(tenant, stream_id), inline_bytes)
        if got is None:
            return None
        raw, state, size = got
        return _decode_meta(raw), state, size

    async def _read(
        self, meta_key: str, state_key: str, inline_bytes: int
    ) -> tuple[dict[bytes, bytes], bytes | None, int] | None:
        """(raw meta, the state or None when over ``inline_bytes``, its size) by the read script; None if absent."""
        await self._decided()
        async with guard():
            flat, state = await self._get(keys=[meta_key, state_key], args=[inline_bytes])
        if not flat or state is None or (isinstance(state, int) and state <= 0):
            return None
        raw = dict(zip(flat[::2], flat[1::2], strict=True))
        if isinstance(state, int):
            return raw, None, state
        return raw, state, len(state)

    async def remember(self, tenant: str, stream_id: str, version: int, fields: dict[str, Any]) -> bool:
        """Set meta ``fields`` (JSON-encoded) iff the stream is still at ``version``, without changing it: values
        derived from that version's state (a summary computed for a stream stored without one). ``False``: the
        stream changed (or is gone). Not a write of the stream's data: no replica acknowledgement."""
        meta_key, _ = self._keys(tenant, stream_id)
        if not _encode_fields(fields):
            return False
        await self._decided()
        async with guard(write=True):
            return bool(await self._remember(keys=[meta_key], args=[str(version), *_encode_fields(fields)]))

    async def compare_and_set(
        self,
        tenant: str,
        stream_id: str,
        expected_version: int,
        new_meta: dict[str, Any],
        new_state_bytes: bytes,
        ttl: int,
        event: tuple[str, str] | None = None,
        history: Sequence[str] = (),
        history_steps: int = 1,
    ) -> bool:
        """Write iff the stored version is ``expected_version``; then version becomes expected + 1.

        ``new_meta`` fields are merged into the stored meta (fields not given keep their value; ``version``
        is the store's). ``False`` — nothing written — on a version mismatch or a missing stream.
        ``event``: ``(channel, payload)`` to PUBLISH, in the same script, once the write is done (never when
        nothing was written); the number of subscribers it reached is not reported.
        ``history``: the write's steps, one encoded entry each, appended to the stream's history in the same script,
        which then keeps its last ``history_steps`` entries.
        """
        if isinstance(expected_version, bool) or not isinstance(expected_version, int):
            raise ValueError(f"expected_version: expected an integer, got {expected_version!r}")
        if isinstance(history_steps, bool) or not isinstance(history_steps, int) or history_steps < 1:
            raise ValueError(f"history_steps: expected a positive whole number, got {history_steps!r}")
        meta_key, state_key = self._keys(tenant, stream_id)
        entries = list(history)[-history_steps:]
        head = [str(expected_version), _check_ttl(ttl), bytes(new_state_bytes), *_check_event(event)]
        args = [*head, history_steps, len(entries), *entries, *_encode_fields(new_meta)]
        keys = [meta_key, state_key, self.history_key(tenant, stream_id)]
        await self._decided()
        async with guard(write=True):
            return bool(await self._write(self._cas, keys, args))

    async def confirm(self, tenant: str, stream_id: str, version: int) -> bool:
        """Whether the stream is still at ``version``, the one a reader saw, once that is on the replicas: what a
        ``duplicate`` answer needs before it acknowledges the write it found (module docstring). ``True`` at once
        without replica acknowledgement; ``False``: read again (a write came since, or a failover lost the one
        read); :class:`StoreOutcomeUnknown` when too few replicas have it."""
        if not self.wait_replicas:
            return True
        keys = self._script_keys(tenant, stream_id)
        await self._decided()
        async with guard(write=True):
            return bool(await self._write(self._confirm, keys, [str(version)]))

    async def history(self, tenant: str, stream_id: str, limit: int) -> tuple[int | None, list[bytes]] | None:
        """``(step, entries)``: the stream's ``step`` meta field and its latest ``limit`` history entries (encoded,
        oldest first), read by one script (a consistent pair); ``None`` for no stream."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit: expected a positive whole number, got {limit!r}")
        meta_key, _ = self._keys(tenant, stream_id)
        await self._decided()
        async with guard():
            got = await self._history(keys=[meta_key, self.history_key(tenant, stream_id)], args=[limit])
        if got is None:
            return None
        step, entries = got
        return json.loads(step), list(entries)

    async def delete(self, tenant: str, stream_id: str) -> bool:
        """Remove a stream (its keys, history included, and its index entry); ``False`` if it did not exist — an
        answer that, with replica acknowledgement, also waits until its absence is on the replicas."""
        index = self._index(tenant)
        await self._decided()
        async with guard(write=True):
            member = await self._write(self._delete, self._script_keys(tenant, stream_id), [])
            if not member:
                return False
            await self.client.zrem(index, member)  # after: the index never misses a stored stream
            return True

    async def list(
        self, tenant: str, limit: int = 100, cursor: str | None = None, fields: Sequence[str] | None = None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the tenant's streams, oldest first: ``(items, next_cursor)``.

        Each item is the stream's meta (only its ``fields`` when given: ``HMGET`` instead of ``HGETALL``, so that a
        page does not carry each stream's summary) plus ``stream_id``. ``next_cursor`` is ``None`` on the last page.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValueError(f"limit: expected an integer in 1..1000, got {limit!r}")
        index = self._index(tenant)
        start = b"-" if cursor is None else b"(" + _decode_cursor(cursor)
        items: list[dict[str, Any]] = []
        last: bytes | None = None
        await self._decided()
        async with guard():
            while len(items) < limit:
                need = limit - len(items)
                members = await self.client.zrange(index, start, b"+", bylex=True, offset=0, num=need)
                if not members:
                    return items, None
                ids = [m.decode().partition(":")[2] for m in members]
                async with self.client.pipeline(transaction=False) as pipe:
                    for sid in ids:
                        if fields is None:
                            pipe.hgetall(self._keys(tenant, sid)[0])
                        else:
                            pipe.hmget(self._keys(tenant, sid)[0], [*fields, "_index"])
                    metas = await pipe.execute()
                if fields is not None:
                    names = [f.encode() for f in (*fields, "_index")]
                    metas = [{k: v for k, v in zip(names, got, strict=True) if v is not None} for got in metas]
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
            await self._decided()
            return bool(await self.client.ping())
        except (StoreUnavailable, rexc.RedisError, OSError):
            return False

    async def writable(self) -> bool:
        """``True`` when the store takes a write now — the ``<p>:readyz`` key, through the path of every write
        (with replica acknowledgement when it is on); ``False`` (never raises) when it does not: unreachable, a
        read-only replica, out of memory, a cluster that is down, too few replicas acknowledging."""
        try:
            await self._decided()
            async with guard(write=True):
                return bool(await self._write(self._probe, [f"{self.prefix}:readyz"], [str(time.time())]))
        except (StoreUnavailable, rexc.RedisError, OSError):
            return False

    async def subscription(self, channel: str) -> Subscription:
        """A started subscription to ``channel`` (sharded on a cluster: :class:`~.redis_conn.Subscription`)."""
        await self._decided()
        sub = Subscription(self.client, channel)
        try:
            async with guard():
                await sub.start()
        except BaseException:
            await sub.aclose()
            raise
        return sub

    async def count(self) -> int:
        """Streams over all tenants (sum of index sizes over every primary; may include expired, not yet pruned,
        streams)."""
        total = 0
        await self._decided()
        async with guard():
            async for key in self.client.scan_iter(match=f"{self.prefix}:tenant:*:streams", count=500):
                total += await self.client.zcard(key)
        return total

    async def shared_secret(self, name: str, candidate: bytes) -> bytes:
        """The deployment's secret ``name`` (key ``<p>:secret:<name>``): ``candidate`` if none was kept yet, else
        the one kept — so every replica sharing the store (one Redis or a cluster) holds the same. Written with
        replica acknowledgement when it is on; raises :class:`StoreUnavailable` when the store does not answer."""
        check_name("name", name)
        await self._decided()
        async with guard(write=True):
            return bytes(await self._write(self._secret, [f"{self.prefix}:secret:{name}"], [bytes(candidate)]))


__all__ = ["NAME_PATTERN", "StoreOutcomeUnknown", "StoreUnavailable", "StreamStore", "check_name", "guard"]
