"""Track a target from position fixes that arrive at irregular times, with dropouts, and forecast it.

A constant-velocity target in continuous time — state x = (p_x, p_y, v_x, v_y), white-noise acceleration of
intensity q — is given to mpflow's ``lds`` family in its continuous form, which the service discretises exactly for
each gap between fixes:

    dx = F x dt + dW,  F = [[0, I], [0, 0]],  Cov[dW] = Qc dt,  Qc = [[0, 0], [0, q I]];
    o = B x + N(0, r² I),  B = [I 0].

Fixes arrive after exponential gaps (mean ``--gap``); some are lost (``None``: the filter predicts only), and for
some only one coordinate came through (``[x, nan]``: NaN or ``None``, the client sends either as ``null``). The
Python client sends ``(t, fix)`` pairs; afterwards
``stream.forecast`` gives the 10-step predictive. Run a server (``mpflow serve``) and then
``.venv/bin/python examples/track_irregular.py`` from the checkout (the environment ``make setup`` made), or let
it start one (``--serve``).

The plot shows each coordinate against time: the truth, the fixes, the posterior mean with its 95 % region — the
per-step 0.025 and 0.975 quantiles every answer carries — and the forecast with its band; the script prints how
often the truth fell inside the region.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from track_target import local_server, save_figure  # first: it says which Python to use where mpflow is missing

# isort: split
import numpy as np
import scipy.linalg

from mpflow import Client


def model(q: float, r: float) -> dict[str, list]:
    """The continuous-time ``lds`` parameters of the module docstring."""
    I, Z = np.eye(2), np.zeros((2, 2))
    F = np.block([[Z, I], [Z, Z]])
    Qc = np.block([[Z, Z], [Z, q * I]])
    return {"F": F.tolist(), "Qc": Qc.tolist(), "B": np.hstack([I, Z]).tolist(), "R": (r**2 * I).tolist()}


def simulate(params: dict[str, list], x0: np.ndarray, times: np.ndarray, rng: np.random.Generator):
    """The true states at ``times`` (exact: Van Loan's discretisation per gap, here with scipy directly)."""
    F, Qc = np.array(params["F"]), np.array(params["Qc"])
    xs, x, last = [], x0, 0.0
    for t in times:
        M = scipy.linalg.expm(np.block([[-F, Qc], [np.zeros_like(F), F.T]]) * (t - last))
        A = M[4:, 4:].T
        Q = A @ M[:4, 4:]
        x = A @ x + rng.multivariate_normal(np.zeros(4), 0.5 * (Q + Q.T))
        xs.append(x)
        last = t
    return np.array(xs)


def fixes(truth: np.ndarray, r: float, dropout: float, rng: np.random.Generator) -> list:
    """Noisy positions; a fix is lost (``None``) with probability ``dropout``, and half as often only x or only y
    arrives (the other NaN)."""
    out: list = []
    for x in truth:
        fix = (x[:2] + r * rng.standard_normal(2)).tolist()
        u = rng.random()
        if u < dropout:
            out.append(None)
        elif u < 1.5 * dropout:
            fix[int(rng.integers(2))] = float("nan")  # the coordinate that did not come through
            out.append(fix)
        else:
            out.append(fix)
    return out


def plot(times, truth, obs, means, region, ahead, f_means, f_sds, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for i, (ax, name) in enumerate(zip(axes, ("x", "y"), strict=True)):
        ax.plot(times, truth[:, i], "k-", lw=1.2, label="truth")
        seen = [(t, o[i]) for t, o in zip(times, obs, strict=True) if o is not None and not np.isnan(o[i])]
        ax.plot(*zip(*seen, strict=True), ".", color="0.5", ms=4, label="fixes")
        ax.plot(times, means[:, i], "C0-", lw=1.0, label="posterior mean")
        ax.fill_between(times, region[0][:, i], region[1][:, i], color="C0", alpha=0.2, label="95 % region")
        ax.plot(ahead, f_means[:, i], "C3--", lw=1.0, label="forecast")
        ax.fill_between(
            ahead, f_means[:, i] - 1.96 * f_sds[:, i], f_means[:, i] + 1.96 * f_sds[:, i], color="C3", alpha=0.15
        )
        ax.set_ylabel(name)
    axes[0].legend(fontsize=8, ncol=4)
    axes[1].set_xlabel("time")
    save_figure(fig, title, out)


def track(url: str, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    params = model(args.q, args.r)
    prior = {"type": "gaussian", "mean": [0.0, 0.0, 1.0, 0.5], "cov": np.diag([4.0, 4.0, 0.25, 0.25]).tolist()}
    times = np.cumsum(rng.exponential(args.gap, args.steps))
    truth = simulate(params, rng.multivariate_normal(prior["mean"], prior["cov"]), times, rng)
    obs = fixes(truth, args.r, args.dropout, rng)
    with Client(url) as client:
        stream = client.create_stream(
            {"family": "lds", "params": params}, prior, args.method, args.particles, args.seed
        )
        means, lo, hi = [], [], []
        for posterior in stream.filter(zip(times.tolist(), obs, strict=True)):  # (t, fix) pairs; None: lost
            means.append(posterior.mean)
            lo.append(posterior.quantiles["0.025"])  # the 95 % region: each step's 2.5 % and 97.5 % quantiles
            hi.append(posterior.quantiles["0.975"])
        forecast = stream.forecast(10, dt=args.gap)["forecast"]
        stream.delete()
    means, region = np.array(means), (np.array(lo), np.array(hi))
    ahead = times[-1] + np.array([h["t"] for h in forecast])
    f_means = np.array([h["state"]["mean"] for h in forecast])
    f_sds = np.sqrt(np.array([np.diag(h["state"]["cov"]) for h in forecast]))
    lost = sum(o is None for o in obs)
    partial = sum(o is not None and bool(np.isnan(o).any()) for o in obs)
    inside = (region[0][:, :2] <= truth[:, :2]) & (truth[:, :2] <= region[1][:, :2])
    rmse = float(np.sqrt(np.mean(np.sum((means[:, :2] - truth[:, :2]) ** 2, axis=1))))
    doc = stream.document
    method = doc["method"] + (f" ({doc['operator']})" if doc["operator"] else "")
    print(f"{args.steps} fixes ({lost} lost, {partial} partial), {method}: position RMSE {rmse:.3f}")
    print(
        f"95 % region (quantiles 0.025, 0.975): holds the true position's coordinates at {inside.mean():.0%} of steps"
    )
    plot(times, truth, obs, means, region, ahead, f_means, f_sds, args.out, f"irregular fixes with dropouts, {method}")
    print(f"wrote {args.out}")


#: the command-line options: name → (type, default, help)
OPTIONS = {
    "steps": (int, 80, "number of fixes"),
    "method": (str, "kalman", "kalman, mpf, gpf, smc, ..."),
    "particles": (int, 256, "particles (not kalman)"),
    "gap": (float, 0.5, "mean time between fixes"),
    "dropout": (float, 0.2, "probability that a fix is lost"),
    "q": (float, 0.05, "acceleration noise intensity"),
    "r": (float, 0.5, "fix noise sd"),
    "seed": (int, 0, "seed of the simulation and the stream"),
    "out": (Path, Path("track_irregular.png"), "the plot"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Track a target from irregular, lossy position fixes and forecast it.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running mpflow server")
    p.add_argument("--serve", action="store_true", help="start a server in this process (embedded store)")
    for name, (kind, default, text) in OPTIONS.items():
        p.add_argument(f"--{name}", type=kind, default=default, help=text)
    args = p.parse_args(argv)
    with local_server() if args.serve else contextlib.nullcontext(args.url) as url:
        track(url, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
