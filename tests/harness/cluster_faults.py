"""Faults of a real local Redis Cluster under sequential writers, checked as Jepsen would: one case of
``benchmarks/cluster_faults.py`` (the matrix) and ``tests/reliability/test_cluster_faults.py`` (its must-show rows).

A case (:func:`run_case`): a fresh :class:`~tests.harness.cluster.LocalCluster` (3 primaries, ``replicas`` each,
``cluster-node-timeout`` 1 s) and ``python -m mpflow serve --workers 1`` pointed at one node with
``MPFLOW_REDIS_WAIT_REPLICAS = wait`` (timeout 1000 ms, the default). ``STREAMS_PER_SHARD`` streams live on each
primary; those of the *victim* primary (never the URL's node) on its lowest slots, the ones ``redis-cli --cluster
reshard`` moves first. Each stream has one sequential writer that does what docs/API.md says: the next ``seq``;
after a 503 or a lost connection the same ``seq`` again until 200 (a ``duplicate`` 200 acknowledges too); a 409
``seq_conflict`` means the stream is behind what was acknowledged — lost steps, counted — and it carries on from
the stream's step. After ``STEADY_S`` s of load the fault (:data:`FAULTS`) runs, then ``AFTER_S`` s more.

What is checked, over every answer:

* **acknowledged**: the highest ``seq`` answered 200, summed over streams; **stored**: the streams' steps at the end;
* **lost**: acknowledged steps a stream no longer had (at a 409, or at the end; their acknowledgments, with what
  each node held right after the answer, are the row's ``lost_examples``); **doubled**: steps beyond the
  highest ``seq`` sent, or an applied (not ``duplicate``) answer whose step is not its ``seq``;
* **without the promised replicas**: acknowledgments (first answers and retries alike) of which, read right after
  the answer from every node of the stream's shard (``READONLY``, the stream's ``step``), fewer than ``1 + wait``
  nodes hold the step — the primary and the ``wait`` replicas ``WAIT`` promises. Copies are counted whatever the
  node's role by then: a replica that acknowledged may have been promoted since (a paused primary that wakes before
  it learns of its replacement runs the writes it was sent and, with ``WAIT 1``, acknowledges them only with its
  replica's — the new primary's — acknowledgment). **On one node**: those that one node alone holds (what ``WAIT 0``
  risks in a failover: Redis replicates asynchronously). A node that is down, or paused now, holds nothing for
  anyone; a node that cannot serve the read yet — it answers an error (the cluster down for a moment, loading a
  resync, a slot not its own), or gives no answer within 2 s or refuses though the fault has not stopped it or has
  restarted it since (alive but starved of CPU: on a loaded machine one read can take 4 s) — is asked again, every 0.1 s
  until 10 s after the answer; only a copy a node returns counts. A node that does not hold the step is
  *doubtful* when it was killed or paused after the request was sent and before its answer was read — it may have
  held the step and lost it to the strike (a killed node restarts empty) — or could still not serve the read at the
  end of the 10 s. **Unverifiable**: acknowledgments with fewer than ``1 + wait`` copies found that would have had
  enough had their doubtful nodes held the step; one short even counting those is *without the promised replicas*
  (a live replica that acknowledged and lacks the step is a broken promise whatever happened to its primary);
* **while struck**: acknowledgments sent after a node of the stream's shard was killed or paused and answered before
  it was back (with one replica per primary and ``WAIT 1``: none may be);
* **outage**: the longest time without an acknowledgment on one stream, on the victim's shard and on the others.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aredis
from redis import exceptions as redis_errors
from redis.crc import key_slot

from tests.harness.cluster import LocalCluster
from tests.harness.server import UserServer

STREAM = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "kalman",
}
STREAMS_PER_SHARD = 2
STEADY_S = 2.0
AFTER_S = 2.0
#: how long a killed node stays down after the cluster settled without it (so writers meet the degraded shard)
DOWN_S = 3.0
#: the victim's lowest slots that the migration moves (the victim's streams live there)
MIGRATED_SLOTS = 200
#: how long the replica check waits for one node's answer (a longer wait: it is paused, or starved of CPU)
CHECK_TIMEOUT_S = 2.0
#: a node that could not serve the check yet (an error: cluster down, loading, a slot not its own; or a timeout
#: while nobody stopped it: a live node starved of CPU) is asked again every ``RECHECK_S`` until ``RECHECK_WINDOW_S``
#: after the answer (long enough for a few ``CHECK_TIMEOUT_S`` asks on a loaded machine)
RECHECK_S, RECHECK_WINDOW_S = 0.1, 10.0


@dataclass
class Context:
    """What a fault acts on."""

    cluster: LocalCluster
    server: UserServer
    victim: int
    target: int
    #: node port -> when it was killed or paused (the check's judge of a replica that died after it acknowledged)
    struck: dict[int, float] = field(default_factory=dict)
    #: node port -> when a struck node's restart or resume began (from then on a timeout is CPU load, not the fault)
    recovered: dict[int, float] = field(default_factory=dict)

    def strike(self, port: int, how: Any) -> None:
        self.struck[port] = time.monotonic()
        how(port)

    def recover(self, port: int, how: Any) -> None:
        self.recovered[port] = time.monotonic()  # before: the node may serve (and acknowledge) before ``how`` returns
        how(port)


def primary_kill(ctx: Context) -> None:
    """SIGKILL the victim primary; once its replica took over, ``DOWN_S`` s more; then it restarts (empty: no
    persistence here) and rejoins as the new primary's replica."""
    ctx.strike(ctx.victim, ctx.cluster.kill)
    ctx.cluster.wait_promoted(ctx.victim)
    time.sleep(DOWN_S)
    ctx.recover(ctx.victim, ctx.cluster.restart)
    ctx.cluster.wait_ok()


def primary_pause(ctx: Context) -> None:
    """SIGSTOP the victim primary until a replica took over its slots, 1 s more, then SIGCONT: it comes back
    believing it is the primary, with whatever writes reached it, learns otherwise and rejoins as a replica."""
    ctx.strike(ctx.victim, ctx.cluster.pause)
    try:
        deadline = time.monotonic() + 30
        while ctx.victim in ctx.cluster.primary_ports():
            assert time.monotonic() < deadline, "no replica took over the paused primary"
            time.sleep(0.05)
        time.sleep(1.0)
    finally:
        ctx.recover(ctx.victim, ctx.cluster.resume)
    ctx.cluster.wait_ok()


def replica_kill(ctx: Context) -> None:
    """SIGKILL one replica of the victim; ``DOWN_S`` s later it restarts and resyncs."""
    replica = ctx.cluster.replica_ports(ctx.victim)[0]
    ctx.strike(replica, ctx.cluster.kill)
    time.sleep(DOWN_S)
    ctx.recover(replica, ctx.cluster.restart)
    ctx.cluster.wait_ok()


def slot_migration(ctx: Context) -> None:
    """``redis-cli --cluster reshard``: the victim's lowest ``MIGRATED_SLOTS`` slots, streams and all, to another
    primary."""
    ctx.cluster.reshard([ctx.victim], ctx.target, MIGRATED_SLOTS)


def server_restart(ctx: Context) -> None:
    """SIGKILL the service mid-write (no shutdown) and start it again on its port."""
    ctx.server.kill()
    ctx.server.start()


FAULTS = {
    "primary_kill": primary_kill,
    "primary_pause": primary_pause,
    "replica_kill": replica_kill,
    "slot_migration": slot_migration,
    "server_restart": server_restart,
}


def stream_ids(prefix: str, slots_by_shard: dict[int, list[int]], per_shard: int) -> dict[str, int]:
    """``{stream id: its shard's primary port}``: ``per_shard`` random ids whose keys fall in each shard's given
    slots (the key is ``<prefix>:{default:<id>}:meta``: the service knows one API key, of tenant ``default``)."""
    out: dict[str, int] = {}
    for port, slots in slots_by_shard.items():
        wanted, found = set(slots), 0
        while found < per_shard:
            sid = f"cf-{uuid.uuid4().hex[:10]}"
            if key_slot(f"{prefix}:{{default:{sid}}}:meta".encode()) in wanted:
                out[sid], found = port, found + 1
    return out


def _copies(seen: dict[int, str]) -> int:
    """How many nodes hold the acknowledged step, whatever their role now (a replica that acknowledged may have been
    promoted since; a paused primary's copy made with ``WAIT 1`` had a replica's acknowledgment)."""
    return sum(said.startswith("holds") for said in seen.values())


def classify(ack: Ack, wait: int) -> str:
    """``"short"`` — fewer than the ``1 + wait`` copies ``WAIT`` promises even if every doubtful node
    (:meth:`Writers._check`) had held the step —, ``"unverifiable"`` — fewer found, but enough had the doubtful
    nodes held it —, else ``"kept"``."""
    if ack.holders + ack.doubtful < 1 + wait:
        return "short"
    return "unverifiable" if ack.holders < 1 + wait else "kept"


@dataclass
class Ack:
    sid: str
    seq: int
    duplicate: bool
    retry: bool  # not the first request of this seq
    sent: float  # time.monotonic() of the request
    at: float  # time.monotonic() of the answer
    holders: int = -1  # nodes that held it (its primary, replicas), read right after (-1: not read yet)
    #: nodes without it whose answer tells nothing: struck after the request, or never answered (docstring)
    doubtful: int = 0
    seen: dict[int, str] = field(default_factory=dict)  # per node: "holds", "behind", "primary", or the error
    answered: dict[int, float] = field(default_factory=dict)  # per node: time.monotonic() of its last answer


@dataclass
class Writers:
    """The sequential writers and their history (module docstring)."""

    url: str
    key: str  # the API key of tenant ``default``: a stranger's server on a reused port answers 401, not our streams
    prefix: str
    wait: int  # the replicas each acknowledgment promises
    struck: dict[int, float]  # the fault's nodes killed or paused, and when
    recovered: dict[int, float]  # those of them restarted or resumed, and when
    shard_of: dict[str, int]  # stream -> the port of its primary at the start
    nodes_of: dict[str, list[int]]  # stream -> the nodes that may replicate it during the case
    acked: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    ack_times: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    acks: list[Ack] = field(default_factory=list)
    statuses: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    lost: int = 0
    #: each loss found: (stream, its step then, the highest seq acknowledged before, when it was found)
    losses: list[tuple[str, int, int, float]] = field(default_factory=list)
    misapplied: int = 0

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._checks: list[asyncio.Task] = []
        self._nodes: dict[int, aredis.Redis] = {}

    def stop(self) -> None:
        self._stop.set()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30, headers={"authorization": f"Bearer {self.key}"})

    async def create(self) -> None:
        async with self._client() as client:
            for sid in self.shard_of:
                answer = await client.post("/v1/streams", json={**STREAM, "stream_id": sid})
                assert answer.status_code == 201, answer.text
                self.acked[sid] = self.sent[sid] = 0
                self.ack_times[sid].append(time.monotonic())

    async def run(self) -> None:
        async with self._client() as client:
            await asyncio.gather(*(self._writer(client, sid) for sid in self.shard_of))
        await asyncio.gather(*self._checks)
        for node in self._nodes.values():
            await node.aclose()

    async def _writer(self, client: httpx.AsyncClient, sid: str) -> None:
        seq, tries = 1, 0
        while not self._stop.is_set():
            self.sent[sid] = max(self.sent[sid], seq)
            body = {"seq": seq, "observations": [[0.1 * (seq % 10), 0.2]]}
            sent = time.monotonic()
            try:
                answer = await client.post(f"/v1/streams/{sid}/observations", json=body)
            except httpx.HTTPError as exc:
                self.statuses[sid][type(exc).__name__] += 1
                tries += 1
                await asyncio.sleep(0.05)
                continue
            self.statuses[sid][str(answer.status_code)] += 1
            if answer.status_code == 200:
                doc = answer.json()
                if not doc["duplicate"] and doc["step"] != seq:
                    self.misapplied += 1
                ack = Ack(sid, seq, bool(doc["duplicate"]), tries > 0, sent, time.monotonic())
                self.acks.append(ack)
                self._checks.append(asyncio.create_task(self._check(ack)))
                self.acked[sid] = seq
                self.ack_times[sid].append(time.monotonic())
                seq, tries = seq + 1, 0
            elif answer.status_code == 409 and answer.json()["error"]["code"] == "seq_conflict":
                step = await self._step(client, sid)
                self._lose(sid, step)
                self.acked[sid] = step
                seq, tries = step + 1, 0
            else:  # 503: the same seq again
                tries += 1
                await asyncio.sleep(0.05)

    async def _step(self, client: httpx.AsyncClient, sid: str) -> int:
        while True:
            with_answer = await client.get(f"/v1/streams/{sid}")
            if with_answer.status_code == 200:
                return int(with_answer.json()["step"])
            await asyncio.sleep(0.05)

    def _node(self, port: int) -> aredis.Redis:
        if port not in self._nodes:
            self._nodes[port] = aredis.Redis(  # one try, no retry: the node as it is right after the answer
                host="127.0.0.1",
                port=port,
                socket_timeout=CHECK_TIMEOUT_S,
                socket_connect_timeout=CHECK_TIMEOUT_S,
                retry=None,
            )
        return self._nodes[port]

    async def _holds(self, port: int, key: str, seq: int) -> str:
        """What the node on ``port`` says now: ``holds`` (its copy of the stream is at ``seq`` or beyond) or
        ``behind``, each with its role; ``down`` (refused), ``timeout`` (paused), or ``error ...`` when it answered
        but could not serve the read (cluster down, loading, the slot not its own)."""
        for attempt in (1, 2):  # a second, at once, on a new connection: the pooled one may predate a restart
            try:
                async with self._node(port).pipeline(transaction=False) as pipe:
                    pipe.execute_command("READONLY").execute_command("ROLE").hget(key, "step")
                    _, role, step = await pipe.execute(raise_on_error=False)
                break
            except redis_errors.BusyLoadingError:
                return "error LOADING"
            except (TimeoutError, redis_errors.TimeoutError):
                return "timeout"
            except (redis_errors.ConnectionError, ConnectionError, OSError):
                if attempt == 2:
                    return "down"
        if isinstance(role, Exception) or isinstance(step, Exception):
            return f"error {str(step if isinstance(step, Exception) else role).split(' ', 1)[0]}"
        held = "holds" if isinstance(step, bytes) and int(step) >= seq else "behind"
        if isinstance(role, list) and role and role[0] in (b"slave", "slave"):
            return f"{held} (replica)"
        return f"{held} (primary, {len(role[2]) if isinstance(role, list) and len(role) > 2 else '?'} replicas)"

    async def _check(self, ack: Ack) -> None:
        """Read every node of the stream's shard right after the answer; a node that could not serve the read yet
        (:meth:`_pending`) is asked again every ``RECHECK_S`` until ``RECHECK_WINDOW_S`` after the answer, unless
        enough hold it. A node struck after the request was sent and before its answer came that does not hold the
        step is doubtful, whatever it says: a killed node restarts empty, a paused one is resynced, so its answer
        tells nothing about what it held when the service answered; so is a live node still unable to serve the
        read at the end. Each doubtful node is one copy that may have existed (:func:`classify`)."""
        key = f"{self.prefix}:{{default:{ack.sid}}}:meta"
        ports = self.nodes_of[ack.sid]

        async def ask_one(port: int) -> str:
            said = await self._holds(port, key, ack.seq)
            ack.answered[port] = time.monotonic()
            return said

        async def ask(nodes: list[int]) -> dict[int, str]:
            return dict(zip(nodes, await asyncio.gather(*map(ask_one, nodes)), strict=True))

        seen = await ask(ports)
        while _copies(seen) <= self.wait and time.monotonic() - ack.at < RECHECK_WINDOW_S:
            pending = [p for p, said in seen.items() if self._pending(p, said)]
            if not pending:
                break
            await asyncio.sleep(RECHECK_S)
            seen |= await ask(pending)
        for port, said in seen.items():
            if said.startswith("holds"):
                continue
            if ack.sent < self.struck.get(port, float("inf")) <= ack.answered[port]:  # it may have held it
                seen[port] = f"{said}, struck after the request"
                ack.doubtful += 1
            elif self._pending(port, said):  # alive, and still no answer: neither a copy nor a miss
                seen[port] = f"{said}, still after {RECHECK_WINDOW_S:g} s"
                ack.doubtful += 1
        ack.seen = seen
        ack.holders = _copies(seen)

    def _pending(self, port: int, said: str) -> bool:
        """Whether the node's answer is no answer yet: an error (it answered but could not serve the read), or a
        timeout or refusal from a node the fault has not stopped, or has restarted or resumed since (alive: slow
        under CPU load, or the pooled connections predate its restart). ``behind``, and ``down`` or a timeout of a
        node stopped now, are final."""
        stopped = port in self.struck and port not in self.recovered
        return said.startswith("error") or (said in ("timeout", "down") and not stopped)

    async def final_check(self) -> dict[str, int]:
        doubled, stored = self.misapplied, 0
        async with self._client() as client:
            for sid in self.shard_of:
                step = await self._step(client, sid)
                stored += step
                self._lose(sid, step)
                doubled += max(0, step - self.sent[sid])
        return {"acknowledged": sum(self.acked.values()), "stored": stored, "lost": self.lost, "doubled": doubled}

    def _lose(self, sid: str, step: int) -> None:
        """Count the acknowledged steps past ``step``, the stream's now, as lost (none when it has them)."""
        if self.acked[sid] > step:
            self.lost += self.acked[sid] - step
            self.losses.append((sid, step, self.acked[sid], time.monotonic()))

    def lost_acks(self) -> list[Ack]:
        """The acknowledgments of the steps counted lost (each one's answer before its loss was found)."""
        return [
            a
            for sid, step, acked, found in self.losses
            for a in self.acks
            if a.sid == sid and step < a.seq <= acked and a.at <= found
        ]

    def outage(self, sids: list[str], until: float) -> float:
        """The longest time (s) one of ``sids`` went without an acknowledgment (up to ``until``)."""
        gaps = [0.0]
        for sid in sids:
            times = [*self.ack_times[sid], until]
            gaps += [b - a for a, b in itertools.pairwise(times)]
        return round(max(gaps), 2)


async def _drive(
    cluster: LocalCluster, server: UserServer, key: str, prefix: str, fault: str, wait: int
) -> dict[str, Any]:
    primaries = cluster.primary_ports()
    victim = next(p for p in primaries if p != cluster.ports[0])
    target = next(p for p in primaries if p not in (victim, cluster.ports[0]))
    groups = {p: [p, *cluster.replica_ports(p)] for p in primaries}
    slots = {p: cluster.slots_of(p) for p in primaries}
    slots[victim] = slots[victim][:MIGRATED_SLOTS]
    shard_of = stream_ids(prefix, slots, STREAMS_PER_SHARD)
    moved = groups[target] if fault == "slot_migration" else []
    nodes_of = {sid: [*groups[p], *(moved if p == victim else [])] for sid, p in shard_of.items()}
    ctx = Context(cluster, server, victim, target)
    writers = Writers(server.url, key, prefix, wait, ctx.struck, ctx.recovered, shard_of, nodes_of)
    await writers.create()
    task = asyncio.create_task(writers.run())
    await asyncio.sleep(STEADY_S)
    t0 = time.monotonic()
    await asyncio.to_thread(FAULTS[fault], ctx)
    fault_s = time.monotonic() - t0
    served = set(cluster.slots_of(target))  # the migration's proof: the victim's streams are on the target now
    moved = sum(
        key_slot(f"{prefix}:{{default:{sid}}}:meta".encode()) in served for sid, p in shard_of.items() if p == victim
    )
    await asyncio.sleep(AFTER_S)
    writers.stop()
    await task
    end = time.monotonic()
    counts = await writers.final_check()
    on_victim = [sid for sid, p in shard_of.items() if p == victim]
    healthy = [sid for sid, p in shard_of.items() if p != victim]

    def answers(sids: list[str]) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for sid in sids:
            total.update(writers.statuses[sid])
        return dict(total)

    kinds = [classify(a, wait) for a in writers.acks]
    short = [a for a, kind in zip(writers.acks, kinds, strict=True) if kind == "short"]
    unverifiable = [a for a, kind in zip(writers.acks, kinds, strict=True) if kind == "unverifiable"]
    struck_node = [  # sent after a node of its shard was struck, answered before it was back
        a
        for a in writers.acks
        if any(ctx.struck[p] < a.sent and a.at < ctx.recovered.get(p, end) for p in nodes_of[a.sid] if p in ctx.struck)
    ]

    def examples(acks: list[Ack]) -> list[dict[str, Any]]:
        return [
            {
                "victim": shard_of[a.sid] == victim,
                "seq": a.seq,
                "duplicate": a.duplicate,
                "retry": a.retry,
                "sent_s": round(a.sent - t0, 2),
                "at_s": round(a.at - t0, 2),
                **a.seen,
                "answered_s": {port: round(t - a.at, 2) for port, t in a.answered.items()},
            }
            for a in acks[:5]
        ]

    return {
        **counts,
        "acks": len(writers.acks),
        "acks_on_retry": sum(a.retry for a in writers.acks),
        "acks_without_promised_replicas": len(short),
        "of_them_on_retry": sum(a.retry for a in short),
        "of_them_on_the_victim": sum(shard_of[a.sid] == victim for a in short),
        "acks_on_one_node": sum(a.holders <= 1 and not a.doubtful for a in writers.acks),
        "acks_unverifiable": len(unverifiable),
        "acks_while_struck": len(struck_node),
        "outage_victim_s": writers.outage(on_victim, end),
        "outage_healthy_s": writers.outage(healthy, end),
        "answers_victim": answers(on_victim),
        "answers_healthy": answers(healthy),
        "fault_s": round(fault_s, 1),
        "victim_streams_moved": moved,
        "short_examples": examples(short),
        "unverifiable_examples": examples(unverifiable),
        "lost_examples": examples(writers.lost_acks()),
    }


def run_case(
    fault: str,
    wait: int,
    replicas: int,
    full_coverage: bool = True,
    base_dir: str | Path | None = None,
    service_wait: int | None = None,
) -> dict[str, Any]:
    """One case on a fresh cluster and server (module docstring; ``full_coverage``: Redis'
    ``cluster-require-full-coverage``); every process is stopped at the end. ``service_wait``: the service's
    ``MPFLOW_REDIS_WAIT_REPLICAS`` when it is not ``wait``, the promise checked (a service that breaks it: the check
    must catch that)."""
    with tempfile.TemporaryDirectory(prefix="cluster-faults-", dir=base_dir) as tmp:
        with LocalCluster(tmp, replicas=replicas, full_coverage=full_coverage) as cluster:
            prefix, key = f"cf-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
            env = {
                "MPFLOW_REDIS_URL": cluster.url,
                "MPFLOW_REDIS_PREFIX": prefix,
                "MPFLOW_REDIS_WAIT_REPLICAS": str(wait if service_wait is None else service_wait),
                "MPFLOW_LOG_LEVEL": "WARNING",
                "MPFLOW_API_KEYS": f"default:{key}",
            }
            with UserServer(env, Path(tmp) / "service.log", args=["--workers", "1"]) as server:
                server.start()
                result = asyncio.run(_drive(cluster, server, key, prefix, fault, wait))
        return {"fault": fault, "wait": wait, "replicas": replicas, "full_coverage": full_coverage, **result}


__all__ = ["FAULTS", "run_case"]
