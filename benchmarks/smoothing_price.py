"""What one backward-simulation proposal costs, in the cost model's currency: the floating-point operations of an
``smc`` step that take as long (:data:`mpflow.operators.smoothing.backward_simulation.PROPOSAL_FLOPS`).

The cost model prices a request in floating-point operations against ``MPFLOW_MAX_REQUEST_FLOPS``
(:mod:`mpflow.service.streams.costs`). Backward simulation's work is memory-bound — a binary search of the
cumulative weights and a few gathers per proposal, and a round's fixed costs — so its flop count says little of its
time. This measures, in one process and one thread:

* an ``smc`` step of ``lds`` d = 64, N = 16384 (its priced flops over its wall time: the step's rate);
* one ``GET .../smoothed`` of an ``smc`` stream (the 2-D ``lds`` of ``tests/harness/rts.py``, N = 4096, L = 100)
  as it runs, and in its worst case (every proposal rejected: all :data:`REJECTION_TRIALS` proposals, the exact
  fall-backs and the Metropolis–Hastings moves for the rest);

and prints the worst case's time in the step's flops per trajectory and window step, and the ``PROPOSAL_FLOPS`` that
prices it (the rest of :func:`trajectory_flops` held as it is). Median of ``--repeats`` runs each. Writes
``benchmarks/results/smoothing_price.json``.

    python -m benchmarks.smoothing_price [--repeats 3]
"""

from __future__ import annotations

import os
import statistics
import time
from unittest import mock

import numpy as np
import torch
from mpflow.operators import smoothing
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.smoothing import backward_simulation as bs
from mpflow.operators.updaters import get_updater
from mpflow.service.streams import costs

from benchmarks import report
from tests.harness.rts import PARAMS, data

F64 = torch.float64
STEP_D, STEP_N = 64, 16384
READ_N, READ_LAG, READ_D = 4096, 100, 2


def smc_stream(params: dict, d: int, n: int, lag: int = 0):
    model = make_model("lds", params, d)
    updater = get_updater("smc")
    prior = GaussianMixture.gaussian(torch.zeros(1, d, dtype=F64), torch.eye(d, dtype=F64)[None])
    return model, updater, updater.init(prior, model, n, [3], smoothing_lag=lag)


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_rate(repeats: int) -> tuple[float, float]:
    """(priced flops, seconds) of one ``smc`` step at d = 64, N = 16384."""
    params = {"A": (0.9 * np.eye(STEP_D)).tolist(), "B": np.eye(STEP_D).tolist()}
    model, updater, state = smc_stream(params, STEP_D, STEP_N)
    obs = torch.zeros(1, STEP_D)
    state, _ = updater.update(state, obs, model)
    box = [state]

    def step() -> None:
        box[0] = updater.update(box[0], obs, model)[0]

    return costs.observations_cost(model, updater, STEP_N, [(1.0, STEP_D)], 0).flops, seconds(step, repeats)


def read_times(repeats: int) -> tuple[float, float]:
    """(seconds as it runs, seconds in the worst case) of one ``smoothed`` at N = 4096, L = 100."""
    model, updater, state = smc_stream(PARAMS, READ_D, READ_N, READ_LAG)
    for y in data(READ_LAG + 5):
        state, _ = updater.update(state, torch.tensor([y]), model)
    window, core = smoothing.split(state)
    typical = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    rejecting = bs.Sampler.log_ratio
    with mock.patch.object(bs.Sampler, "log_ratio", lambda self, i, j: rejecting(self, i, j) - 1e6):
        worst = seconds(lambda: updater.smoother.smooth(updater, window, core), repeats)
    return typical, worst


def main(argv: list[str] | None = None) -> int:
    p = report.parser("smoothing_price", __doc__, "one repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()
    repeats = 1 if args.quick else args.repeats
    step_flops, step_s = step_rate(repeats)
    rate = step_flops / step_s
    typical, worst = read_times(repeats)
    per_trajectory_step = worst * rate / (READ_LAG * READ_N)
    proposals = bs.REJECTION_TRIALS + bs.MH_MOVES
    others = bs.trajectory_flops(READ_N, READ_N, READ_D) / READ_N - proposals * (3.0 * READ_D + bs.PROPOSAL_FLOPS)
    fitted = (per_trajectory_step - others) / proposals - 3.0 * READ_D
    priced = updater_read_flops()
    rows = [
        ("smc step, lds d = 64, N = 16384", f"{step_s:.3f}", f"{step_flops:.3g}", f"{rate / 1e9:.2f}"),
        ("smoothed, N = 4096, L = 100, as it runs", f"{typical:.3f}", f"{priced:.3g}", f"{priced / typical / 1e9:.2f}"),
        ("smoothed, the same, worst case", f"{worst:.3f}", f"{priced:.3g}", f"{priced / worst / 1e9:.2f}"),
    ]
    print(report.markdown_table(("work", "s (median)", "priced flops", "priced Gflop/s"), rows, "lrrr"))
    print(
        f"\nworst case: {per_trajectory_step:.0f} step flops per trajectory and step; PROPOSAL_FLOPS that prices it: "
        f"{fitted:.0f} (now {bs.PROPOSAL_FLOPS:.0f}); worst / as it runs: {worst / typical:.2f}"
    )
    result = {
        "step": {"flops": step_flops, "seconds": step_s, "gflops_per_s": rate / 1e9},
        "read": {"priced_flops": priced, "seconds": typical, "worst_seconds": worst},
        "worst_flops_per_trajectory_step": per_trajectory_step,
        "fitted_proposal_flops": fitted,
        "proposal_flops": bs.PROPOSAL_FLOPS,
        "meta": report.machine_meta(load),
    }
    report.write_json(result, report.out_stem(args, "smoothing_price").with_suffix(".json"))
    return 0


def updater_read_flops() -> float:
    """The priced flops of the read measured here (:meth:`ParticleSmoother.smooth_flops`)."""
    return get_updater("smc").smoother.smooth_flops(READ_LAG, READ_N, READ_D)


if __name__ == "__main__":
    raise SystemExit(main())
