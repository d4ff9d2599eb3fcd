"""The update engine: one Bayes step per job, micro-batched across streams (docs/DESIGN.md "Service internals").

A job is one observation step of one stream: (updater, model [B=1], state [B=1], observation). Jobs whose
tensors can be stacked — the same updater (method and operator), model family and parameter shapes, particle
count N, state dimension d, observation shape and the same set (and shapes) of state fields and extras — share
a *batch key*. A dispatcher task (one per lane, below) takes up to ``max_batch_size`` jobs of one key, waiting at most
``max_wait_ms`` after the oldest job arrived for the batch to fill (of the keys ready, the one holding the
oldest job goes first, so a busy key cannot starve the others), and makes ONE
``updater.update(ParticleState.stack(states) [B, N, d], obs [B, *obs], ModelFamily.stack(models))`` call on a
worker thread, then scatters the rows back (``ParticleState.unbind``). Every stream carries its own generator,
so its result does not depend on the batch it ran in. Jobs of one stream are submitted one after the other
(the caller awaits each step), so per-stream order is the submission order.

Waiting only for jobs that are on their way. A caller that is about to submit steps (the stream service, for
an observation request that holds its stream) announces them first (:meth:`UpdateEngine.expect`); each
:meth:`UpdateEngine.update` made with that announcement consumes one step. While announcements are open, a
key that is not full is dispatched at once when no announced step is still to come (nothing can join the
batch, so waiting ``max_wait_ms`` would only add latency: the single-stream case), and otherwise waits as
above. Without open announcements (callers that do not announce) the rule is the plain one above.

If a batched call fails (a ``ValueError`` or non-finite result caused by one stream), the jobs are re-run one
by one so that only the guilty stream sees the error.

Two lanes, so that heavy work cannot stall light work (:mod:`mpflow.service.engine.lanes`). Each job carries its
price from the cost model (:class:`~mpflow.service.streams.costs.Cost`: operations and peak bytes; a run job its
dearest step's) and is queued on the fast lane or, above :data:`~mpflow.service.engine.lanes.HEAVY_STEP_SHARE` of a
request's budget, on the slow lane; each lane has its own dispatcher task and its own worker thread, and the rules
above hold within each lane (an announcement counts for every lane until its first step arrives, then for that
step's lane only — so a light key does not wait for a heavy request's announced steps). A batch stacks jobs only
while their summed price stays within the lane's cap (:meth:`~mpflow.service.engine.lanes.LaneLimits.batch_cap`:
one request's budget on the slow lane, a tenth of it on the fast lane); a job over the cap runs alone. A heavy
stream's step then delays only other heavy steps: a light stream's step waits at most for the light batch ahead of
it. The slow lane's thread runs at a lower CPU priority, so that on busy cores the event loop and the fast lane go
first. Per-stream order is unchanged (a stream's jobs are awaited one after the other). Each lane's worker (and
each auxiliary thread) records the job it is on and since when (:meth:`UpdateEngine.busy`), which the watchdog
(:mod:`mpflow.service.engine.watchdog`) compares with its deadline.

Torch runs off the event loop: batched updates on the lanes' worker threads (``torch.set_num_threads(1)``; the
service gets its parallelism from batching, replicas and uvicorn workers, not intra-op threads), other tensor
work (state initialisation, summaries, draws) on a small auxiliary pool through :meth:`UpdateEngine.run`. A job
may carry an ``after`` hook, run on the worker with that stream's result right after the batched step (the
stream service checks, summarises and encodes the new state there): one hop to a thread per step, not one per
stage, because every hop is a wake-up and a GIL hand-over, which under load cost the event loop more than the
arithmetic of a small state.
``batching=False`` (or ``max_batch_size=1``) turns micro-batching off: one stream per call, no waiting.

Runs: a request of many steps for one stream (a back-fill, a data file) submits them as ONE job
(:meth:`UpdateEngine.update_run`): its steps follow one another (step t+1 needs step t's state), so they could
never share a batch with each other, and a hop to the worker per step costs more than a small step's arithmetic
(a 1000-observation POST to a 1-D Kalman stream spent 2.7× the in-process time, most of it in per-step hops and
in waiting ``max_wait_ms`` for its own announced steps). The worker applies the steps one after the other until
the run's slice is used (:data:`RUN_SLICE_S` of the worker thread's CPU time, at most :data:`RUN_STEPS` steps and
:data:`RUN_FLOATS` particle values held: :func:`run_length`), then summarises and checks all of them in one
vectorised ``summarise`` pass over the stacked states, and hands the worker back; the caller submits the rest as
a new job, which queues behind the jobs that arrived meanwhile (oldest first), so a light stream's step waits at
most one slice of work. The slice is CPU time, not wall time: on oversubscribed cores a wall-clock slice holds
fewer and fewer steps while each hop back to the event loop costs more and more (at a load of 15 on 2 cores, a
25 ms wall slice held one or two Kalman steps), whereas the work a slice holds — what a light step waits for — is
the same. A step that raises stops the run there: the steps before it stand, the error is the run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters import Updater
from mpflow.service.engine.lanes import LANES, SLOW, LaneLimits, Priced, lower_priority

log = logging.getLogger("mpflow.engine")

T = TypeVar("T")

#: (method, family, batch size, seconds of operator compute) after every operator call
BatchObserver = Callable[[str, str, int, float], None]
#: (method, ESS / N of every stream of the call, the call's per-stream extras — the acceptance rate of posterior
#: moves, the automatic flow's share and rescues, where the method reports them) after every operator call: the
#: steps' health
HealthObserver = Callable[[str, torch.Tensor, dict[str, torch.Tensor]], None]


#: a run job hands its lane's worker back after this much of the worker thread's CPU time (seconds; the step under
#: way finishes first)
RUN_SLICE_S = 0.025
#: at most this many steps per run job
RUN_STEPS = 128
#: at most this many particle values (steps × N × d) held by one run job for its vectorised summary
RUN_FLOATS = 1 << 21


def run_length(num_particles: int, state_dim: int, steps: int) -> int:
    """How many of ``steps`` one run job may apply at most (module docstring): within :data:`RUN_STEPS` and
    :data:`RUN_FLOATS`, and at least one."""
    return max(1, min(steps, RUN_STEPS, RUN_FLOATS // max(1, num_particles * state_dim)))


def _one_thread() -> None:
    torch.set_num_threads(1)


def _one_background_thread() -> None:
    """The slow lane's worker: one torch thread, at a lower CPU priority (:func:`.lanes.lower_priority`)."""
    _one_thread()
    lower_priority()


@dataclass
class StepResult:
    """One stream's row of a (batched) update: the new state [B=1] and its step info [B=1]; ``after``: what the
    job's ``after`` hook returned (:meth:`UpdateEngine.update`)."""

    state: ParticleState
    info: StepInfo
    after: Any = None
    summary: Any = None  # this stream's row of the engine's ``summarise`` (None without one)


@dataclass
class RunResult:
    """What a run job (:meth:`UpdateEngine.update_run`) did: its steps' results in order (``summary`` set from the
    engine's ``summarise``), the error that stopped it at step ``len(steps)`` (None when it stopped at its slice or
    at its last step), and what its ``after`` hook returned."""

    steps: list[StepResult]
    error: BaseException | None = None
    after: Any = None


@dataclass
class _Tally:
    """Open announcements and their steps not yet submitted: the engine's (announced, lane not yet known) or one
    lane's."""

    announcements: int = 0
    expected: int = 0


class Announcement:
    """Steps a caller is about to submit (:meth:`UpdateEngine.expect`); :meth:`UpdateEngine.update` with it
    consumes one step, closing it drops what was not submitted. It counts for every lane until its first step
    is submitted, then for that step's lane only (a stream's steps all go to one lane)."""

    def __init__(self, engine: UpdateEngine, steps: int):
        self._engine = engine
        self.left = steps
        self.tally = engine._unassigned
        self.tally.announcements += 1
        self.tally.expected += steps

    def consume(self, lane: _Tally, steps: int = 1) -> None:
        if self.tally is not lane:  # its first step: from now on it counts for that lane only
            self.tally.announcements -= 1
            self.tally.expected -= self.left
            self.tally = lane
            lane.announcements += 1
            lane.expected += self.left
        taken = min(steps, self.left)
        self.left -= taken
        lane.expected -= taken

    def close(self) -> None:
        self.tally.expected -= self.left
        self.tally.announcements -= 1
        self.left = 0
        self._engine._wake_all()  # a dispatcher waiting for these steps may go now


@dataclass
class _Job:
    key: Hashable
    method: str
    updater: Updater
    model: ModelFamily
    state: ParticleState
    obs: torch.Tensor
    future: asyncio.Future
    after: Callable[[Any], Any] | None = None
    price: Priced | None = None  # the cost model's price of the job (a run's: its dearest step's)
    arrived: float = field(default_factory=time.monotonic)
    run: list[tuple[ModelFamily, torch.Tensor]] | None = None  # a run job's (model, observation) of each step

    def describe(self) -> str:
        n, d = self.state.particles.shape[-2:]
        return f"{self.method} on {self.model.name}, N = {n}, d = {d}"


@dataclass
class Busy:
    """What a lane's worker is on: since (``time.monotonic()``) and a description of the batch."""

    lane: str
    since: float
    what: str


class _Lane:
    """One lane: its queues by batch key, its dispatcher's wake-up, its worker thread, and what that worker is on
    (written by the worker thread, read by the watchdog's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: dict[Hashable, deque[_Job]] = {}
        self.wakeup: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        initializer = _one_thread if name != SLOW else _one_background_thread
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"mpflow-update-{name}", initializer=initializer)
        self.busy: Busy | None = None
        self.tally = _Tally()  # announcements whose steps go to this lane


class _RunKey:
    """The batch key of a run job: its own, so it is never stacked with another job and never waits for one."""

    __slots__ = ()


def _shape(t: torch.Tensor) -> tuple:
    return (tuple(t.shape[1:]), t.dtype)


def batch_key(updater_key: Hashable, model: ModelFamily, state: ParticleState, obs: torch.Tensor) -> tuple:
    """Jobs with equal keys can be stacked into one call (module docstring)."""
    fields = [
        ("particles", _shape(state.particles)),
        ("log_weights", _shape(state.log_weights)),
        ("rng", _shape(state.rng)),
        ("log_density", None if state.log_density is None else _shape(state.log_density)),
    ]
    fields += [(f"extras.{k}", _shape(v)) for k, v in sorted(state.extras.items())]
    params = tuple((k, _shape(v)) for k, v in sorted(model.params.items()))
    return (updater_key, type(model), params, tuple(fields), tuple(obs.shape), obs.dtype)


def _settle(future: asyncio.Future, result: StepResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _split_info(info: StepInfo, batch: int) -> list[StepInfo]:
    def row(t: torch.Tensor | None, b: int) -> torch.Tensor | None:
        return None if t is None else t[b : b + 1]

    return [
        StepInfo(
            row(info.log_evidence_increment, b),
            row(info.ess, b),
            row(info.iterations, b),
            {k: v[b : b + 1] for k, v in info.extras.items() if isinstance(v, torch.Tensor) and v.dim() > 0},
        )
        for b in range(batch)
    ]


class UpdateEngine:
    """Micro-batching scheduler for updater calls (module docstring). Start with :meth:`start` inside a
    running event loop, submit with :meth:`update`, stop with :meth:`stop`."""

    def __init__(
        self,
        *,
        max_batch_size: int = 64,
        max_wait_ms: float = 2.0,
        batching: bool = True,
        aux_threads: int = 2,
        observer: BatchObserver | None = None,
        summarise: Callable[[ParticleState], list[Any]] | None = None,
        health_observer: HealthObserver | None = None,
        limits: LaneLimits | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be positive, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms: must be non-negative, got {max_wait_ms}")
        self.max_batch_size = max_batch_size if batching else 1
        self.max_wait = max_wait_ms / 1000.0
        self.observer = observer
        self.health_observer = health_observer
        self.summarise = summarise  # per-stream values of a batched new state, computed once per call
        self.limits = limits or LaneLimits()  # the lanes' thresholds, from one request's budget
        self._lanes = {name: _Lane(name) for name in LANES}
        self._unassigned = _Tally()  # open announcements (expect) that have not submitted a step yet
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aux_busy: dict[int, Busy] = {}
        self._aux = ThreadPoolExecutor(aux_threads, thread_name_prefix="mpflow-aux", initializer=_one_thread)
        self._heavy = ThreadPoolExecutor(1, thread_name_prefix="mpflow-heavy", initializer=_one_background_thread)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 1

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if not self._running:
            self._running = True
            self._loop = asyncio.get_running_loop()
            for lane in self._lanes.values():
                lane.wakeup = asyncio.Event()
                lane.task = asyncio.create_task(self._dispatch_loop(lane), name=f"mpflow-engine-{lane.name}")

    async def stop(self) -> None:
        self._running = False
        for lane in self._lanes.values():
            task, lane.task = lane.task, None
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for queue in lane.pending.values():
                for job in queue:
                    if not job.future.done():
                        job.future.set_exception(RuntimeError("the update engine stopped"))
            lane.pending.clear()
        for lane in self._lanes.values():
            lane.worker.shutdown(wait=True)
        self._aux.shutdown(wait=True)
        self._heavy.shutdown(wait=True)

    def busy(self) -> list[Busy]:
        """What each lane's worker, and each auxiliary thread, is on now (idle ones left out); safe to call from
        any thread."""
        lanes = [b for b in (lane.busy for lane in self._lanes.values()) if b is not None]
        return lanes + list(self._aux_busy.copy().values())

    def _wake_all(self) -> None:
        for lane in self._lanes.values():
            if lane.wakeup is not None:
                lane.wakeup.set()

    # ------------------------------------------------------------------ submission
    @contextlib.contextmanager
    def expect(self, steps: int) -> Iterator[Announcement | None]:
        """Announce ``steps`` updates about to be submitted (pass the announcement to :meth:`update`); only on
        the engine's event loop (elsewhere it yields ``None`` and changes nothing)."""
        try:
            on_loop = self._loop is not None and asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop or steps <= 0:
            yield None
            return
        announcement = Announcement(self, steps)
        try:
            yield announcement
        finally:
            announcement.close()

    async def update(
        self,
        updater: Updater,
        updater_key: Hashable,
        method: str,
        model: ModelFamily,
        state: ParticleState,
        obs: torch.Tensor,
        announced: Announcement | None = None,
        after: Callable[[StepResult], Any] | None = None,
        price: Priced | None = None,
    ) -> StepResult:
        """One step for one stream: state [B=1], obs of the family's observation shape (no batch dim);
        ``announced``: the caller's :meth:`expect` announcement, of which this consumes one step; ``after``:
        called on the worker thread with this stream's result right after its (batched) step — what the caller
        would otherwise do with the new state in a second hop (check it, summarise and encode it); its return
        value is ``StepResult.after``, an exception it raises is this stream's (and this stream's only); ``price``: the
        cost model's price of the step, which chooses its lane and bounds its batch (None: light, stacked freely)."""
        if not self._running or self._loop is None:
            raise RuntimeError("the update engine is not running")
        if asyncio.get_running_loop() is not self._loop:  # called from another event loop's thread
            coro = self.update(updater, updater_key, method, model, state, obs, after=after, price=price)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))
        lane = self._lanes[self.limits.lane_of(price)]
        if announced is not None:
            announced.consume(lane.tally)
        key = batch_key(updater_key, model, state, obs)
        future = asyncio.get_running_loop().create_future()
        assert lane.wakeup is not None
        job = _Job(key, method, updater, model, state, obs, future, after, price)
        lane.pending.setdefault(key, deque()).append(job)
        lane.wakeup.set()
        return await future

    async def update_run(
        self,
        updater: Updater,
        method: str,
        state: ParticleState,
        steps: list[tuple[ModelFamily, torch.Tensor]],
        announced: Announcement | None = None,
        after: Callable[[RunResult], Any] | None = None,
        price: Priced | None = None,
    ) -> RunResult:
        """Consecutive steps of one stream as one job (module docstring "Runs"): ``steps`` are (model of the step,
        observation) pairs, applied from ``state`` in order until the run's slice is used — the result says how
        many were applied (``len(result.steps)``) and, when one raised, its error; the caller submits the rest
        again. ``after``: called on the worker with the :class:`RunResult` (its return value is ``result.after``;
        an exception it raises is this call's); ``price``: the cost model's price of the run's dearest step, which
        chooses its lane."""
        if not self._running or self._loop is None:
            raise RuntimeError("the update engine is not running")
        if asyncio.get_running_loop() is not self._loop:  # called from another event loop's thread
            coro = self.update_run(updater, method, state, steps, after=after, price=price)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))
        if not steps:
            raise ValueError("steps: a run has at least one step")
        lane = self._lanes[self.limits.lane_of(price)]
        if announced is not None:  # the run's steps are all queued now: no other key waits for them
            announced.consume(lane.tally, len(steps))
        model, obs = steps[0]
        key = _RunKey()
        future = asyncio.get_running_loop().create_future()
        job = _Job(key, method, updater, model, state, obs, future, after, price, run=list(steps))
        assert lane.wakeup is not None
        lane.pending[key] = deque([job])
        lane.wakeup.set()
        return await future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run other tensor work (init, summaries, draws, (de)serialisation) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._aux, self._aux_call, fn, args)

    async def run_heavy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a heavy read (one using more than :data:`~mpflow.service.streams.costs.HEAVY_SHARE` of a request's
        budget: ``GET .../smoothed`` of a large window) on a thread of its own, at the slow lane's lower CPU
        priority: such reads queue behind one another and never hold the auxiliary threads that every stream
        creation and large decode needs, so concurrent heavy reads delay only each other."""
        return await asyncio.get_running_loop().run_in_executor(self._heavy, self._aux_call, fn, args)

    def _aux_call(self, fn: Callable[..., T], args: tuple) -> T:
        """(on an auxiliary thread) ``fn(*args)``, recorded as that thread's job while it runs (:meth:`busy`)."""
        token = object()
        self._aux_busy[id(token)] = Busy("aux", time.monotonic(), getattr(fn, "__qualname__", repr(fn)))
        try:
            return fn(*args)
        finally:
            del self._aux_busy[id(token)]

    # ------------------------------------------------------------------ dispatch
    def _choose(self, lane: _Lane) -> tuple[Hashable | None, float]:
        """The key to run next and how long to wait first. A key is ready when its batch is full, its oldest
        job has waited ``max_wait``, or no announced job is still to come (module docstring); of the ready keys
        the one with the oldest job goes first (no key starves another); if none is ready, wait until the first
        deadline (or a new job, or a closed announcement)."""
        now = time.monotonic()
        pending, tally, unassigned = lane.pending, lane.tally, self._unassigned
        announcements = tally.announcements + unassigned.announcements
        nothing_coming = announcements > 0 and tally.expected + unassigned.expected <= 0
        best_key, best_arrival, first_deadline = None, float("inf"), float("inf")
        for key, queue in pending.items():
            arrived = queue[0].arrived
            waits = self.batching and not nothing_coming and not isinstance(key, _RunKey)
            deadline = arrived + self.max_wait if waits else arrived
            if self._batch_length(lane, queue) < len(queue) or deadline <= now:
                if arrived < best_arrival:
                    best_key, best_arrival = key, arrived
            else:
                first_deadline = min(first_deadline, deadline)
        if best_key is not None:
            return best_key, 0.0
        return None, first_deadline - now

    def _batch_length(self, lane: _Lane, queue: deque[_Job]) -> int:
        """How many of the queue's first jobs one call takes: at most ``max_batch_size``, and only while their summed
        price stays within the lane's cap (:meth:`LaneLimits.batch_cap`); at least one (a job over the cap runs
        alone). Fewer than the queue holds means the batch is full."""
        cap, spent, count = self.limits.batch_cap(lane.name), 0.0, 0
        for job in queue:
            if count >= self.max_batch_size:
                break
            spent += 0.0 if job.price is None else self.limits.share(job.price)
            if count and spent > cap:
                break
            count += 1
        return count

    async def _dispatch_loop(self, lane: _Lane) -> None:
        """One lane's dispatcher: its ready batches, one at a time, on its worker."""
        wakeup, pending = lane.wakeup, lane.pending
        assert wakeup is not None
        while True:
            if not pending:
                wakeup.clear()
                await wakeup.wait()
                continue
            key, wait = self._choose(lane)
            if key is None:  # nothing ready: sleep until the first deadline or a new job
                wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), max(wait, 0.0))
                continue
            queue = pending[key]
            jobs = [queue.popleft() for _ in range(self._batch_length(lane, queue))]
            if not queue:
                del pending[key]
            jobs = [j for j in jobs if not j.future.done()]  # cancelled while queued
            if not jobs:
                continue
            try:
                results = await asyncio.get_running_loop().run_in_executor(lane.worker, self._compute, lane, jobs)
            except asyncio.CancelledError:
                for j in jobs:
                    j.future.cancel()
                raise
            for job, res in zip(jobs, results, strict=True):
                _settle(job.future, res)

    # ------------------------------------------------------------------ compute (worker thread)
    def _observe(self, method: str, family: str, batch: int, elapsed: float, n: int, info: StepInfo) -> None:
        if self.observer is not None:
            self.observer(method, family, batch, elapsed)
        if self.health_observer is not None:
            self.health_observer(method, info.ess / n, info.extras)

    def _call(self, jobs: list[_Job]) -> list[StepResult]:
        first = jobs[0]
        if len(jobs) == 1:
            state, model, obs = first.state, first.model, first.obs[None]
        else:
            state = ParticleState.stack([j.state for j in jobs])
            model = type(first.model).stack([j.model for j in jobs])
            obs = torch.stack([j.obs for j in jobs])
        t0 = time.perf_counter()
        new, info = first.updater.update(state, obs, model)
        self._observe(
            first.method, first.model.name, len(jobs), time.perf_counter() - t0, state.particles.shape[1], info
        )
        states = new.unbind() if len(jobs) > 1 else [new]
        infos = _split_info(info, len(jobs)) if len(jobs) > 1 else [info]
        rows = self.summarise(new) if self.summarise is not None else [None] * len(jobs)
        return [StepResult(s, i, summary=r) for s, i, r in zip(states, infos, rows, strict=True)]

    def _compute(self, lane: _Lane, jobs: list[_Job]) -> list[StepResult | BaseException]:
        """The jobs' step (batched, or one by one if the batch fails), then each job's ``after`` hook; the lane
        records what its worker is on meanwhile (:meth:`busy`)."""
        lane.busy = Busy(lane.name, time.monotonic(), f"{jobs[0].describe()}, {len(jobs)} stream(s)")
        try:
            if jobs[0].run is not None:  # a run job is alone in its key
                return [_after(jobs[0], self._run(jobs[0]))]
            return [_after(job, res) for job, res in zip(jobs, self._steps(jobs), strict=True)]
        finally:
            lane.busy = None

    def _steps(self, jobs: list[_Job]) -> list[StepResult | BaseException]:
        try:
            return list(self._call(jobs))
        except Exception as exc:
            if len(jobs) == 1:
                return [exc]
            log.info("a batch of %d failed (%s); re-running its streams one by one", len(jobs), exc)
        out: list[StepResult | BaseException] = []
        for job in jobs:
            try:
                out.append(self._call([job])[0])
            except Exception as exc:
                out.append(exc)
        return out

    def _run(self, job: _Job) -> RunResult:
        """A run job's steps, one after the other from its state, until its slice is used or a step raises; then
        their summaries in one ``summarise`` pass over the stacked states (module docstring "Runs")."""
        assert job.run is not None
        n, d = job.state.particles.shape[-2:]
        state, out = job.state, RunResult([])
        stop = time.thread_time() + RUN_SLICE_S
        for model, obs in job.run[: run_length(n, d, len(job.run))]:
            t0 = time.perf_counter()
            try:
                state, info = job.updater.update(state, obs[None], model)
            except Exception as exc:
                out.error = exc
                break
            self._observe(job.method, model.name, 1, time.perf_counter() - t0, n, info)
            out.steps.append(StepResult(state, info))
            if time.thread_time() >= stop:
                break
        if self.summarise is not None and out.steps:
            try:
                rows = self.summarise(ParticleState.stack([r.state for r in out.steps]))
            except (ValueError, RuntimeError):  # the steps' states differ in their fields or shapes: one pass each
                rows = [row for r in out.steps for row in self.summarise(r.state)]
            for r, row in zip(out.steps, rows, strict=True):
                r.summary = row
        return out


def _after(job: _Job, res: Any) -> Any:
    if job.after is None or isinstance(res, BaseException):
        return res
    try:
        res.after = job.after(res)
    except Exception as exc:
        return exc
    return res


__all__ = [
    "RUN_FLOATS",
    "RUN_SLICE_S",
    "RUN_STEPS",
    "Announcement",
    "Busy",
    "RunResult",
    "StepResult",
    "UpdateEngine",
    "batch_key",
    "run_length",
]
