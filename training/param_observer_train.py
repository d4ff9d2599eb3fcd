"""Train a parameter observer (:class:`~mpflow.operators.param_observer.ParamObserver`: what ``smc2``'s ``mh`` kernel
proposes from) by the logarithmic score on trajectories simulated from a family's task domain, and register it:
``python -m mpflow.training.param_observer_train --family lds --out DIR [--minutes M]
[--register ROOT --name lds-d1-vK]``.

Data. A pool of ``pool`` tasks from the family's :meth:`~mpflow.operators.models.base.ModelFamily.observer_tasks`
(θ over its broad task domain, never a benchmark's values), each simulated
:data:`~mpflow.operators.param_observer.MAX_WINDOW` steps with the family's own transition and observation draws;
each task is read through a window of its last W observations, W log-uniform on [MIN_WINDOW, MAX_WINDOW], a tenth
of the windows with 10 % of their steps unobserved (the features of
:func:`~mpflow.operators.param_observer.window_features`). Every ``refresh`` iterations a quarter of the pool is
replaced by new tasks, so the network sees ``pool`` × (1 + iterations / (4 refresh)) tasks in all.

Loss: the mean over a batch of −log N(v_true; μ, L Lᵀ) (eq. O1), Adam with a cosine decay of the learning rate from
``lr`` to lr / 20 over ``minutes``. Validation every ``val_every`` iterations on ``val`` held-out tasks: the loss,
each coordinate's RMSE of μ against the truth, the RMS of its sd, and the coverage of its central 90 % interval
(a calibrated observer: RMSE ≈ RMS sd, coverage ≈ 0.90). θ is kept at the best validation loss.

Writes ``DIR/observer.pt``, ``DIR/observer_log.jsonl`` (one line per validation) and ``DIR/observer_curve.png``
(the learning curve); ``--register ROOT --name NAME`` the registry folder (``architecture.kind`` ``param_observer``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import registry
from mpflow.operators.models import FAMILIES
from mpflow.operators.param_observer import (
    ARCHITECTURE_KIND,
    MAX_WINDOW,
    MIN_WINDOW,
    ParamObserver,
    to_v,
    window_features,
)
from mpflow.training import registered_run
from tqdm import tqdm

#: the share of windows with unobserved steps, and the share of their steps unobserved
GAPPY_WINDOWS, GAP_RATE = 0.1, 0.1


def simulate_windows(family: str, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """n tasks of ``family`` simulated MAX_WINDOW steps and seen through random windows: features [n, F], context
    [n, c], log-variance [n] and the true v [n, p] (module docstring)."""
    cls = FAMILIES[family]
    model, values, x = cls.observer_tasks(n, gen)
    x = x[:, None]  # [n, 1, d]: a task a stream of one particle
    ys = []
    for _ in range(MAX_WINDOW):
        z = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        x = model.transition_from_noise(x, z)
        ys.append(model.observation_draws(x, gen)[:, 0, 0])
    y = torch.stack(ys, -1)
    W = torch.exp(
        math.log(MIN_WINDOW) + torch.rand(n, generator=gen, dtype=torch.float64) * math.log(MAX_WINDOW / MIN_WINDOW)
    )
    mask = torch.arange(MAX_WINDOW, dtype=torch.float64)[None] >= (MAX_WINDOW - W.floor())[:, None]
    gappy = torch.rand(n, 1, generator=gen) < GAPPY_WINDOWS
    mask &= ~(gappy & (torch.rand(n, MAX_WINDOW, generator=gen) < GAP_RATE))
    feats, log_var = window_features(y, mask)
    v = torch.stack([to_v(values[name], kind) for name, kind, _ in cls.observer_params], -1)
    context = model.observer_context()
    return {"features": feats, "context": context, "log_var": log_var, "v": v}


def nll(net: ParamObserver, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean logarithmic score −log N(v; μ, L Lᵀ) of a batch (module docstring)."""
    mean, L = net(batch["features"], batch["context"], batch["log_var"])
    dist = torch.distributions.MultivariateNormal(mean, scale_tril=L)
    return -dist.log_prob(batch["v"]).mean()


def validate(net: ParamObserver, val: dict[str, torch.Tensor], names: list[str]) -> dict[str, float]:
    with torch.no_grad():
        mean, L = net(val["features"], val["context"], val["log_var"])
        loss = float(-torch.distributions.MultivariateNormal(mean, scale_tril=L).log_prob(val["v"]).mean())
    sd = (L * L).sum(-1).sqrt()
    err = mean - val["v"]
    out = {"loss": loss}
    for i, name in enumerate(names):
        out[f"{name}_rmse"] = float(err[:, i].pow(2).mean().sqrt())
        out[f"{name}_sd"] = float(sd[:, i].pow(2).mean().sqrt())
        out[f"{name}_coverage90"] = float((err[:, i].abs() <= 1.6449 * sd[:, i]).double().mean())
    return out


def _take(data: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in data.items()}


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cls = FAMILIES[args.family]
    names = [name for name, _, _ in cls.observer_params]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    val = simulate_windows(args.family, args.val, torch.Generator().manual_seed(10**6 + args.seed))
    pool = {k: torch.cat(parts) for k, parts in _chunks(args.family, args.pool, gen).items()}
    net = ParamObserver(len(names), pool["context"].shape[1], [s for _, _, s in cls.observer_params], args.hidden,
                        args.layers)  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    start, it, history = time.perf_counter(), 0, []
    kept = {"loss": math.inf, "iteration": 0}
    log = (out / "observer_log.jsonl").open("w", encoding="utf-8")

    def checkpoint(elapsed: float) -> None:
        """Validate, log, and keep θ when it is the best so far."""
        row = {"iteration": it, "seconds": round(elapsed, 1), **validate(net, val, names)}
        history.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if row["loss"] < kept["loss"]:
            kept.update(loss=row["loss"], iteration=it)
            save(out / "observer.pt", net, args, row["loss"], it)

    bar = tqdm(total=int(args.minutes * 60), unit="s", disable=args.quiet, desc=f"observer {args.family}")
    while it < args.iterations and (elapsed := time.perf_counter() - start) < args.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = args.lr * (
                0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / (args.minutes * 60))))
            )
        if it and it % args.refresh == 0:
            fresh = simulate_windows(args.family, args.pool // 4, gen)
            slots = torch.randperm(args.pool, generator=gen)[: args.pool // 4]
            for k in pool:
                pool[k][slots] = fresh[k]
        if it % args.val_every == 0:
            checkpoint(elapsed)
        loss = nll(net, _take(pool, torch.randint(args.pool, (args.batch,), generator=gen)))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
        opt.step()
        it += 1
        bar.update(int(time.perf_counter() - start) - bar.n)
    bar.close()
    checkpoint(time.perf_counter() - start)
    log.close()
    plot(history, names, out / "observer_curve.png")
    return {"iterations": it, "best_iteration": kept["iteration"], "best_loss": kept["loss"], "last": history[-1]}


def _chunks(family: str, n: int, gen: torch.Generator, size: int = 4096) -> dict[str, list[torch.Tensor]]:
    parts: dict[str, list[torch.Tensor]] = {}
    for lo in range(0, n, size):
        for k, v in simulate_windows(family, min(size, n - lo), gen).items():
            parts.setdefault(k, []).append(v)
    return parts


def save(path: Path, net: ParamObserver, args: argparse.Namespace, best: float, best_it: int) -> None:
    torch.save(
        {
            "config": net.config,
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "training": {**vars(args), "best_loss": best, "best_iteration": best_it},
        },
        path,
    )


def plot(history: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """The validation loss, and each coordinate's RMSE of μ against its RMS sd, against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(its, [h["loss"] for h in history])
    axes[0].set_title("validation loss (−log q(v_true))")
    for name in names:
        line = axes[1].plot(its, [h[f"{name}_rmse"] for h in history], label=f"{name}: RMSE of μ")
        axes[1].plot(its, [h[f"{name}_sd"] for h in history], "--", color=line[0].get_color(), label=f"{name}: RMS sd")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(observer_pt: str | Path, root: str | Path, name: str, readme: str | None = None):
    """Write the registry folder ``root/name`` of a trained ``observer.pt`` → its record; ``metrics.json`` holds the
    kept θ's validation."""
    payload = torch.load(observer_pt, map_location="cpu", weights_only=True)
    training = payload["training"]
    family = training["family"]
    config = {
        "family": family,
        "state_dim": 1,
        "obs_dim": 1,
        "architecture": {"kind": ARCHITECTURE_KIND, **payload["config"]},
        "auto_select": False,
        "auto_select_note": "a parameter observer: smc2's mh kernel proposes from it (method_options.observer)",
        "observer_params": [list(p) for p in FAMILIES[family].observer_params],
        "domain": {k: list(v) if isinstance(v, tuple) else v for k, v in FAMILIES[family].OBSERVER_TASKS.items()},
        "training": {k: v for k, v in training.items() if isinstance(v, int | float | str | bool) or v is None},
    }
    if readme is None:
        readme = (
            f"# {name}\n\nTrained by `python -m mpflow.training.param_observer_train` with {json.dumps(training)}.\n"
        )
    state = {k: v.to(torch.float32).contiguous() for k, v in payload["state"].items()}
    log = Path(observer_pt).with_name("observer_log.jsonl")
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []
    kept = [r for r in rows if r["iteration"] == training["best_iteration"]]
    metrics = {"best_loss": training["best_loss"], "validation": kept[-1] if kept else None}
    return registry.save_operator(root, name, config, state, metrics, readme, overwrite=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(f for f, c in FAMILIES.items() if c.observer_params))
    p.add_argument("--out", required=True, help="folder for observer.pt, the log and the curve")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget")
    p.add_argument("--iterations", type=int, default=10**9, help="stop after this many iterations")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--pool", type=int, default=32768, help="tasks held at once")
    p.add_argument("--refresh", type=int, default=200, help="iterations between replacing a quarter of the pool")
    p.add_argument("--val", type=int, default=8192, help="held-out tasks")
    p.add_argument("--val-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    registered_run.add_register_arguments(p, "<family>-d1-v<k>")
    return p


def main(argv: list[str] | None = None) -> int:
    return registered_run.main(parser, train, register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
