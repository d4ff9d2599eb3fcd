"""What ``smc``'s smoothing costs, in the cost model's currency: the floating-point operations of an ``smc`` step
that take as long — of a backward-simulation proposal
(:data:`mpflow.operators.smoothing.backward_simulation.PROPOSAL_FLOPS`), of an exact kernel term
(:data:`~mpflow.operators.smoothing.backward_simulation.KERNEL_TERM_FLOPS`) and of a genealogy link
(:data:`mpflow.operators.particles.GENEALOGY_FLOPS`).

The cost model prices a request in floating-point operations against ``MPFLOW_MAX_REQUEST_FLOPS``
(:mod:`mpflow.service.streams.costs`). Backward simulation's work is memory-bound — a binary search of the
cumulative weights and a few gathers per proposal, and a round's fixed costs — so its flop count says little of its
time. This measures, in one process and one thread:

* an ``smc`` step of ``lds`` d = 64, N = 16384 (its priced flops over its time: the step's rate);
* one ``GET .../smoothed`` of an ``smc`` stream (the 2-D ``lds`` of ``tests/harness/rts.py``, N = 4096, L = 100)
  as it runs, and in its worst case (every proposal rejected: all :data:`REJECTION_TRIALS` proposals, the exact
  fall-backs and the Metropolis–Hastings moves for the rest);
* the same read by FFBSm at N = 512 (N² kernel terms a step whatever the data: as it runs is its worst case), and
  by backward simulation at N = 513, as it runs and in its worst case (the two sides of ``FFBSM_MAX_PARTICLES``);
* the same read of a static family's stream (``linear_gaussian`` of :data:`STATIC_PARAMS`, d = 2, N = 4096,
  L = 100: the genealogy's walk, N links a step whatever the data);

and prints the ``KERNEL_TERM_FLOPS`` that prices FFBSm's read, the ``GENEALOGY_FLOPS`` that prices the static read
(each step's 4 N d² of moments held as they are), the worst case's time in the step's flops per trajectory and
window step and the ``PROPOSAL_FLOPS`` that prices it (the rest of :func:`trajectory_flops`, its exact fall-backs
at the constant ``KERNEL_TERM_FLOPS``, held as it is). Then the check of the price: the same two reads of
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
from mpflow.operators.smoothing import particles
from mpflow.operators.updaters import get_updater
from mpflow.service.settings import Settings

from benchmarks import report
from tests.harness.rts import PARAMS, data
from tests.harness.smoothing_windows import largest_window

F64 = torch.float64
STEP_D, STEP_N = 64, 16384
READ_N, READ_LAG, READ_D = 4096, 100, 2
#: the static family's read: ``linear_gaussian`` seeing x₁ + x₂ / 2 (one number a step, as the ``lds`` data)
STATIC_PARAMS = {"H": [[1.0, 0.5]]}
#: the sizes either side of the switch from FFBSm to backward simulation
FFBSM_N, FFBSI_N = particles.FFBSM_MAX_PARTICLES, particles.FFBSM_MAX_PARTICLES + 1
#: steps timed per repeat of a read: a step takes a tenth of a second, and varies by up to 2× from one to the next
#: on shared cores (0.07 to 0.14 s of CPU over 20 steps on 2026-11-28), so its median wants more samples
STEP_REPEATS = 5


def smc_stream(params: dict, d: int, n: int, lag: int = 0, family: str = "lds"):
    model = make_model(family, params, d)
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


#: the reference step's flops: its one-step observation's price (``costs.observations_cost``) when the measured
#: constants were first fitted against it (2026-11-27/28), held fixed as the currency they are in — the step's own
#: price has since grown as its parts were priced at their time (its p-values' CDFs, its summary's quantiles:
#: ``benchmarks/price_audit.py``), and a currency that moved with it would move every fit made in it
STEP_FLOPS = 1446753344.0


def step_rate(repeats: int) -> tuple[float, Timing]:
    """(:data:`STEP_FLOPS`, times) of one ``smc`` step at d = 64, N = 16384."""
    params = {"A": (0.9 * np.eye(STEP_D)).tolist(), "B": np.eye(STEP_D).tolist()}
    model, updater, state = smc_stream(params, STEP_D, STEP_N)
    obs = torch.zeros(1, STEP_D)
    state, _ = updater.update(state, obs, model)
    box = [state]

    def step() -> None:
        box[0] = updater.update(box[0], obs, model)[0]

    return STEP_FLOPS, seconds(step, repeats)


def rejecting_every_proposal():
    """While it is held, backward simulation's worst case: every rejection proposal refused (its log-ratio lowered
    by 10⁶), so every trajectory runs all :data:`REJECTION_TRIALS` and the exact and Metropolis–Hastings fall-backs."""
    rejecting = bs.Sampler.log_ratio
    return mock.patch.object(bs.Sampler, "log_ratio", lambda self, i, j: rejecting(self, i, j) - 1e6)


def read_times(repeats: int, n: int = READ_N, family: str = "lds") -> tuple[Timing, Timing, float]:
    """(times as it runs, times in the worst case, priced flops) of one ``smoothed`` of a ``family`` stream (d = 2,
    the data of :mod:`tests.harness.rts`) at N = ``n``, L = 100."""
    model, updater, state = smc_stream(PARAMS if family == "lds" else STATIC_PARAMS, READ_D, n, READ_LAG, family)
    for y in data(READ_LAG + 5):
        state, _ = updater.update(state, torch.tensor([y]), model)
    window, core = smoothing.split(state)
    typical = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    with rejecting_every_proposal():
        worst = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    return typical, worst, updater.smoother.smooth_flops(model, READ_LAG, n)


def per_link(cpu_s: float, rate: float, n: int, links: int) -> float:
    """The step flops of each of ``links`` terms of each window step of a read at N = ``n``, L = 100 taking ``cpu_s``
    at a step's ``rate``, less the step's 4 N d² of moments (:meth:`ParticleSmoother.smooth_flops`)."""
    return (cpu_s * rate / READ_LAG - 4.0 * n * READ_D * READ_D) / links


def fitted_proposal_flops(worst_s: float, rate: float) -> tuple[float, float]:
    """(step flops per trajectory and window step, the ``PROPOSAL_FLOPS`` that prices them) of a worst-case read at
    N = 4096, L = 100 taking ``worst_s`` at a step's ``rate`` (the rest of :func:`trajectory_flops` as it is)."""
    per_trajectory_step = worst_s * rate / (READ_LAG * READ_N)
    proposals = bs.REJECTION_TRIALS + bs.MH_MOVES
    others = bs.trajectory_flops(READ_N, READ_N, READ_D) / READ_N - proposals * (3.0 * READ_D + bs.PROPOSAL_FLOPS)
    others += 4.0 * READ_D * READ_D
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
    typical, worst, priced = read_times(repeats)
    per_trajectory_step, fitted = fitted_proposal_flops(worst.cpu, rate)
    _, fitted_wall = fitted_proposal_flops(worst.wall, wall_rate)
    ffbsm, _, ffbsm_priced = read_times(repeats, FFBSM_N)
    kernel_term = per_link(ffbsm.cpu, rate, FFBSM_N, FFBSM_N * FFBSM_N)
    ffbsi, ffbsi_worst, ffbsi_priced = read_times(repeats, FFBSI_N)
    static, _, static_priced = read_times(repeats, READ_N, "linear_gaussian")
    genealogy = per_link(static.cpu, rate, READ_N, READ_N)
    settings = Settings(redis_url="redis://unused")
    largest = largest_window(settings, READ_LAG)
    largest_typical, largest_worst, largest_priced = read_times(repeats, largest)
    budget_s = settings.max_request_flops / rate
    rows = [
        ("smc step, lds d = 64, N = 16384", step, step_flops),
        (f"smoothed, N = {READ_N}, L = 100, as it runs", typical, priced),
        ("smoothed, the same, worst case", worst, priced),
        (f"smoothed by FFBSm, N = {FFBSM_N}, L = 100 (as it runs = worst case)", ffbsm, ffbsm_priced),
        (f"smoothed by FFBSi, N = {FFBSI_N}, L = 100, as it runs", ffbsi, ffbsi_priced),
        ("smoothed by FFBSi, the same, worst case", ffbsi_worst, ffbsi_priced),
        (f"smoothed, static linear_gaussian, N = {READ_N}, L = 100 (genealogy)", static, static_priced),
    ]
    rows += [
        (f"smoothed, largest N = {largest} at L = 100, {label}", t, largest_priced)
        for label, t in (("as it runs", largest_typical), ("worst case", largest_worst))
    ]
    table = [(w, f"{t.wall:.3f}", f"{t.cpu:.3f}", f"{f:.3g}", f"{f / t.cpu / 1e9:.2f}") for w, t, f in rows]
    header = ("work", "s wall", "s CPU", "priced flops", "priced Gflop/s (CPU)")
    print(report.markdown_table(header, table, "lrrrr"))
    print(
        f"\nstep rate {rate / 1e9:.2f} Gflop/s (CPU). KERNEL_TERM_FLOPS that prices FFBSm at N = {FFBSM_N}: "
        f"{kernel_term:.0f} (now {bs.KERNEL_TERM_FLOPS:.0f}); GENEALOGY_FLOPS that prices the static read: "
        f"{genealogy:.0f} (now {particles.GENEALOGY_FLOPS:.0f})"
    )
    print(
        f"worst case: {per_trajectory_step:.0f} step flops per trajectory and step (CPU times); PROPOSAL_FLOPS that "
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
        "read": read_json(priced, typical, worst),
        "worst_flops_per_trajectory_step": per_trajectory_step,
        "fitted_proposal_flops": fitted,
        "fitted_proposal_flops_wall": fitted_wall,
        "proposal_flops": bs.PROPOSAL_FLOPS,
        "ffbsm_read": {"num_particles": FFBSM_N, **read_json(ffbsm_priced, ffbsm)},
        "fitted_kernel_term_flops": kernel_term,
        "kernel_term_flops": bs.KERNEL_TERM_FLOPS,
        "ffbsi_read": {"num_particles": FFBSI_N, **read_json(ffbsi_priced, ffbsi, ffbsi_worst)},
        "static_read": {"family": "linear_gaussian", "num_particles": READ_N, **read_json(static_priced, static)},
        "fitted_genealogy_flops": genealogy,
        "genealogy_flops": particles.GENEALOGY_FLOPS,
        "largest_window": {
            "lag": READ_LAG,
            "num_particles": largest,
            "budget_flops": settings.max_request_flops,
            "budget_seconds_at_step_rate": budget_s,
            **read_json(largest_priced, largest_typical, largest_worst),
        },
        "meta": report.machine_meta(load),
    }
    report.write_json(result, report.out_stem(args, "smoothing_price").with_suffix(".json"))
    return 0


def read_json(priced: float, typical: Timing, worst: Timing | None = None) -> dict[str, float]:
    """A read's priced flops and times (its worst case's where it has one apart)."""
    out = {"priced_flops": priced, "seconds": typical.wall, "cpu_seconds": typical.cpu}
    if worst is not None:
        out |= {"worst_seconds": worst.wall, "worst_cpu_seconds": worst.cpu}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
