"""Learn a sensor's unknown noise variance R online, with the state, from simulated readings whose R is known.

The model: a persistent level read by a noisy sensor, mpflow's ``lds`` family with d = 1,

    x_m = a x_{m−1} + N(0, Q),    o_m = x_m + N(0, R),

with a and Q given as numbers and R unknown: its ``params`` entry is a prior instead of a value,

    "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}     (log R ~ N(0, 1)),

so the stream runs ``smc2`` (parameter particles, each with its own filter) and every answer's ``summary.params``
is the posterior of R given the readings so far (``mean``, ``sd``, ``q025`` … ``q975``); with
``per_step_params=True`` each ``per_step`` entry carries it too, and ``StepTable.of(answers).params["R"]`` gathers
it as arrays. The readings are simulated with R = ``--true-r``, so the answer can be checked. Run a server
(``mpflow serve``) and then ``.venv/bin/python examples/learn_noise.py`` from the checkout, or let it start one
(``--serve``)::

    python examples/learn_noise.py --serve --out learn_noise.png

The plot: the readings with the filtered level and its 95 % band, and the posterior of R over the steps (mean and
95 % credible band) against the true R.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from track_target import run_example, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np

from mpflow import Client
from mpflow.client.results import StepTable

R_PRIOR = {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}


def simulate(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(args.seed)
    x, level = 0.0, []
    for _ in range(args.steps):
        x = args.a * x + np.sqrt(args.q) * rng.standard_normal()
        level.append(x)
    level = np.array(level)
    return level, level + np.sqrt(args.true_r) * rng.standard_normal(args.steps)


def plot(level, readings, table: StepTable, true_r: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(readings) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(steps, level, "k-", lw=1.0, label="true level")
    top.plot(steps, readings, ".", color="0.5", ms=3, label="readings")
    top.plot(steps, table.mean[:, 0], "C0-", lw=1.0, label="filtered level")
    top.fill_between(
        steps, table.quantiles["0.025"][:, 0], table.quantiles["0.975"][:, 0], color="C0", alpha=0.2, label="95 %"
    )
    top.legend(fontsize=8, ncol=4)
    top.set_ylabel("level")
    r = table.params["R"]
    bottom.fill_between(steps, r["q025"], r["q975"], color="C1", alpha=0.25, label="95 % credible band")
    bottom.plot(steps, r["mean"], "C1-", lw=1.2, label="posterior mean of R")
    bottom.axhline(true_r, color="k", ls="--", lw=0.8, label="true R")
    bottom.set_yscale("log")
    bottom.set_ylabel("R")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    save_figure(fig, title, out)


def learn(url: str, args: argparse.Namespace) -> None:
    level, readings = simulate(args)
    model = {"family": "lds", "params": {"A": [[args.a]], "B": [[1.0]], "Q": [[args.q]], "R": R_PRIOR}}
    prior = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}
    with Client(url) as client:
        stream = client.create_stream(model, prior, num_particles=args.particles, seed=args.seed)
        answers = list(stream.filter(readings[:, None].tolist(), batch=50, per_step_params=True))
        stream.delete()
    table = StepTable.of(answers)
    doc = answers[-1]
    print(f"{args.steps} readings, {doc['method']}, N = {doc['num_particles']}, true R = {args.true_r:g}:")
    print("  step   R: mean      sd   95 % interval")
    r = table.params["R"]
    for i in sorted({9, 49, len(readings) // 2 - 1, len(readings) - 1} & set(range(len(readings)))):
        print(f"  {i + 1:4d}   {r['mean'][i]:8.3f} {r['sd'][i]:7.3f}   [{r['q025'][i]:.3f}, {r['q975'][i]:.3f}]")
    last = doc.params["R"]
    z = (last["mean"] - args.true_r) / last["sd"]
    print(f"R: posterior mean {last['mean']:.3f}, sd {last['sd']:.3f}: {z:+.2f} posterior sd from the true R")
    title = f"R learned online (lognormal prior, {doc['method']}, N = {doc['num_particles']}), true R = {args.true_r:g}"
    plot(level, readings, table, args.true_r, args.out, title)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Learn a linear model's unknown noise variance R online (smc2).")
    p.add_argument("--steps", type=int, default=300, help="number of readings")
    p.add_argument("--true-r", type=float, default=0.5, help="the noise variance the readings are simulated with")
    p.add_argument("--a", type=float, default=0.95, help="the level's persistence")
    p.add_argument("--q", type=float, default=0.1, help="the level's step variance")
    p.add_argument("--particles", type=int, default=None, help="particles: the service's choice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("learn_noise.png"))
    return run_example(p, argv, learn)


if __name__ == "__main__":
    raise SystemExit(main())
