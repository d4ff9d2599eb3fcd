"""What one backward-simulation proposal costs, in the cost model's currency: the floating-point operations of an
``smc`` step that take as long (:data:`mpflow.operators.smoothing.backward_simulation.PROPOSAL_FLOPS`).

The cost model prices a request in floating-point operations against ``MPFLOW_MAX_REQUEST_FLOPS``
(:mod:`mpflow.service.streams.costs`). Backward simulation's work is memory-bound — a binary search of the
cumulative weights and a few gathers per proposal, and a round's fixed costs — so its flop count says little of its
time. This measures, in one process and one thread:

* an ``smc`` step of ``lds`` d = 64, N = 16384 (its priced flops over its time: the step's rate);
* one ``GET .../smoothed`` of an ``smc`` stream (the 2-D ``lds`` of ``tests/harness/rts.py``, N = 4096, L = 100)
  as it runs, and in its worst case (every proposal rejected: all :data:`REJECTION_TRIALS` proposals, the exact
  fall-backs and the Metropolis–Hastings moves for the rest);

and prints the worst case's time in the step's flops per trajectory and window step, and the ``PROPOSAL_FLOPS`` that
prices it (the rest of :func:`trajectory_flops` held as it is). Then the check of the price: the same two reads of
the largest window the default limits accept at L = 100 (:func:`mpflow.service.streams.costs.largest` of the
stream's dearest request), against the time the flops budget buys at the step's rate
(``MPFLOW_MAX_REQUEST_FLOPS`` / the step's priced Gflop/s). Median of ``--repeats`` runs each (of 5 × as many
steps), in wall time and in the process's CPU time: the price is fitted from the CPU times (one thread), which leave
out the time other jobs of shared cores held the core — under load they stretch a read of seconds more than a step
of a tenth of one, and the wall times' fit with them. Writes ``benchmarks/results/smoothing_price.json``.

    python -m benchmarks.smoothing_price [--repeats 3]
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
from mpflow.operators import smoothing
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.smoothing import backward_simulation as bs
from mpflow.operators.updaters import get_updater
from mpflow.service.settings import Settings
from mpflow.service.streams import costs

from benchmarks import report
from tests.harness.rts import PARAMS, data
from tests.harness.smoothing_windows import largest_window

F64 = torch.float64
STEP_D, STEP_N = 64, 16384
READ_N, READ_LAG, READ_D = 4096, 100, 2
#: steps timed per repeat of a read: a step takes a tenth of a second, and varies by up to 2× from one to the next
#: on shared cores (0.07 to 0.14 s of CPU over 20 steps on 2026-11-28), so its median wants more samples
STEP_REPEATS = 5


def smc_stream(params: dict, d: int, n: int, lag: int = 0):
    model = make_model("lds", params, d)
    updater = get_updater("smc")
    prior = GaussianMixture.gaussian(torch.zeros(1, d, dtype=F64), torch.eye(d, dtype=F64)[None])
    return model, updater, updater.init(prior, model, n, [3], smoothing_lag=lag)


@dataclass(frozen=True)
class Timing:
    """Medians over the repeats: ``wall`` seconds, and ``cpu`` seconds of this process (one thread: the time it ran,
    without the time the other jobs of shared cores held the core — what the price is fitted from)."""

    wall: float
    cpu: float


def seconds(fn, repeats: int) -> Timing:
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return Timing(statistics.median(walls), statistics.median(cpus))


def step_rate(repeats: int) -> tuple[float, Timing]:
    """(priced flops, times) of one ``smc`` step at d = 64, N = 16384."""
    params = {"A": (0.9 * np.eye(STEP_D)).tolist(), "B": np.eye(STEP_D).tolist()}
    model, updater, state = smc_stream(params, STEP_D, STEP_N)
    obs = torch.zeros(1, STEP_D)
    state, _ = updater.update(state, obs, model)
    box = [state]

    def step() -> None:
        box[0] = updater.update(box[0], obs, model)[0]

    return costs.observations_cost(model, updater, STEP_N, [(1.0, STEP_D)], 0).flops, seconds(step, repeats)


def read_times(repeats: int, n: int = READ_N, lag: int = READ_LAG) -> tuple[Timing, Timing]:
    """(times as it runs, times in the worst case) of one ``smoothed`` at N = ``n``, L = ``lag``."""
    model, updater, state = smc_stream(PARAMS, READ_D, n, lag)
    for y in data(lag + 5):
        state, _ = updater.update(state, torch.tensor([y]), model)
    window, core = smoothing.split(state)
    typical = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    rejecting = bs.Sampler.log_ratio
    with mock.patch.object(bs.Sampler, "log_ratio", lambda self, i, j: rejecting(self, i, j) - 1e6):
        worst = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    return typical, worst


def fitted_proposal_flops(worst_s: float, rate: float) -> tuple[float, float]:
    """(step flops per trajectory and window step, the ``PROPOSAL_FLOPS`` that prices them) of a worst-case read at
    N = 4096, L = 100 taking ``worst_s`` at a step's ``rate`` (the rest of :func:`trajectory_flops` as it is)."""
    per_trajectory_step = worst_s * rate / (READ_LAG * READ_N)
    proposals = bs.REJECTION_TRIALS + bs.MH_MOVES
    others = bs.trajectory_flops(READ_N, READ_N, READ_D) / READ_N - proposals * (3.0 * READ_D + bs.PROPOSAL_FLOPS)
    return per_trajectory_step, (per_trajectory_step - others) / proposals - 3.0 * READ_D


def main(argv: list[str] | None = None) -> int:
    p = report.parser("smoothing_price", __doc__, "one repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()
    repeats = 1 if args.quick else args.repeats
    step_flops, step = step_rate(STEP_REPEATS * repeats)
    rate, wall_rate = step_flops / step.cpu, step_flops / step.wall
    typical, worst = read_times(repeats)
    per_trajectory_step, fitted = fitted_proposal_flops(worst.cpu, rate)
    _, fitted_wall = fitted_proposal_flops(worst.wall, wall_rate)
    priced = updater_read_flops()
    settings = Settings(redis_url="redis://unused")
    largest = largest_window(settings, READ_LAG)
    largest_priced = updater_read_flops(largest)
    largest_typical, largest_worst = read_times(repeats, largest)
    budget_s = settings.max_request_flops / rate
    rows = [
        ("smc step, lds d = 64, N = 16384", step, step_flops),
        ("smoothed, N = 4096, L = 100, as it runs", typical, priced),
        ("smoothed, the same, worst case", worst, priced),
    ]
    rows += [
        (f"smoothed, largest N = {largest} at L = 100, {label}", t, largest_priced)
        for label, t in (("as it runs", largest_typical), ("worst case", largest_worst))
    ]
    table = [(w, f"{t.wall:.3f}", f"{t.cpu:.3f}", f"{f:.3g}", f"{f / t.cpu / 1e9:.2f}") for w, t, f in rows]
    header = ("work", "s wall", "s CPU", "priced flops", "priced Gflop/s (CPU)")
    print(report.markdown_table(header, table, "lrrrr"))
    print(
        f"\nworst case: {per_trajectory_step:.0f} step flops per trajectory and step (CPU times); PROPOSAL_FLOPS that "
        f"prices it: {fitted:.0f} ({fitted_wall:.0f} from wall times; now {bs.PROPOSAL_FLOPS:.0f}); worst / as it "
        f"runs: {worst.cpu / typical.cpu:.2f}"
    )
    print(
        f"largest window at L = {READ_LAG}: N = {largest}; the flops budget buys {budget_s:.2f} s at the step's rate; "
        f"its read took {largest_typical.cpu:.2f} s as it runs, {largest_worst.cpu:.2f} s in the worst case "
        f"({largest_worst.cpu / budget_s:.2f} of the budget's time; wall {largest_worst.wall:.2f} s)"
    )
    result = {
        "step": {
            "flops": step_flops,
            "seconds": step.wall,
            "cpu_seconds": step.cpu,
            "gflops_per_s": rate / 1e9,
            "wall_gflops_per_s": wall_rate / 1e9,
        },
        "read": {
            "priced_flops": priced,
            "seconds": typical.wall,
            "worst_seconds": worst.wall,
            "cpu_seconds": typical.cpu,
            "worst_cpu_seconds": worst.cpu,
        },
        "worst_flops_per_trajectory_step": per_trajectory_step,
        "fitted_proposal_flops": fitted,
        "fitted_proposal_flops_wall": fitted_wall,
        "proposal_flops": bs.PROPOSAL_FLOPS,
        "largest_window": {
            "lag": READ_LAG,
            "num_particles": largest,
            "priced_flops": largest_priced,
            "budget_flops": settings.max_request_flops,
            "budget_seconds_at_step_rate": budget_s,
            "seconds": largest_typical.wall,
            "worst_seconds": largest_worst.wall,
            "cpu_seconds": largest_typical.cpu,
            "worst_cpu_seconds": largest_worst.cpu,
        },
        "meta": report.machine_meta(load),
    }
    report.write_json(result, report.out_stem(args, "smoothing_price").with_suffix(".json"))
    return 0


def updater_read_flops(n: int = READ_N) -> float:
    """The priced flops of a read measured here, at N = ``n``, L = 100 (:meth:`ParticleSmoother.smooth_flops`)."""
    return get_updater("smc").smoother.smooth_flops(READ_LAG, n, READ_D)


if __name__ == "__main__":
    raise SystemExit(main())
