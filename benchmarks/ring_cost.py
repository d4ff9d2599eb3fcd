"""The compute of the Lorenz-96 spantini2019 rows against the LETKF N = 40, interleaved so that the load of a shared
machine falls on all alike: ``python -m benchmarks.ring_cost [--ring PATH] [--rounds R] [--steps S]``.

The rows: the LETKF at N = 40 and 100, the iterative EnKF (``ienkf``, :data:`IENKF_ROWS`) and, with ``--ring``, the
LETKF + learned ring correction/flow of that file; with ``--correction NAME``, ``ienkf`` N = 40 with that registered
learned correction and the base ``ienkf`` at N = 44 and 48 (:data:`EQUAL_COMPUTE_ROWS`: what the correction's cost buys
the base); with ``--relock NAME``, ``ienkf`` N = 40 re-locking by that registered ring observer. Each round
runs S analysis steps of every row on the spantini2019 twins (4 streams) one after the other; the ratio is the median
over rounds of (row's time / the LETKF N = 40 time of the same round). ``--warm W`` first runs every row W steps
untimed and then times each round's S steps where the row's last round left off (the cost on a tracking filter, not
on the start-up from the prior, where a re-locking stream re-seeds and its next IEnKF steps run every iteration).
Prints the table and writes ``benchmarks/results/ring-cost.json`` (``ienkf-cost.json`` without ``--ring``;
``ienkf-correction-cost.json`` with ``--correction``, ``ienkf-relock-cost.json`` with ``--relock``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks import report
from benchmarks.lorenz96 import SETTINGS, make_updater, twin

ROWS = (("enkf", 40, {"inflation": 1.05, "localisation": 4}), ("enkf", 100, {"inflation": 1.05, "localisation": 4}))
#: the iterative EnKF rows (ρ as measured best in ``benchmarks.lorenz96``): N = 20, 40, 60 with at most 4
#: Gauss–Newton iterations, and N = 40 with 10
IENKF_ROWS = tuple(
    ("ienkf", n, {"inflation": rho, "iterations": k})
    for n, rho, k in ((20, 1.2, 4), (40, 1.2, 4), (40, 1.2, 10), (60, 1.1, 4))
)


#: ``--correction``: the base at the N that spends what the correction adds
EQUAL_COMPUTE_ROWS = tuple(("ienkf", n, {"inflation": 1.2, "iterations": 4}) for n in (44, 48))


def label(method: str, n: int, options: dict) -> str:
    """``ienkf N=40 ρ=1.2 iterations=4``: a row's name in the table."""
    keys = ("inflation", "iterations", "correction", "relock")
    extra = "".join(f" {k}={options[k]}" for k in keys if k in options and method == "ienkf")
    return f"{method} N={n}{extra}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ring", default=None, help="a ring.pt of mpflow.training.ring_train: add its row")
    p.add_argument("--correction", default=None, help="a registered ring correction: add ienkf N=40 + it")
    p.add_argument("--relock", default=None, help="a registered ring observer: add ienkf N=40 re-locking by it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=0, help="untimed steps of every row before the rounds")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    setting = next(s for s in SETTINGS if s.name == "spantini2019")
    model, _, obs, prior = twin(setting, 4, args.warm + (args.rounds if args.warm else 1) * args.steps, seed=0)
    rows = [*ROWS, *IENKF_ROWS, *([("ring", 40, {**ROWS[0][2], "flow": args.ring})] if args.ring else [])]
    if args.correction:
        rows += [("ienkf", 40, {"iterations": 4, "correction": args.correction}), *EQUAL_COMPUTE_ROWS]
    if args.relock:
        rows += [("ienkf", 40, {"inflation": 1.2, "iterations": 4, "relock": args.relock})]
    updaters = [(label(m, n, o), make_updater(m, o), n) for m, n, o in rows]
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in updaters}
    states = {}
    for name, u, n in updaters if args.warm else ():  # each row's state carried through the rounds from step W
        states[name] = u.init(prior, model, n, seed=[100 + b for b in range(4)])
        for m in range(args.warm):
            states[name], _ = u.update(states[name], obs[:, m], model)
    for r in range(args.rounds):
        times = {}
        start = args.warm + r * args.steps if args.warm else 0
        for name, u, n in updaters:
            state = states[name] if args.warm else u.init(prior, model, n, seed=[100 + b for b in range(4)])
            t0 = time.perf_counter()
            for m in range(start, start + args.steps):
                state, _ = u.update(state, obs[:, m], model)
            times[name] = time.perf_counter() - t0
            states[name] = state
        for name in times:
            ratios[name].append(times[name] / times[updaters[0][0]])
    out = {name: round(statistics.median(r), 3) for name, r in ratios.items()}
    print("| row | time / LETKF N = 40 (median of rounds) |\n|---|---:|")
    for name, r in out.items():
        print(f"| {name} | {r} |")
    name = (
        "ring-cost.json"
        if args.ring
        else "ienkf-correction-cost.json"
        if args.correction
        else "ienkf-relock-cost.json"
        if args.relock
        else "ienkf-cost.json"
    )
    path = report.RESULTS / name
    meta = {"rounds": args.rounds, "steps": args.steps, "ring": args.ring, "correction": args.correction}
    meta.update(relock=args.relock, warm=args.warm)
    meta.update(streams=4, threads=1)
    path.write_text(json.dumps({"meta": meta, "ratio_to_letkf40": out, "all": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
