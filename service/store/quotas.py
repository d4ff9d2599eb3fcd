"""Per-tenant quotas (docs/API.md "Limits"): streams and stored bytes in the store, live feeds and WebSockets in
the process. Over a quota the request is refused with 429 ``quota_exceeded`` and ``Retry-After``, before anything
is written or opened (issue 34, items 6, 8 and 10).

Stored bytes and streams (:class:`TenantUsage`), shared by every replica through Redis. Each tenant has two keys
in one hash slot (the Redis Cluster hash tag ``{<tenant>}``)::

    <p>:usage:{<tenant>}:sizes    hash: stream_id -> the bytes accounted to it, and ``:total`` -> their sum
    <p>:usage:{<tenant>}:expiry   sorted set: stream_id, scored by the time (s) its keys expire

Every write that can grow a stream — create, import, an update — first *reserves* the stream's new size with one
Lua script (:data:`_RESERVE`, atomic: two concurrent creates cannot both take the last slot) and only then writes
the stream; nothing is written when the reservation is refused. The script first forgets the streams whose
expiry has passed (TTL expiry sends no notice, so the accounting drops a stream at the time its keys expire; every
reservation pushes the stream's expiry on, as every write refreshes its keys' TTL), then sets the stream's entry to
its new size (an absolute value, not a delta: a write retried after losing its compare-and-set race, or a replica's
concurrent write to the same stream, leaves the entry at one of the sizes written, never a sum). It refuses a
*new* stream when the tenant holds ``max_streams`` already, and a write that *grows* a stream when the total would
pass ``max_bytes`` (a write that does not grow it always passes, so a tenant at its quota can still update,
delete and shrink). A create that then finds its id taken (409) or fails gives its fresh reservation back
(:data:`_RELEASE`); a delete forgets the stream once the store deleted it. A crash between reservation and write
leaves an entry for a stream that does not exist, dropped when its expiry passes (at most the stream's TTL).
Streams written before this accounting existed are counted from their next write on.

The size accounted to a stream is :func:`stored_size`: its state's bytes, its meta as stored (JSON) and its history
(the step's entries' mean length times the entries kept, ``min(step, history_steps)``), rounded up to whole KiB:
Redis's own overhead per key (about 100 bytes) is left out, so the quota is on what a tenant sends and keeps, not on
Redis's encoding. An update whose size this process reserved already, less than half the stream's TTL ago, skips
the reservation (:meth:`TenantUsage.update`): the entry holds at least that size and its expiry is still ahead.

Live feeds and WebSockets (:class:`TenantSlots`): counts of what is open in this process, per tenant and in total;
``acquire`` refuses a tenant at its own cap with 429 (only its own requests wait) and anyone at the process's cap
with 503 (the process is full, another replica may not be). One event loop per process: no lock is needed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from mpflow.service.errors import ApiError
from mpflow.service.store.stream_store import StoreUnavailable, StreamStore, check_name, guard
from mpflow.service.stream_errors import StreamExistsError
from mpflow.service.throttled_log import ThrottledLog

#: warns when an update goes unaccounted (its tenant's usage keys unreachable), at most once a minute
_unaccounted = ThrottledLog(logging.getLogger("mpflow.quotas"), 60.0)

# KEYS: sizes, expiry. ARGV: stream_id, size, ttl, max_streams, max_bytes, 'create' or 'update'.
# Answers {'ok', fresh (1: the entry is new), total} or {'streams' | 'bytes', seconds until the next expiry (-1:
# none)}. Forgets (at most 1000 per call) the streams whose expiry has passed, first.
_RESERVE = """
local now = tonumber(redis.call('TIME')[1])
local total = tonumber(redis.call('HGET', KEYS[1], ':total') or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
for _, s in ipairs(gone) do
  total = total - tonumber(redis.call('HGET', KEYS[1], s) or '0')
  redis.call('HDEL', KEYS[1], s)
  redis.call('ZREM', KEYS[2], s)
end
local old = redis.call('HGET', KEYS[1], ARGV[1])
local size = tonumber(ARGV[2])
local function next_expiry()
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return math.max(1, tonumber(first[2]) - now)
end
if not old then
  local streams = redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], ':total')
  if ARGV[6] == 'create' and streams >= tonumber(ARGV[4]) then
    redis.call('HSET', KEYS[1], ':total', total)
    return {'streams', next_expiry()}
  end
elseif ARGV[6] == 'create' then
  size = math.max(size, tonumber(old))
end
local before = tonumber(old or '0')
if size > before and total - before + size > tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], ':total', total)
  return {'bytes', next_expiry()}
end
total = total - before + size
redis.call('HSET', KEYS[1], ARGV[1], size, ':total', total)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return {'ok', old and 0 or 1, total}
"""

# KEYS: sizes, expiry. ARGV: stream_id. Forgets one stream (deleted, or a create that gave its fresh reservation
# back). Answers the tenant's new total.
_RELEASE = """
local size = redis.call('HGET', KEYS[1], ARGV[1])
local total = tonumber(redis.call('HGET', KEYS[1], ':total') or '0')
if size then
  total = total - tonumber(size)
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[1], ':total', total)
end
redis.call('ZREM', KEYS[2], ARGV[1])
return total
"""

# KEYS: sizes. Answers {streams, total bytes} as accounted now (expired streams not yet forgotten included).
_USAGE = """
local total = tonumber(redis.call('HGET', KEYS[1], ':total') or '0')
return {redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], ':total'), total}
"""


def quota_exceeded(message: str, retry_after_s: int) -> ApiError:
    """429 ``quota_exceeded``; ``Retry-After``: when trying again may succeed (at least 1 s)."""
    return ApiError(429, "quota_exceeded", message, {"Retry-After": str(max(1, int(retry_after_s)))})


#: sizes are accounted in whole KiB (rounded up): a stream's size then stays put from one update to the next
SIZE_UNIT = 1024
#: streams whose last reservation :class:`TenantUsage` remembers (per process), to skip reserving an unchanged size
RECENT_STREAMS = 65536


def stored_size(
    state_bytes: int, meta: dict[str, Any], step: int, history: Sequence[str] = (), history_steps: int = 0
) -> int:
    """The bytes a stream keeps in the store (module docstring): state, meta as JSON, and its history estimated
    as the mean length of ``history`` (this write's entries) times the entries kept after it; in whole KiB."""
    meta_bytes = len(json.dumps(meta, separators=(",", ":"), default=str))
    kept = min(max(step, 0), history_steps)
    per_entry = sum(len(e) for e in history) / len(history) if history else 0
    return -(-int(state_bytes + meta_bytes + per_entry * kept) // SIZE_UNIT) * SIZE_UNIT


class TenantUsage:
    """Streams and stored bytes per tenant, in the store (module docstring). ``max_streams``, ``max_bytes``: the
    quotas (``MPFLOW_MAX_STREAMS_PER_TENANT``, ``MPFLOW_MAX_STORED_BYTES_PER_TENANT``)."""

    #: what a refusal without a pending expiry (nothing of the tenant's expires) suggests as Retry-After
    RETRY_AFTER_S = 60

    def __init__(self, store: StreamStore, max_streams: int, max_bytes: int):
        self.store = store
        self.max_streams = max_streams
        self.max_bytes = max_bytes
        self._scripts: dict[str, Any] = {}
        self._client: Any = None
        #: (tenant, stream_id) -> (size reserved, monotonic time) of this process's last reservation
        self._recent: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()

    def _keys(self, tenant: str) -> list[str]:
        check_name("tenant", tenant)
        tag = f"{self.store.prefix}:usage:{{{tenant}}}"
        return [f"{tag}:sizes", f"{tag}:expiry"]

    def _script(self, name: str, text: str) -> Any:
        """The script registered on the store's client of now (it changes once when the store learns it talks to a
        cluster)."""
        if self._client is not self.store.client:
            self._client, self._scripts = self.store.client, {}
        if name not in self._scripts:
            self._scripts[name] = self._client.register_script(text)
        return self._scripts[name]

    async def reserve(self, tenant: str, stream_id: str, size: int, ttl: int, create: bool) -> bool:
        """Account ``size`` bytes to the stream before it is written; raises 429 over a quota. ``True`` when the
        entry is new (a create that fails then gives it back with :meth:`release`)."""
        args = [stream_id, int(size), int(ttl), self.max_streams, self.max_bytes, "create" if create else "update"]
        async with guard(write=True):
            answer = await self._script("reserve", _RESERVE)(keys=self._keys(tenant), args=args)
        verdict = answer[0].decode() if isinstance(answer[0], bytes) else answer[0]
        if verdict == "ok":
            return bool(int(answer[1]))
        wait = int(answer[1]) if int(answer[1]) > 0 else self.RETRY_AFTER_S
        if verdict == "streams":
            raise quota_exceeded(
                f"streams: this tenant has {self.max_streams} streams, its quota (MPFLOW_MAX_STREAMS_PER_TENANT); "
                "delete one or wait until one expires",
                wait,
            )
        raise quota_exceeded(
            f"stored bytes: this write ({size} bytes for stream {stream_id!r}) would take the tenant past its quota "
            f"of {self.max_bytes} bytes (MPFLOW_MAX_STORED_BYTES_PER_TENANT); delete streams or wait until some expire",
            wait,
        )

    async def update(self, tenant: str, stream_id: str, size: int, ttl: int) -> None:
        """Reserve an update's new size (429 when it grows the tenant past its quota), skipped when this process
        reserved at least ``size`` for the stream less than ``ttl / 2`` ago: the entry then still holds at least
        that, and its expiry time is still ahead (a stream's size is steady once its history is full; measured, the
        reservation on every update cost about 7 % of the updates/s of 16 Kalman streams in one process).

        On a Redis Cluster, an update whose reservation finds the tenant's usage keys unreachable (their shard is
        failing over, while the stream's own shard may answer) is let through unaccounted, and reserved again at its
        next update: a stream's growth is bounded by its state and ``history_steps`` anyway, and writes to healthy
        shards must not wait for another shard (measured: a primary SIGKILL made 58 of 2665 healthy-shard writes
        answer 503 when updates failed with their reservation). Creates and imports still need the reservation. On one
        Redis the refusal stands: the stream's own write would only wait out a second timeout (a frozen store held a
        stream's requests 10 s instead of 5)."""
        key, now = (tenant, stream_id), time.monotonic()
        recent = self._recent.get(key)
        if recent is not None and recent[0] >= size and now - recent[1] < ttl / 2:
            return
        try:
            await self.reserve(tenant, stream_id, size, ttl, create=False)
        except StoreUnavailable as exc:  # the tenant's usage keys are on a shard that does not answer now
            if not self.store.cluster:  # one Redis: the stream's own write cannot go through either
                raise
            _unaccounted.warning(tenant, "stored bytes of tenant %r not accounted for an update (%s)", tenant, exc)
            return
        self._remember(key, size, now)

    def _remember(self, key: tuple[str, str], size: int | None, now: float = 0.0) -> None:
        self._recent.pop(key, None)
        if size is not None:
            self._recent[key] = (size, now)
            if len(self._recent) > RECENT_STREAMS:
                self._recent.popitem(last=False)

    async def create(self, tenant: str, stream_id: str, meta: dict[str, Any], state_bytes: bytes) -> None:
        """Reserve a new stream's size (429 over a quota), then create it (409 when the id exists: the reservation
        is given back); what ``POST /v1/streams`` and ``POST /v1/streams:import`` write."""
        ttl = int(meta["ttl_seconds"])
        size = stored_size(len(state_bytes), meta, int(meta.get("step") or 0))
        fresh = await self.reserve(tenant, stream_id, size, ttl, create=True)
        created = False
        try:
            created = await self.store.create(tenant, stream_id, meta, state_bytes, ttl)
        finally:
            if fresh and not created:
                await self.release(tenant, stream_id)
        if not created:
            raise StreamExistsError(f"stream_id: a stream {stream_id!r} already exists; choose another id")
        self._remember((tenant, stream_id), size, time.monotonic())

    async def release(self, tenant: str, stream_id: str) -> None:
        """Forget a stream: deleted, or a create that did not happen (best effort when the store is down)."""
        self._remember((tenant, stream_id), None)
        with contextlib.suppress(Exception):
            async with guard(write=True):
                await self._script("release", _RELEASE)(keys=self._keys(tenant), args=[stream_id])

    async def usage(self, tenant: str) -> tuple[int, int]:
        """``(streams, bytes)`` accounted to ``tenant`` now."""
        async with guard():
            streams, total = await self._script("usage", _USAGE)(keys=self._keys(tenant)[:1])
        return int(streams), int(total)


class TenantSlots:
    """What one process holds open — feeds, WebSockets, body bytes being read — per tenant and in total (module
    docstring). ``what``: the thing counted, for messages (``"live feeds"``); ``setting``: the per-tenant cap's
    variable; ``retry_after_s``: the ``Retry-After`` of a refusal; ``full``: the 503 to raise at the process's cap.
    ``amount``: how much one take holds (1 for a feed; a body piece's bytes)."""

    def __init__(self, what: str, per_tenant: int, per_process: int, setting: str, retry_after_s: int = 5):
        self.what = what
        self.per_tenant = per_tenant
        self.per_process = per_process
        self.setting = setting
        self.retry_after_s = retry_after_s
        self.open: Counter[str | None] = Counter()

    @property
    def total(self) -> int:
        return sum(self.open.values())

    def check(self, tenant: str | None, full: ApiError, amount: int = 1) -> None:
        """Raise ``full`` (503) past the process's cap, 429 past the tenant's (no tenant: no share of its own);
        nothing is taken."""
        if self.total + amount > self.per_process:
            raise full
        if tenant is not None and self.open[tenant] + amount > self.per_tenant:
            raise quota_exceeded(
                f"{self.what}: this tenant holds {self.open[tenant]} on this server and may hold {self.per_tenant} "
                f"({self.setting}); close some or retry later",
                self.retry_after_s,
            )

    def take(self, tenant: str | None, full: ApiError, amount: int = 1) -> None:
        """:meth:`check`, then count ``amount`` more for ``tenant``; :meth:`give` it back when it closes."""
        self.check(tenant, full, amount)
        self.open[tenant] += amount

    def give(self, tenant: str | None, amount: int = 1) -> None:
        self.open[tenant] -= amount
        if self.open[tenant] <= 0:
            del self.open[tenant]


__all__ = ["TenantSlots", "TenantUsage", "quota_exceeded", "stored_size"]
