"""One predict per step: the cost of an update with its predictive p-values, before and after sharing the predict.

``python -m benchmarks.shared_predict [--quick]``. Before: :meth:`Updater.pit` predicted the cloud a second time
(a copy of the stream's generators) and the method's ``_update`` predicted it again; after
(:attr:`Updater.shares_prediction`), the step's one predict feeds both. The "before" is the same code with
``shares_prediction`` switched off on the method's class, so both run in one process and alternate (a change of
the machine's load hits them alike). Per (method, family): the median milliseconds per update of one stream over
``--steps`` steps, and the ratio before / after. Both give the same increments and p-values (checked here).
Results: a table on stdout and ``benchmarks/results/shared_predict.json``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.updaters import get_updater

from benchmarks import report

NAME = "shared_predict"
F64 = torch.float64
CASES = [
    ("smc", {}, 256, "lds", 1),
    ("smc", {}, 4096, "stochastic_volatility", 1),
    ("mpf", {}, 256, "stochastic_volatility", 1),
    ("mpf", {"correct": True}, 256, "stochastic_volatility", 1),
    ("mpf", {}, 256, "stochastic_volatility", 5),
    ("gpf", {}, 256, "stochastic_volatility", 1),
    ("smc", {}, 4096, "lorenz96", 10),
    ("mpf", {"correct": True, "flow_fraction": "auto"}, 800, "lorenz96", 10),
]


def run(method: str, options: dict, n: int, family: str, d: int, steps: int, shared: bool):
    """(seconds per update, increments, pit) of ``steps`` updates of one stream."""
    up = get_updater(method, **options)
    cls = type(up)
    saved = cls.__dict__.get("shares_prediction")
    cls.shares_prediction = shared
    try:
        model = make_model(family, FAMILIES[family].example_params(d), d, torch.float32)
        prior = GaussianMixture.gaussian(torch.zeros(1, d, dtype=F64), torch.eye(d, dtype=F64)[None])
        gen = torch.Generator().manual_seed(7)
        _, obs = model.simulate(steps, prior.sample(1, [gen])[:, 0].float(), [gen])
        state = up.init(prior, model, n, [3])
        inc, pit = [], []
        start = time.perf_counter()
        for t in range(steps):
            state, info = up.update(state, obs[:, t], model)
            inc.append(info.log_evidence_increment)
            pit.append(info.extras.get("pit"))
        return (time.perf_counter() - start) / steps, torch.stack(inc), pit
    finally:
        if saved is None:
            del cls.shares_prediction
        else:
            cls.shares_prediction = saved


def main() -> None:
    p = report.parser(NAME, __doc__, "fewer steps and repeats")
    args = p.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    steps, repeats = (50, 3) if args.quick else (200, 5)
    rows = []
    print(f"{'method':24s} {'family':24s} {'N':>5s} {'before ms':>10s} {'after ms':>9s} {'ratio':>6s}  increments")
    for method, options, n, family, d in CASES:
        times = {True: [], False: []}
        same = True
        for r in range(repeats):
            results = {}
            for shared in (r % 2 == 0, r % 2 != 0):
                sec, inc, pit = run(method, options, n, family, d, steps, shared)
                times[shared].append(sec)
                results[shared] = (inc, pit)
            same &= bool(torch.equal(results[True][0], results[False][0]))
        before, after = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        label = method + (" " + " ".join(f"{k}={v}" for k, v in options.items()) if options else "")
        rows.append(
            {
                "method": method,
                "options": options,
                "particles": n,
                "family": family,
                "state_dim": d,
                "before_ms": before,
                "after_ms": after,
                "ratio": before / after,
                "identical_increments": same,
            }
        )
        where = f"{family} d={d}"
        print(
            f"{label:24s} {where:24s} {n:5d} {before:10.2f} {after:9.2f} {before / after:6.2f}  same: {same}",
            flush=True,
        )
    result = {"steps": steps, "repeats": repeats, "rows": rows, **report.machine_meta(load)}
    report.write_outputs(result, report.out_stem(args, NAME))


if __name__ == "__main__":
    main()
