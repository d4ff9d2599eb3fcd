"""The real-data reference of :mod:`benchmarks.evidence`: N. Chopin's ``particles`` bootstrap filter on the
GBP/USD daily log-returns of 1997–98 under the stochastic-volatility model with Pitt & Shephard's parameters.

    x_0 ~ N(μ, σ²/(1 − φ²)),  x_t = μ + φ (x_{t−1} − μ) + σ ε_t,  o_t | x_t ~ N(0, e^{x_t}),
    μ = 2 log 0.5992, φ = 0.9702, σ = 0.178   (``particles.state_space_models.StochVol``; mpflow's
    ``stochastic_volatility`` is the same model with x the log-variance, and the stationary prior is invariant
    under the transition, so predicting before the first observation changes nothing).

Runs the bootstrap filter (N = 10⁵, ``--runs`` independent runs) and stores, per step t, log p(o_t | o_<t) (the
mean over runs and the run-to-run sd) and the filtered mean and sd of x_t, in
``benchmarks/results/evidence_reference.json``. It needs ``particles`` (which pins numpy < 2: run it from a separate
environment, ``python -m benchmarks.evidence_reference``); :mod:`benchmarks.evidence` reads the stored figures when
the package is absent.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "datasets" / "gbp_usd_daily.csv"
OUT = ROOT / "benchmarks" / "results" / "evidence_reference.json"
#: Pitt & Shephard (1999)'s parameters for these returns
PARAMS = {"mu": 2 * math.log(0.5992), "phi": 0.9702, "sigma": 0.178}


def returns() -> np.ndarray:
    """The 750 daily log-returns (%) of ``examples/datasets/gbp_usd_daily.csv``."""
    rows = DATA.read_text().splitlines()[1:]
    return np.array([float(r.split(",")[2]) for r in rows])


def run(data: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One bootstrap-filter run → (increments [T], filtered means [T], filtered sds [T])."""
    import particles
    from particles import state_space_models as ssm
    from particles.collectors import Moments

    np.random.seed(seed)
    model = ssm.StochVol(mu=PARAMS["mu"], rho=PARAMS["phi"], sigma=PARAMS["sigma"])
    fk = ssm.Bootstrap(ssm=model, data=data)
    pf = particles.SMC(fk=fk, N=n, resampling="systematic", collect=[Moments()], store_history=False)
    pf.run()
    log_lt = np.asarray(pf.summaries.logLts)
    inc = np.diff(np.concatenate([[0.0], log_lt]))
    means = np.array([m["mean"] for m in pf.summaries.moments])
    sds = np.sqrt(np.array([m["var"] for m in pf.summaries.moments]))
    return inc, means, sds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--particles", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    data = returns()
    start = time.perf_counter()
    runs = [run(data, args.particles, seed) for seed in range(args.runs)]
    inc = np.stack([r[0] for r in runs])
    means = np.stack([r[1] for r in runs]).mean(0)
    sds = np.stack([r[2] for r in runs]).mean(0)
    totals = inc.sum(1)
    import particles

    result = {
        "reference": f"particles {particles.__version__} bootstrap filter (systematic resampling)",
        "model": {"family": "stochastic_volatility", "params": PARAMS, "prior": "stationary N(mu, sigma^2/(1-phi^2))"},
        "data": str(DATA.relative_to(ROOT)),
        "particles": args.particles,
        "runs": args.runs,
        "wall_s": round(time.perf_counter() - start, 1),
        "log_evidence": float(totals.mean()),
        "log_evidence_sd": float(totals.std(ddof=1)),
        "increments": inc.mean(0).tolist(),
        "increment_sd": inc.std(0, ddof=1).tolist(),
        "filtered_mean": means.tolist(),
        "filtered_sd": sds.tolist(),
    }
    OUT.write_text(json.dumps(result) + "\n")
    worst = int(np.argmax(inc.std(0, ddof=1)))
    print(
        f"log-evidence {totals.mean():.3f} (sd {totals.std(ddof=1):.3f} over {args.runs} runs of "
        f"N = {args.particles}); "
        f"largest per-step sd {inc.std(0, ddof=1)[worst]:.4f} at t = {worst}; wrote {OUT.relative_to(ROOT)}"
    )


if __name__ == "__main__":
    main()
