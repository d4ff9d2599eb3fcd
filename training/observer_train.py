"""Train a :class:`~mpflow.operators.mpf.ring_observer.RingObserver` (what ``ienkf``'s ``relock`` re-seeds from) by
the per-site CRPS on simulated Lorenz-96 trajectories, and register it:
``python -m mpflow.training.observer_train --out DIR [--minutes M] [--register ROOT --name lorenz96-d40-vK]``.

The task distribution is :mod:`mpflow.training.ring_train`'s — per twin F ~ U[7, 9], Δ log-uniform on [0.05, 0.5]
(RK4 steps of at most 0.05), R log-uniform on [0.25, 2.5], ``obs_every`` ∈ {1, 2, 4} (one pool of ``batch`` twins per
stride, visited in turn). A pool is a set of running truths with the window of their last K observations on the ring;
an iteration advances one pool by one Δ (the truth: no model noise; the observation: the truth at the observed sites
+ N(0, R)), and once the window is full takes an Adam step on

    loss = mean over twins and sites of CRPS(N(μ_i, σ_i²), x_i)

(:func:`~mpflow.operators.mpf.ring_observer.gaussian_crps`)

with the learning rate decaying from ``lr`` to lr / 10 (cosine in the elapsed share of ``minutes``). A pool draws new
regimes (new truths spun up onto the attractor) every ``max_age`` cycles. There is no filter in the loop: the
observer sees observations only, so its training data are as cheap as the model's integration.

Validation every ``val_every`` iterations on fixed pools of the two published regimes (benchmarks.lorenz96:
spantini2019 Δ = 0.4, every second site, R = 0.5; sakov2008 Δ = 0.05, every site, R = 1; F = 8), ``val_twins`` twins ×
``val_windows`` consecutive windows each: the CRPS, the RMSE of μ and the RMS of σ (a calibrated observer's σ is
close to its RMSE). θ is kept at the best spantini2019 CRPS (the regime whose lost twins the re-lock serves).

Writes ``DIR/observer.pt`` (config, θ, training options, best validation), ``DIR/observer_log.jsonl`` (one line per
validation) and ``DIR/observer_curve.png``; with ``--register ROOT --name NAME`` the registry folder ``ROOT/NAME``
(``architecture.kind`` ``ring_observer``, ``auto_select`` false: a stream names it as ``ienkf``'s ``relock``), whose
README is ``--readme`` or one naming this command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import registry
from mpflow.operators.models.lorenz96 import Lorenz96
from mpflow.operators.mpf.ring_observer import ARCHITECTURE_KIND, RingObserver, gaussian_crps
from mpflow.training import registered_run, ring_train
from mpflow.training.task_distribution import stack_params

#: the validation regimes (benchmarks.lorenz96's published settings)
VALIDATION = ring_train.VALIDATION


@dataclass
class Pool:
    """Running truths [B, d] of one stride with the window [B, K, d] of their last K observations on the ring."""

    model: Lorenz96
    truth: torch.Tensor
    window: torch.Tensor
    age: int = 0

    def advance(self, gen: torch.Generator) -> None:
        """One Δ: the truth forward, a new observation into the window (the oldest out)."""
        self.truth = self.model.transition_mean(self.truth[:, None])[:, 0]
        seen = self.model.observation_draws(self.truth[:, None], gen)[:, 0]
        self.window = torch.cat([self.window[:, 1:], self.model.on_sites(seen)[:, None]], 1)
        self.age += 1

    def regime(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Δ, R, F) [B] of the pool's twins."""
        p = self.model.params
        return tuple(p[k].reshape(-1).to(torch.float64) for k in ("delta", "R", "F"))


def new_pool(params: list[dict[str, Any]], d: int, K: int, gen: torch.Generator) -> Pool:
    """Twins of ``params`` spun up onto the attractor, their window filled by K observations."""
    model = stack_params(Lorenz96, params, d, torch.float64)
    window = torch.full((len(params), K, d), math.nan, dtype=torch.float64)
    pool = Pool(model, ring_train.spun_up(model, gen, "cpu"), window)
    for _ in range(K):
        pool.advance(gen)
    return pool


def validation_pools(d: int, K: int, twins: int, windows: int, seed: int) -> dict[str, list[tuple]]:
    """Per validation regime, ``windows`` consecutive (window, truth, regime) of ``twins`` twins (fixed: a seed of
    its own)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in VALIDATION.items():
        pool = new_pool([{**p, "rk4_step": ring_train.RK4_STEP}] * twins, d, K, gen)
        rows = []
        for _ in range(windows):
            pool.advance(gen)
            rows.append((pool.window.clone(), pool.truth.clone(), pool.regime()))
        out[name] = rows
    return out


@torch.no_grad()
def validate(net: RingObserver, pools: dict[str, list[tuple]]) -> dict[str, float]:
    """Per regime: mean CRPS, RMSE of μ, RMS of σ."""
    out = {}
    for name, rows in pools.items():
        crps = err = var = 0.0
        for window, truth, (delta, R, F) in rows:
            mean, sd = net(window, delta, R, F)
            mean, sd = mean.double(), sd.double()
            crps += float(gaussian_crps(mean, sd, truth).mean())
            err += float((mean - truth).pow(2).mean())
            var += float(sd.pow(2).mean())
        n = len(rows)
        out.update({f"{name}_crps": crps / n, f"{name}_rmse": math.sqrt(err / n), f"{name}_sd": math.sqrt(var / n)})
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The loop of the module docstring → the training summary (also in ``observer.pt``)."""
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    K, d = args.history, args.dim
    net = RingObserver(history=K, hidden=args.hidden, layers=args.layers, kernel=args.kernel)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    pools = [new_pool(ring_train.regime_params(gen, args.batch, s), d, K, gen) for s in ring_train.STRIDES]
    val = validation_pools(d, K, args.val_twins, args.val_windows, args.seed + 10_000)
    log_path = out / "observer_log.jsonl"
    log_path.write_text("", encoding="utf-8")
    history: list[dict[str, Any]] = []
    best, best_it = math.inf, 0
    start, it, losses = time.perf_counter(), 0, []
    bar = tqdm(total=int(args.minutes * 60), desc="observer_train", unit="s", file=sys.stderr, disable=args.quiet)
    while True:
        elapsed = time.perf_counter() - start
        if it % args.val_every == 0 or elapsed >= args.minutes * 60 or it >= args.iterations:
            row = {"iteration": it, "seconds": round(elapsed, 1), **validate(net, val)}
            row["train_crps"] = sum(losses) / len(losses) if losses else None
            losses = []
            history.append(row)
            with log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            if row["spantini2019_crps"] < best:
                best, best_it = row["spantini2019_crps"], it
                save(out / "observer.pt", net, args, best, best_it)
            bar.set_postfix(spantini=f"{row['spantini2019_rmse']:.3f}", sakov=f"{row['sakov2008_rmse']:.3f}")
            if elapsed >= args.minutes * 60 or it >= args.iterations:
                break
        for g in opt.param_groups:
            g["lr"] = args.lr * (0.55 + 0.45 * math.cos(math.pi * min(elapsed / (args.minutes * 60), 1.0)))
        k = it % len(pools)
        pool = pools[k]
        if pool.age >= args.max_age:
            pool = pools[k] = new_pool(ring_train.regime_params(gen, args.batch, ring_train.STRIDES[k]), d, K, gen)
        pool.advance(gen)
        mean, sd = net(pool.window, *pool.regime())
        loss = gaussian_crps(mean, sd, pool.truth.to(mean.dtype)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        it += 1
        bar.update(int(time.perf_counter() - start) - bar.n)
    bar.close()
    plot(history, out / "observer_curve.png")
    return {"iterations": it, "best_iteration": best_it, "best_spantini_crps": best, "last": history[-1]}


def save(path: Path, net: RingObserver, args: argparse.Namespace, best: float, best_it: int) -> None:
    torch.save(
        {
            "config": net.config,
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "training": {**vars(args), "best_spantini_crps": best, "best_iteration": best_it},
        },
        path,
    )


def plot(history: list[dict[str, Any]], path: Path) -> None:
    """The validation RMSE of μ and RMS of σ per regime against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, name in zip(axes, VALIDATION, strict=True):
        ax.plot(its, [h[f"{name}_rmse"] for h in history], label="RMSE of μ")
        ax.plot(its, [h[f"{name}_sd"] for h in history], "--", label="RMS of σ")
        ax.set_title(f"{name} validation")
        ax.set_xlabel("iteration")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(observer_pt: str | Path, root: str | Path, name: str, readme: str | None = None):
    """Write the registry folder ``root/name`` of a trained ``observer.pt`` → its record; its ``metrics.json`` holds
    the kept θ's validation (from ``observer_log.jsonl`` beside the file, when there)."""
    payload = torch.load(observer_pt, map_location="cpu", weights_only=True)
    training = payload["training"]
    config = {
        "family": "lorenz96",
        "state_dim": int(training["dim"]),
        "obs_dim": int(training["dim"]) // 2,
        "architecture": {"kind": ARCHITECTURE_KIND, **payload["config"]},
        "auto_select": False,
        "auto_select_note": "an observer for ienkf's relock: a stream names it as method_options.relock",
        "domain": ring_train.task_domain(),
        "training": {k: v for k, v in training.items() if isinstance(v, int | float | str | bool) or v is None},
    }
    if readme is None:
        readme = f"# {name}\n\nTrained by `python -m mpflow.training.observer_train` with {json.dumps(training)}.\n"
    state = {k: v.to(torch.float32).contiguous() for k, v in payload["state"].items()}
    metrics: dict[str, Any] = {"best_spantini_crps": training["best_spantini_crps"]}
    log = Path(observer_pt).with_name("observer_log.jsonl")
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []
    kept = [r for r in rows if r["iteration"] == training["best_iteration"]]
    if kept:  # the kept θ's validation figures (what ``mpflow info`` shows)
        metrics["validation"] = {k: v for k, v in kept[-1].items() if k.startswith(tuple(VALIDATION))}
    return registry.save_operator(root, name, config, state, metrics, readme, overwrite=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for observer.pt, the log and the curve")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget")
    p.add_argument("--iterations", type=int, default=10**9, help="stop after this many iterations")
    p.add_argument("--dim", type=int, default=40, help="ring size d the twins run at")
    p.add_argument("--history", type=int, default=4, help="K: observations the observer reads")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--kernel", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="twins per pool (one pool per obs_every)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-age", type=int, default=100, help="cycles before a pool draws new regimes")
    p.add_argument("--val-every", type=int, default=500)
    p.add_argument("--val-twins", type=int, default=128)
    p.add_argument("--val-windows", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    registered_run.add_register_arguments(p, "lorenz96-d<d>-v<k>")
    return p


def main(argv: list[str] | None = None) -> int:
    return registered_run.main(parser, train, register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
