"""Plots of an evaluation report (:mod:`mpflow.training.evaluate`), written with matplotlib's Agg backend.

The plots read the report's JSON-ready dict and the evaluation's data types (:mod:`mpflow.training.eval_types`);
this module does not import :mod:`mpflow.training.evaluate` (which imports it).

* ``errors.png``               per-step mean error (posterior-sd units), variance ratio, MMD² and
                               cross-entropy, one line per (method, N), shaded ± one standard error over tasks
                               (MPF Fig. 2 / Fig. 4 left); the cross-entropy panel shows H(p_t) when known;
* ``errors_vs_particles.png``  (several N) the step-averaged metrics against N (MPF Fig. 4 right);
* ``modes.png``                (gmm) the weight of the particles nearer to the true-x mode, per step;
* ``posterior_evolution.png``  (static families with d = 2) the exact posterior density of task 0 on a grid,
                               p(x | o_1..t) ∝ π(x) Π_{s≤t} p(o_s | x), and each method's particles over its
                               contours at a few steps (MPF Fig. 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mpflow.operators.rng import generator
from mpflow.training.eval_types import MethodRun, Reference, slice_model, slice_prior
from mpflow.training.tasks import Tasks

PANELS = (
    ("mean_error_sd", "mean error (posterior sd)"),
    ("var_ratio", "variance ratio q / p"),
    ("mmd2", "MMD²"),
    ("cross_entropy", "cross-entropy H(p, q̂)"),
)
COLORS = {"mpf": "tab:red", "mpf-base": "tab:orange", "smc": "tab:blue", "gpf": "tab:green", "reference": "black"}
LINESTYLES = ("-", "--", ":", "-.")
GRID = 120


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(method: str) -> str:
    return COLORS.get(method, "tab:purple")


def _weight(method: str) -> dict[str, float]:
    """The operator's line is drawn wider, below the others, so it stays visible where they coincide."""
    return {"lw": 2.6, "zorder": 2} if method == "mpf" else {"lw": 1.3, "zorder": 3}


def _arr(values: list | None) -> list[float]:
    return [float("nan") if v is None else v for v in (values or [])]


def plot_errors(result: dict[str, Any], path: Path) -> None:
    """The four per-step metric panels (module docstring)."""
    plt = _plt()
    Ns = result["settings"]["particles"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for ax, (name, label) in zip(axes.flat, PANELS, strict=True):
        for r in result["results"]:
            curve = _arr(r["curves"].get(name))
            if not curve:
                continue
            steps = list(range(1, len(curve) + 1))
            style = LINESTYLES[Ns.index(r["particles"]) % len(LINESTYLES)]
            ax.plot(
                steps,
                curve,
                style,
                color=_color(r["method"]),
                label=f"{r['method']} N={r['particles']}",
                **_weight(r["method"]),
            )
            sem = r["curves"].get(f"{name}_sem")
            if sem:
                lo = [c - s for c, s in zip(curve, _arr(sem), strict=True)]
                hi = [c + s for c, s in zip(curve, _arr(sem), strict=True)]
                ax.fill_between(steps, lo, hi, color=_color(r["method"]), alpha=0.15, linewidth=0)
        if name == "var_ratio":
            ax.axhline(1.0, color="gray", lw=0.8)
        if name == "mmd2":
            ax.set_yscale("symlog", linthresh=1e-3)
        if name == "cross_entropy" and result["reference"].get("entropy_curve"):
            ent = _arr(result["reference"]["entropy_curve"])
            ax.plot(range(1, len(ent) + 1), ent, color="black", lw=0.8, ls=":", label="H(p) (floor)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step m")
    axes[0, 0].legend(fontsize=8)
    _suptitle(fig, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _suptitle(fig, result: dict[str, Any]) -> None:
    op, s, ref = result["operator"], result["settings"], result["reference"]
    fig.suptitle(
        f"{op['name']} ({op['content_hash'][:10]}) — {s['tasks']} held-out tasks, N = {s['particles']}, "
        f"reference: {ref['kind']}",
        fontsize=10,
    )


def plot_vs_particles(result: dict[str, Any], path: Path) -> None:
    """Step-averaged metrics against N, one line per method, error bars = SE over tasks."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    methods = list(dict.fromkeys(r["method"] for r in result["results"]))
    for ax, (name, label) in zip(axes, PANELS, strict=True):
        for m in methods:
            rows = [r for r in result["results"] if r["method"] == m and name in r["summary"]]
            if not rows:
                continue
            xs = [r["particles"] for r in rows]
            ys = [r["summary"][name]["avg"] for r in rows]
            es = [r["summary"][name]["sem"] or 0.0 for r in rows]
            ax.errorbar(xs, ys, yerr=es, marker="o", color=_color(m), label=m, capsize=3)
        ax.set_xscale("log", base=2)
        if name == "mmd2":
            ax.set_yscale("symlog", linthresh=1e-3)
        if name == "var_ratio":
            ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{label} (avg over steps)", fontsize=9)
        ax.set_xlabel("particles N")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _suptitle(fig, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_modes(result: dict[str, Any], path: Path) -> None:
    """gmm: weight nearer to the true-x mode per step (the other mode holds the rest)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ref = result["reference"].get("mode_fraction_curve")
    if ref:
        ax.plot(range(1, len(ref) + 1), [v[0] for v in ref], color="black", lw=2, label="reference")
    for r in result["results"]:
        mf = r["curves"].get("mode_fraction")
        if mf:
            ax.plot(
                range(1, len(mf) + 1),
                [v[0] for v in mf],
                color=_color(r["method"]),
                label=f"{r['method']} N={r['particles']}",
            )
    ax.axhline(0.5, color="gray", lw=0.8)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step m")
    ax.set_ylabel("weight in the true-x mode")
    ax.set_title("mode fractions (mean over tasks)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def exact_log_density_grid(tasks: Tasks, step: int, lims: tuple[float, float, float, float], n: int = GRID):
    """Unnormalised log p(x | o_1..step) of task 0 of a static 2-D family on an n × n grid over ``lims``
    (x0 min, x0 max, x1 min, x1 max) → (X0 [n, n], X1 [n, n], log density [n, n]), float64."""
    x0 = torch.linspace(lims[0], lims[1], n, dtype=torch.float64)
    x1 = torch.linspace(lims[2], lims[3], n, dtype=torch.float64)
    X0, X1 = torch.meshgrid(x0, x1, indexing="xy")
    pts = torch.stack([X0.flatten(), X1.flatten()], -1)[None]  # [1, n², 2]
    model = slice_model(tasks.model, slice(0, 1)).to(torch.float64)
    logp = slice_prior(tasks.prior, slice(0, 1)).to(torch.float64).log_prob(pts)
    obs = tasks.obs[:1].to(torch.float64)
    for s in range(step):
        logp = logp + model.log_likelihood(obs[:, s], pts)
    return X0, X1, logp[0].reshape(n, n)


def _display(x: torch.Tensor, lw: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Equal-weight particles for a scatter: weighted clouds are resampled by weight."""
    w = torch.softmax(lw.to(torch.float64), -1)
    if bool((w.max() - w.min()).abs() < 1e-12):
        return x
    return x[torch.multinomial(w, x.shape[0], replacement=True, generator=gen)]


def plot_posterior_evolution(runs: list[MethodRun], tasks: Tasks, ref: Reference, path: Path, seed: int) -> None:
    """MPF Fig. 3: rows = the exact density and each method's particles, columns = snapshot steps."""
    plt = _plt()
    runs = [r for r in runs if r.snapshots]
    steps = sorted(set.intersection(*(set(r.snapshots) for r in runs))) if runs else []
    if not steps:
        return
    gen = generator(seed)
    fig, axes = plt.subplots(
        1 + len(runs), len(steps), figsize=(2.6 * len(steps), 2.5 * (1 + len(runs))), squeeze=False
    )
    for j, s in enumerate(steps):
        pts = ref.samples[0, s - 1]
        lo, hi = pts.amin(0), pts.amax(0)
        pad = 0.25 * (hi - lo) + 1e-3
        lims = (float(lo[0] - pad[0]), float(hi[0] + pad[0]), float(lo[1] - pad[1]), float(hi[1] + pad[1]))
        X0, X1, logp = exact_log_density_grid(tasks, s, lims)
        dens = torch.exp(logp - logp.max())
        axes[0, j].contourf(X0, X1, dens, levels=12, cmap="viridis")
        axes[0, j].set_title(f"step {s}", fontsize=9)
        for i, r in enumerate(runs, start=1):
            x, lw = r.snapshots[s]
            pts_q = _display(x.to(torch.float64), lw, gen)
            ax = axes[i, j]
            ax.contour(X0, X1, dens, levels=6, colors="gray", linewidths=0.6)
            ax.scatter(pts_q[:, 0], pts_q[:, 1], s=3, color=_color(r.method), alpha=0.6)
            ax.set_xlim(lims[:2])
            ax.set_ylim(lims[2:])
        for i in range(1 + len(runs)):
            axes[i, j].tick_params(labelsize=7)
    axes[0, 0].set_ylabel("exact", fontsize=9)
    for i, r in enumerate(runs, start=1):
        axes[i, 0].set_ylabel(f"{r.method} N={r.particles}", fontsize=9)
    fig.suptitle("posterior evolution of held-out task 0 (left to right)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    result: dict[str, Any], runs: list[MethodRun], tasks: Tasks, ref: Reference, out: Path, *, seed: int
) -> list[str]:
    """Every plot that applies to this evaluation; returns the file names written in ``out``."""
    written = ["errors.png"]
    plot_errors(result, out / "errors.png")
    if len(result["settings"]["particles"]) > 1:
        plot_vs_particles(result, out / "errors_vs_particles.png")
        written.append("errors_vs_particles.png")
    if result["reference"].get("mode_fraction_curve"):
        plot_modes(result, out / "modes.png")
        written.append("modes.png")
    if not tasks.model.dynamic and tasks.prior.dim == 2:
        plot_posterior_evolution(runs, tasks, ref, out / "posterior_evolution.png", seed)
        if (out / "posterior_evolution.png").is_file():
            written.append("posterior_evolution.png")
    return written
