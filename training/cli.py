"""The ``mpflow`` command line.

    mpflow info                      model families and inference methods available
    mpflow filter --family lds ...   run a method on a simulated sequence and compare it with the exact posterior

Training (``train``, ``evaluate``, ``fit-sampler``) and ``serve`` join as their issues land.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from operators import gaussian, metrics
from operators.models import FAMILIES, make_model
from operators.models.priors import prior_from_spec
from operators.references import kalman_filter
from operators.rng import generator
from operators.updaters import UPDATERS, get_updater


def _info(_: argparse.Namespace) -> int:
    out = {
        "families": [cls.describe() for cls in FAMILIES.values()],
        "methods": {
            name: {"defaults": cls.defaults, "weighted": cls.weighted} for name, cls in UPDATERS.items()
        },
    }
    print(json.dumps(out, indent=2, default=str))
    return 0


def _filter(args: argparse.Namespace) -> int:
    """Simulate ``--steps`` observations, filter them, print the error against Kalman per step."""
    d = args.dim
    params = json.loads(args.params) if args.params else {}
    if args.family == "lds":
        params.setdefault("A", (0.9 * torch.eye(d)).tolist())
        params.setdefault("B", torch.eye(d).tolist())
    model = make_model(args.family, params, d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    updater = get_updater(args.method)
    _, obs = model.simulate(args.steps, torch.ones(1, d), [generator(args.seed + 1)])
    exact = (
        kalman_filter(torch.zeros(1, d), torch.eye(d)[None], model, obs) if model.linear_gaussian else None
    )
    state = updater.init(prior, model, args.particles, args.seed)
    print(f"{'step':>4} {'ms':>8} {'log Z':>10} {'mean err (sd)':>14} {'var ratio':>10}")
    for t in range(args.steps):
        t0 = time.perf_counter()
        state, _ = updater.update(state, obs[:, t], model)
        ms = 1000 * (time.perf_counter() - t0)
        line = f"{t + 1:>4} {ms:>8.2f} {float(state.log_evidence[0]):>10.3f}"
        if exact is not None:
            m, C = gaussian.moments(state.particles.double(), state.log_weights)
            err = float(metrics.mean_error_sd(m[0], exact[0][0, t], exact[1][0, t]))
            ratio = float(metrics.variance_ratio(C[0], exact[1][0, t]).mean())
            line += f" {err:>14.3f} {ratio:>10.3f}"
        print(line)
    if exact is not None:
        print(f"log-evidence error vs Kalman: {float(state.log_evidence[0] - exact[2].sum()):+.4f} nats")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list model families and methods").set_defaults(func=_info)
    f = sub.add_parser("filter", help="filter a simulated sequence and compare with the exact posterior")
    f.add_argument("--family", default="linear_gaussian", choices=sorted(FAMILIES))
    f.add_argument("--method", default="gpf", choices=sorted(UPDATERS))
    f.add_argument("--dim", type=int, default=2)
    f.add_argument("--particles", type=int, default=256)
    f.add_argument("--steps", type=int, default=20)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--params", help="model parameters as JSON (lds defaults: A = 0.9 I, B = I)")
    f.set_defaults(func=_filter)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
