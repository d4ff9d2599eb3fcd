"""Lorenz-96 twin experiments at published settings: ``enkf`` against Sakov & Oke 2008, ``smc`` against Bocquet 2010.

``python -m benchmarks.lorenz96 [--quick] [--steps T] [--streams B]``

Two settings of DAPPER (``dapper/mods/Lorenz96``), both with F = 8, observations every Δ = 0.05 time units, one
RK4 step of 0.05 between them, a perfect model (no model noise):

* ``sakov2008``: d = 40, every variable observed, R = I. Published analysis RMSE of a tuned ensemble square-root
  filter at N = 40: 0.18 (Sakov & Oke 2008, Table 1; DAPPER: ``EnKF('Sqrt', N=24, infl=1.013)`` 0.18,
  ``EnKF('PertObs', N=40, infl=1.06)`` 0.22). Run: ``enkf`` (ETKF) at N = 40 over a few inflations ρ (the tuned
  number is the best of them), the perturbed-observation ``enkf`` at ρ = 1.06, and ``ukf``.
* ``bocquet2010``: d = 10, every other variable observed, R = 1.5 I (DAPPER's ``Obs['noise'] = 1.5``, a variance).
  Published bootstrap particle filter RMSE at N = 800: 0.29 (Bocquet, Pires & Wu 2010, Fig. 1; DAPPER's regularised
  ``PartFilt(N=800, NER=0.2, reg=0.8)`` 0.25). Run: ``smc`` at N = 800, resampling below ESS 0.2 N
  (``ess_threshold``) with Liu–West jitter after each resampling (``rejuvenate="always"``, over a few shrinkages a;
  the kernel's jitter sd is √(1 − a²) of the cloud's, DAPPER's ``reg`` a bandwidth of the same kind), and ``enkf``.

``mpf`` (and ``gpf``, ``svgd``, ``nvgd``, ``kalman``) cannot run Lorenz-96 — they push Gaussian moments through an
affine transition — and are reported as refused, with the refusal's message.

Each setting runs B independent twin experiments as one batch of streams (B = 4; 2 with ``--quick``): a truth spun up
for 1000 steps onto the attractor, its observations, and a prior N(x₀ + ξ, I), ξ ~ N(0, I). The analysis RMSE of a
step is √(mean_i (x̂_i − x_i)²) with x̂ the (weighted) posterior mean; a run's RMSE is its mean over the steps after
the burn-in (DAPPER's ``rmse.a``), and the table gives the mean and spread over the B streams, the published number,
and the ratio to it. Steps: T = 2000 after a burn-in of 200 (``--quick``: 400 after 100). Wall time per step is one
thread, the whole batch. Writes ``benchmarks/results/lorenz96.{json,png}`` (``lorenz96-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.rng import generator
from mpflow.operators.updaters import UPDATERS, get_updater

from benchmarks import report

SPIN_UP = 1000


@dataclass
class Setting:
    name: str
    d: int
    params: dict[str, Any]
    #: (method, N, options, published RMSE or None, where it is published)
    runs: list[tuple[str, int, dict[str, Any], float | None, str]] = field(default_factory=list)


SETTINGS = [
    Setting(
        "sakov2008",
        40,
        {"R": 1.0, "obs_every": 1},
        [
            *[("enkf", 40, {"inflation": rho}, 0.18, "Sakov & Oke 2008 Table 1") for rho in (1.005, 1.01, 1.02)],
            ("enkf", 40, {"variant": "perturbed", "inflation": 1.06}, 0.22, "DAPPER sakov2008 PertObs"),
            ("ukf", 40, {}, None, ""),
        ],
    ),
    Setting(
        "bocquet2010",
        10,
        {"R": 1.5, "obs_every": 2},
        [
            *[
                (
                    "smc",
                    800,
                    {"ess_threshold": 0.2, "rejuvenate": "always", "shrinkage": a},
                    0.29,
                    "Bocquet 2010 Fig. 1; DAPPER's regularised PartFilt: 0.25",
                )
                for a in (0.8, 0.85, 0.9)
            ],
            ("enkf", 10, {"inflation": 1.04}, None, ""),
        ],
    ),
]
#: the methods that refuse a nonlinear transition, reported with their message
REFUSED = ("mpf", "gpf", "kalman")


def twin(setting: Setting, streams: int, steps: int, seed: int) -> tuple[ModelFamily, torch.Tensor, torch.Tensor, Any]:
    """(model of B streams, truths [B, T, d], observations [B, T, k], prior): B twin experiments."""
    one = make_model("lorenz96", setting.params, setting.d, torch.float64)
    model = type(one).stack([one] * streams)
    gens = [generator(seed + b) for b in range(streams)]
    x = 8.0 + torch.stack([torch.randn(setting.d, generator=g, dtype=torch.float64) for g in gens])
    for _ in range(SPIN_UP):
        x = model.transition_mean(x[:, None])[:, 0]
    xs, obs = model.simulate(steps, x, gens)
    shift = torch.stack([torch.randn(setting.d, generator=g, dtype=torch.float64) for g in gens])
    prior = GaussianMixture.gaussian(x + shift, torch.eye(setting.d, dtype=torch.float64).expand(streams, -1, -1))
    return model.to(torch.float32), xs, obs.to(torch.float32), prior


def filter_rmse(method: str, n: int, options: dict[str, Any], model, xs, obs, prior, burn_in: int) -> dict[str, Any]:
    """Run the method over every step: per-stream mean analysis RMSE after ``burn_in``, the RMSE curve (mean over
    streams) and the wall time per step."""
    u = get_updater(method, **options)
    B, T, _ = xs.shape
    state = u.init(prior, model, n, seed=[100 + b for b in range(B)])
    curve = []
    t0 = time.perf_counter()
    for m in range(T):
        state, _ = u.update(state, obs[:, m], model)
        w = torch.softmax(state.log_weights.double(), -1)
        mean = (w[..., None] * state.particles.double()).sum(1)
        curve.append((mean - xs[:, m]).pow(2).mean(-1).sqrt())
    ms = 1000 * (time.perf_counter() - t0) / T
    rmse = torch.stack(curve, 1)  # [B, T]
    per_stream = rmse[:, burn_in:].mean(1)
    return {
        "rmse": float(per_stream.mean()),
        "rmse_sd_over_streams": float(per_stream.std()) if B > 1 else 0.0,
        "ms_per_step": round(ms, 2),
        "curve": [round(float(v), 4) for v in rmse.mean(0)],
    }


def run_setting(setting: Setting, streams: int, steps: int, burn_in: int) -> dict[str, Any]:
    model, xs, obs, prior = twin(setting, streams, steps + burn_in, seed=0)
    rows = []
    for method, n, options, published, source in setting.runs:
        out = filter_rmse(method, n, options, model, xs, obs, prior, burn_in)
        ratio = out["rmse"] / published if published else None
        rows.append(
            {
                "method": method,
                "N": n,
                "options": options,
                "published": published,
                "source": source,
                "ratio_to_published": ratio,
                **out,
            }
        )
        print(f"  {setting.name} {method} N={n} {options}: RMSE {out['rmse']:.3f} ({out['ms_per_step']} ms/step)")
    refused = {method: UPDATERS[method].refusal(type(model)) for method in REFUSED}
    return {"setting": setting.name, "d": setting.d, "params": setting.params, "rows": rows, "refused": refused}


def table(results: list[dict[str, Any]]) -> str:
    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "—" if v is None else format(v, spec)

    body = []
    for r in results:
        for row in r["rows"]:
            opts = ", ".join(f"{k}={v}" for k, v in row["options"].items()) or "defaults"
            body.append(
                [
                    r["setting"],
                    row["method"],
                    row["N"],
                    opts,
                    f"{row['rmse']:.3f} ± {row['rmse_sd_over_streams']:.3f}",
                    fmt(row["published"], ".2f") + (f" ({row['source']})" if row["source"] else ""),
                    fmt(row["ratio_to_published"], ".2f"),
                    row["ms_per_step"],
                ]
            )
        for method in r["refused"]:
            body.append(
                [r["setting"], method, "—", "refused (nonlinear transition; message in the JSON)", "—", "—", "—", "—"]
            )
    header = ["setting", "method", "N", "options", "analysis RMSE", "published", "ratio", "ms/step"]
    return report.markdown_table(header, body, "llrllrrr")


def plot(results: list[dict[str, Any]], burn_in: int, path) -> None:
    with report.figure(path, 1, len(results), figsize=(6 * len(results), 4)) as (_, axes):
        for ax, r in zip(axes, results, strict=True):
            for row in r["rows"]:
                opts = ",".join(f"{k}={v}" for k, v in row["options"].items() if k != "rejuvenate")
                ax.plot(row["curve"], lw=0.8, label=f"{row['method']} N={row['N']} {opts}: {row['rmse']:.3f}")
            published = next((row["published"] for row in r["rows"] if row["published"]), None)
            if published:
                ax.axhline(published, color="k", ls="--", lw=1, label=f"published {published}")
            ax.axvline(burn_in, color="grey", ls=":", lw=1)
            ax.set(
                title=f"Lorenz-96 {r['setting']} (d = {r['d']})", xlabel="step", ylabel="analysis RMSE", yscale="log"
            )
            ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    p = report.parser("lorenz96", __doc__, "400 steps after a burn-in of 100, 2 streams")
    p.add_argument("--steps", type=int, default=None, help="steps after the burn-in (2000; 400 with --quick)")
    p.add_argument("--streams", type=int, default=None, help="twin experiments per setting (4; 2 with --quick)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (400 if args.quick else 2000)
    burn_in = 100 if args.quick else 200
    streams = args.streams or (2 if args.quick else 4)
    load = os.getloadavg()
    t0 = time.perf_counter()
    results = [run_setting(s, streams, steps, burn_in) for s in SETTINGS]
    print(table(results))
    meta = {
        "benchmark": "lorenz96",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "threads": 1,
        "streams": streams,
        "steps": steps,
        "burn_in": burn_in,
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t0, 1),
        **report.machine_meta(load),
    }
    report.write_outputs(
        {"meta": meta, "results": results},
        report.out_stem(args, "lorenz96"),
        lambda path: plot(results, burn_in, path),
        indent=1,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
