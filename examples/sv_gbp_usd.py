"""Filter 750 daily GBP/USD log-returns with a stochastic-volatility model whose μ, φ and σ are unknown.

The data: ``examples/datasets/gbp_usd_daily.csv`` (1997–1999, column ``log_return_pct`` = 100 · log-return; see its
README). The model (``stochastic_volatility``, d = 1):

    x_m = μ + φ (x_{m−1} − μ) + σ ε_m,    o_m ~ N(0, e^{x_m}),

with the priors μ ~ N(−1, 1), φ ~ U(0.5, 0.999), log σ ~ N(log 0.2, 0.7²) given in the model's ``params`` instead of
numbers: the stream then runs ``smc2`` (θ-particles, a particle filter each) and learns them online; every answer's
``summary.params`` is their posterior so far. Run a server (``mpflow serve``) and then
``python examples/sv_gbp_usd.py``, or let the example start one itself::

    python examples/sv_gbp_usd.py --serve --out sv_gbp_usd.png

The plot: the returns with the filtered 95 % band ±1.96 e^{x/2} of their distribution (at the posterior median of the
volatility, and at its 95 % credible band: the 2.5 % and 97.5 % quantiles of x per day, as every answer's
``per_step`` carries them), and the posterior of each parameter over the days (mean and 95 % credible band).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from track_target import run_example, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np

from mpflow import Client
from mpflow.client.results import StepTable

HERE = Path(__file__).resolve().parent

DATA = HERE / "datasets" / "gbp_usd_daily.csv"
PRIORS = {
    "mu": {"prior": {"type": "normal", "mean": -1.0, "sd": 1.0}},
    "phi": {"prior": {"type": "uniform", "low": 0.5, "high": 0.999}},
    "sigma": {"prior": {"type": "lognormal", "mean": -1.609, "sd": 0.7}},
}
LABELS = {"mu": "μ (mean log-variance)", "phi": "φ (persistence)", "sigma": "σ (vol. of log-variance)"}


def read_returns(path: Path) -> tuple[list[str], np.ndarray]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [r["date"] for r in rows], np.array([float(r["log_return_pct"]) for r in rows])


def plot(dates: list[str], returns: np.ndarray, table: StepTable, quantiles: np.ndarray, out: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    t = np.array(dates, dtype="datetime64[D]")
    fig = plt.figure(figsize=(11, 7))
    top = fig.add_subplot(2, 1, 1)
    top.plot(t, returns, color="0.55", lw=0.6, label="log-return (%)")
    band = 1.96 * np.exp(quantiles / 2)  # [n, 3]: the 95 % half-width at the 2.5 %, 50 %, 97.5 % quantiles of x
    top.fill_between(t, -band[:, 2], band[:, 2], color="C0", alpha=0.12, label="95 % band, 97.5 % quantile of vol.")
    top.fill_between(t, -band[:, 0], band[:, 0], color="C0", alpha=0.25, label="… at the 2.5 % quantile")
    top.plot(t, band[:, 1], "C0-", lw=1.0, label="± 1.96 · median volatility")
    top.plot(t, -band[:, 1], "C0-", lw=1.0)
    top.set_ylabel("GBP/USD daily log-return, %")
    top.legend(fontsize=7, ncol=2, loc="upper left")
    top.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m"))
    for i, name in enumerate(("mu", "phi", "sigma")):
        ax = fig.add_subplot(2, 3, 4 + i)
        p = table.params[name]
        ax.fill_between(t, p["q025"], p["q975"], color=f"C{i + 1}", alpha=0.25, label="95 % band")
        ax.plot(t, p["mean"], f"C{i + 1}-", lw=1.2, label="mean")
        ax.set_title(LABELS[name], fontsize=9)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%y-%m"))
        ax.tick_params(labelsize=7)
        if i == 0:
            ax.legend(fontsize=7)
    save_figure(fig, title, out)


def learn(url: str, args: argparse.Namespace) -> None:
    dates, returns = read_returns(DATA)
    returns = returns[: args.steps] if args.steps else returns
    dates = dates[: len(returns)]
    with Client(url) as client:
        stream = client.create_stream(
            model={"family": "stochastic_volatility", "params": PRIORS},
            prior={"type": "gaussian", "mean": [-1.0], "cov": [[1.0]]},
            num_particles=args.particles,
            seed=args.seed,
        )
        answers = list(stream.filter(returns[:, None].tolist(), batch=50))
        stream.delete()
    table = StepTable.of(answers)
    # the 2.5 %, 50 %, 97.5 % quantiles of x per day (each per_step entry's quantiles: the 95 % credible band)
    quantiles = np.stack([table.quantiles[q][:, 0] for q in ("0.025", "0.5", "0.975")], axis=1)
    last = answers[-1].params
    doc = answers[-1]
    print(f"{len(returns)} days, {doc['method']}, N = {doc['num_particles']} (θ × x):")
    for name, p in last.items():
        print(f"  {name}: mean {p['mean']:.3f}, sd {p['sd']:.3f}, 95 % interval [{p['q025']:.3f}, {p['q975']:.3f}]")
    title = f"GBP/USD 1997–1999, stochastic volatility with μ, φ, σ learned online (smc2, N = {doc['num_particles']})"
    plot(dates, returns, table, quantiles, args.out, title)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Learn a stochastic-volatility model's μ, φ, σ online on GBP/USD.")
    p.add_argument("--steps", type=int, default=0, help="the first days only (0: all 750)")
    p.add_argument("--particles", type=int, default=4096, help="θ × x particles (64 × 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("sv_gbp_usd.png"))
    return run_example(p, argv, learn)


if __name__ == "__main__":
    raise SystemExit(main())
