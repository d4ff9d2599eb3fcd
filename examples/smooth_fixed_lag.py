"""Fixed-lag smoothing: revise the estimate of each step with the readings that came after it.

A target moves along a line at a drifting velocity — state x = (position, velocity), mpflow's ``lds`` family:

    x_m = A x_{m−1} + N(0, Q),  A = [[1, 1], [0, 1]],  Q = diag(q²/4, q²);    o_m = position_m + N(0, r²).

The filter's answer at step m uses the readings up to m; a stream created with ``smoothing_lag`` = L also keeps
what its smoother needs of its last L steps, and ``GET /v1/streams/{id}/smoothed`` (the client's
``stream.smoothed()``, a ``Smoothed``: ``.steps``, ``.means``, ``.covs``, ``.std``) answers p(x_s | o_1..t) for
s = t − L + 1 … t. Here each reading is sent as it comes and, once L have come, the oldest step of the window —
L − 1 readings behind the newest — is read: the fixed-lag smoothed estimate, to compare with the filtered one.
Run a server (``mpflow serve``) and then ``.venv/bin/python examples/smooth_fixed_lag.py`` from the checkout, or
let it start one (``--serve``)::

    python examples/smooth_fixed_lag.py --serve --out smooth_fixed_lag.png

The plot: position and velocity against the step — the truth, the readings, the filtered and the smoothed mean
with their 95 % bands — and the two posterior sds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from track_target import run_example, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np

from mpflow import Client

NAMES = ("position", "velocity")


def simulate(args: argparse.Namespace) -> tuple[dict[str, list], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(args.seed)
    A = np.array([[1.0, 1.0], [0.0, 1.0]])
    Q = np.diag([args.q**2 / 4, args.q**2])
    params = {"A": A.tolist(), "B": [[1.0, 0.0]], "Q": Q.tolist(), "R": [[args.r**2]]}
    x, truth = np.array([0.0, 0.5]), []
    for _ in range(args.steps):
        x = A @ x + rng.multivariate_normal(np.zeros(2), Q)
        truth.append(x)
    truth = np.array(truth)
    return params, truth, truth[:, 0] + args.r * rng.standard_normal(args.steps)


def plot(truth, readings, filtered, smoothed, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(truth) + 1)
    (f_mean, f_sd), (s_steps, s_mean, s_sd) = filtered, smoothed
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for i, ax in enumerate(axes[:2]):
        ax.plot(steps, truth[:, i], "k-", lw=1.0, label="truth")
        if i == 0:
            ax.plot(steps, readings, ".", color="0.5", ms=3, label="readings")
        ax.plot(steps, f_mean[:, i], "C0-", lw=0.9, label="filtered")
        ax.fill_between(
            steps, f_mean[:, i] - 1.96 * f_sd[:, i], f_mean[:, i] + 1.96 * f_sd[:, i], color="C0", alpha=0.15
        )
        ax.plot(s_steps, s_mean[:, i], "C3-", lw=0.9, label="smoothed")
        ax.fill_between(
            s_steps, s_mean[:, i] - 1.96 * s_sd[:, i], s_mean[:, i] + 1.96 * s_sd[:, i], color="C3", alpha=0.15
        )
        ax.set_ylabel(NAMES[i])
    axes[0].legend(fontsize=8, ncol=4)
    for i, style in enumerate(("-", "--")):
        axes[2].plot(steps, f_sd[:, i], "C0" + style, lw=1.0, label=f"filtered sd, {NAMES[i]}")
        axes[2].plot(s_steps, s_sd[:, i], "C3" + style, lw=1.0, label=f"smoothed sd, {NAMES[i]}")
    axes[2].set_ylabel("posterior sd")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8, ncol=2)
    save_figure(fig, title, out)


def smooth(url: str, args: argparse.Namespace) -> None:
    params, truth, readings = simulate(args)
    prior = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
    f_mean, f_sd, s_steps, s_mean, s_sd = [], [], [], [], []
    with Client(url) as client:
        stream = client.create_stream(
            {"family": "lds", "params": params},
            prior,
            args.method,
            args.particles,
            args.seed,
            smoothing_lag=args.lag,
            state_names=list(NAMES),
        )
        for answer in stream.filter([[o] for o in readings.tolist()]):  # one reading per request, as they come
            f_mean.append(answer.mean)
            f_sd.append(answer.std)
            if answer["step"] >= args.lag:
                window = stream.smoothed()  # the last L steps given every reading so far, oldest first
                s_steps.append(window.steps[0])
                s_mean.append(window.means[0])
                s_sd.append(window.std[0])
        method = stream.document["method"]
        stream.delete()
    f_mean, f_sd = np.array(f_mean), np.array(f_sd)
    s_steps, s_mean, s_sd = np.array(s_steps), np.array(s_mean), np.array(s_sd)
    lagged = s_steps - 1  # the smoothed steps' indices into the filtered arrays
    print(f"{args.steps} readings, {method}, smoothing_lag {args.lag} (each step smoothed with {args.lag - 1} more):")
    print("                 filtered: RMSE  mean sd     smoothed: RMSE  mean sd")
    for i, name in enumerate(NAMES):
        f_rmse = np.sqrt(np.mean((f_mean[lagged, i] - truth[lagged, i]) ** 2))
        s_rmse = np.sqrt(np.mean((s_mean[:, i] - truth[lagged, i]) ** 2))
        print(
            f"  {name:9s}          {f_rmse:10.3f} {f_sd[lagged, i].mean():8.3f}"
            f"               {s_rmse:6.3f} {s_sd[:, i].mean():8.3f}"
        )
    below = np.mean(np.all(s_sd < f_sd[lagged], axis=1))
    print(f"smoothed sd below the filtered sd at {below:.0%} of the {len(s_steps)} lagged steps")
    title = f"fixed-lag smoothing (L = {args.lag}) of a drifting target, {method}"
    plot(truth, readings, (f_mean, f_sd), (s_steps, s_mean, s_sd), args.out, title)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Compare the fixed-lag smoothed estimates of a stream with its filtered ones."
    )
    p.add_argument("--steps", type=int, default=120, help="number of readings")
    p.add_argument("--lag", type=int, default=10, help="the stream's smoothing_lag L")
    p.add_argument("--method", default="kalman", help="kalman, smc, enkf, ...")
    p.add_argument("--particles", type=int, default=None, help="particles (not kalman): the service's choice")
    p.add_argument("--q", type=float, default=0.05, help="the velocity's step sd")
    p.add_argument("--r", type=float, default=1.0, help="the readings' noise sd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("smooth_fixed_lag.png"))
    return run_example(p, argv, smooth)


if __name__ == "__main__":
    raise SystemExit(main())
