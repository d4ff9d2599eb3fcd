"""Track a simulated 2-D target with mpflow's ``lds`` model and the Python client.

The target moves with (nearly) constant velocity; the state is x = (p_x, p_y, v_x, v_y) and only the position
is observed, with noise:

    x_m = A x_{m-1} + N(0, Q),   A = [[I, dt·I], [0, I]],   Q = q·[[dt³/3·I, dt²/2·I], [dt²/2·I, dt·I]]
    o_m = B x_m + N(0, R),       B = [I 0],                  R = r²·I

Run a server (``mpflow serve``) and then ``.venv/bin/python examples/track_target.py`` from the checkout (the
environment ``make setup`` made; any Python with mpflow installed will do), or let the example start one itself
(in a thread, with the embedded store in a temporary folder)::

    .venv/bin/python examples/track_target.py --serve --steps 100 --out track.png

The plot shows the true path, the observations, the posterior mean and its 95% region: on the plane
(ellipses), and against time relative to the truth (mean ± 1.96 sd, minus the true position).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import numpy as np

    from mpflow import Client
except ModuleNotFoundError as exc:  # a Python without mpflow's environment: say which one to use
    raise SystemExit(
        f"{exc}. Run the examples with the environment that `make setup` made (or any with mpflow installed): "
        f".venv/bin/python examples/{Path(sys.argv[0]).name} ..."
    ) from None


def constant_velocity(dt: float, q: float, r: float) -> dict[str, list]:
    """The ``lds`` parameters of the model in the module docstring."""
    I, Z = np.eye(2), np.zeros((2, 2))
    A = np.block([[I, dt * I], [Z, I]])
    Q = q * np.block([[dt**3 / 3 * I, dt**2 / 2 * I], [dt**2 / 2 * I, dt * I]])
    B = np.hstack([I, Z])
    return {"A": A.tolist(), "Q": Q.tolist(), "B": B.tolist(), "R": (r**2 * I).tolist()}


def simulate(params: dict[str, list], x0: np.ndarray, steps: int, rng: np.random.Generator):
    """The true states [steps, 4] and the observations [steps, 2]."""
    A, Q, B, R = (np.array(params[k]) for k in ("A", "Q", "B", "R"))
    xs, obs, x = [], [], x0
    for _ in range(steps):
        x = A @ x + rng.multivariate_normal(np.zeros(4), Q)
        xs.append(x)
        obs.append(B @ x + rng.multivariate_normal(np.zeros(2), R))
    return np.array(xs), np.array(obs)


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A server (uvicorn) in a background thread, its streams in an embedded Redis under a temporary folder."""
    import threading
    import time

    import uvicorn
    from mpflow.service.app import create_app
    from mpflow.service.settings import Settings

    with tempfile.TemporaryDirectory(prefix="mpflow-example-") as data_dir:
        app = create_app(Settings(redis_url=None, data_dir=data_dir, log_level="WARNING"))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:  # the app's start-up (store, operators) has run once uvicorn listens
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(30)


def plot(truth: np.ndarray, obs: np.ndarray, means: np.ndarray, covs: np.ndarray, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Ellipse

    t = np.arange(1, len(truth) + 1)
    fig = plt.figure(figsize=(11, 5))
    plane = fig.add_subplot(1, 2, 1)
    plane.plot(truth[:, 0], truth[:, 1], "k-", lw=1.5, label="truth")
    plane.plot(obs[:, 0], obs[:, 1], ".", color="0.6", ms=4, label="observations")
    plane.plot(means[:, 0], means[:, 1], "C0-", lw=1.2, label="posterior mean")
    radius = math.sqrt(-2 * math.log(0.05))  # 95% of a 2-D Gaussian lies within this Mahalanobis radius
    for m in range(0, len(means), max(1, len(means) // 12)):
        vals, vecs = np.linalg.eigh(covs[m, :2, :2])
        angle = math.degrees(math.atan2(vecs[1, -1], vecs[0, -1]))
        width, height = 2 * radius * np.sqrt(np.maximum(vals[::-1], 0))
        plane.add_patch(Ellipse(means[m, :2], width, height, angle=angle, fc="C0", alpha=0.15, ec="C0"))
    plane.set_aspect("equal", adjustable="datalim")
    plane.set_xlabel("x")
    plane.set_ylabel("y")
    plane.legend(fontsize=8)
    plane.set_title("path (ellipses: 95% posterior region)")
    for i, name in enumerate(("x", "y")):  # against time, in the frame of the truth (truth = 0)
        ax = fig.add_subplot(2, 2, 2 * (i + 1))
        sd = np.sqrt(np.maximum(covs[:, i, i], 0))
        err = means[:, i] - truth[:, i]
        ax.fill_between(t, err - 1.96 * sd, err + 1.96 * sd, color="C0", alpha=0.2, label="95% band")
        ax.axhline(0.0, color="k", lw=1.2, label="truth")
        ax.plot(t, obs[:, i] - truth[:, i], ".", color="0.6", ms=3, label="observed")
        ax.plot(t, err, "C0-", lw=1.0, label="posterior mean")
        ax.set_ylabel(f"{name} − true {name}")
        if i == 1:
            ax.set_xlabel("step")
        else:
            ax.legend(fontsize=7, ncol=4)
    save_figure(fig, title, out)


def save_figure(fig, title: str, out: Path) -> None:
    """Title the examples' figure, lay it out, write it to ``out`` (110 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def track(url: str, args: argparse.Namespace) -> None:
    params = constant_velocity(dt=1.0, q=args.q, r=args.r)
    prior = {"type": "gaussian", "mean": [0.0, 0.0, 0.5, 0.25], "cov": np.diag([4.0, 4.0, 0.05, 0.05]).tolist()}
    rng = np.random.default_rng(args.seed)
    x0 = rng.multivariate_normal(prior["mean"], prior["cov"])
    truth, obs = simulate(params, x0, args.steps, rng)

    with Client(url) as client:
        stream = client.create_stream(
            model={"family": "lds", "params": params},
            prior=prior,
            method=args.method,
            num_particles=args.particles,
            seed=args.seed,
        )
        means, covs = [], []
        for posterior in stream.filter(obs.tolist()):  # one request per observation, exactly once
            means.append(posterior["summary"]["mean"])
            covs.append(posterior["summary"]["cov"])
        stream.delete()
    means, covs = np.array(means), np.array(covs)

    def rmse(estimate: np.ndarray) -> float:
        return float(np.sqrt(np.mean(np.sum((estimate - truth[:, :2]) ** 2, axis=1))))

    doc = stream.document
    method = doc["method"] + (f" ({doc['operator']})" if doc["operator"] else "")
    print(f"{args.steps} steps, {method}, N={args.particles}: position RMSE {rmse(means[:, :2]):.3f} ", end="")
    print(f"(raw observations: {rmse(obs):.3f})")
    plot(truth, obs, means, covs, args.out, f"lds constant-velocity tracking, {method}, N = {args.particles}")
    print(f"wrote {args.out}")


def run_example(p: argparse.ArgumentParser, argv: list[str] | None, body) -> int:
    """Parse the example's arguments (``--url``, ``--serve`` added here) and run ``body(url, args)`` against the
    server at ``--url`` or, with ``--serve``, one started in this process (:func:`local_server`)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running mpflow server")
    p.add_argument("--serve", action="store_true", help="start a server in this process (embedded store)")
    args = p.parse_args(argv)
    with local_server() if args.serve else contextlib.nullcontext(args.url) as url:
        body(url, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Track a simulated 2-D target with mpflow (lds, Python client).")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--method", default="mpf", help="mpf, gpf, smc, kalman, ...")
    p.add_argument("--particles", type=int, default=256)
    p.add_argument("--q", type=float, default=0.01, help="acceleration noise intensity")
    p.add_argument("--r", type=float, default=2.0, help="observation noise sd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("track_target.png"))
    return run_example(p, argv, track)


if __name__ == "__main__":
    raise SystemExit(main())
