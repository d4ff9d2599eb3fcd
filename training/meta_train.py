"""Meta-training of the MPF operator (Chen, Dai & Song, §3, Algorithm 1, eq. 19 and 22).

For a task (π, p(· | x), o_{1:M}) the particles X_0 = {x_0^n} ~ π start with log q_0 = log π, and each Bayes
step m = 1..M does what :class:`operators.updaters.mpf.MPFUpdater` does at serving time — linearise the
likelihood (exactly for linear-Gaussian families, else by Stein's identity from the scores at the detached
particles), build the network's context from the detached particles, integrate dx/dλ = f_θ and
d log q/dλ = −∇·f over λ ∈ [0, 1] (RK4, ``steps`` equal steps) — but with the graph kept
(``create_graph=True``). The task loss is the cumulative KL-type loss of eq. 19 with eq. 22:

    L(T) = Σ_{m=1}^{M} (1/N) Σ_n [ log q_m(x_m^n) − log π(x_m^n) − Σ_{s≤m} log p(o_s | x_m^n) ],

= Σ_m [KL(q_m ‖ p(x | o_{1:m})) − log p(o_{1:m})]: minimal, for every θ-independent evidence term, when
each q_m is the exact posterior. The loss of a batch is the mean of L(T) over its tasks.

Gradients: particles and log q are carried across the M steps *with* their graph (no truncation: the
gradient of step m's loss reaches every earlier flow, as in the reference), so memory grows linearly in M;
the contexts (moments, DeepSet embedding, likelihood linearisation) are computed from detached particles,
as at serving time. The likelihood score fed to f_θ stays differentiable in x (``ModelFamily.score`` keeps
the graph when x is part of one, as the closed forms do), so ∇·f includes ∂f/∂s · ∂s/∂x — in training and
at serving alike.

Algorithm 1: θ ← Adam(lr, weight decay) on the batch loss, gradient-norm clipping (``clip``); every
``val_every`` iterations the same loss without gradients on ``val_tasks`` held-out tasks (a fixed
validation seed stream, disjoint from the training one); the best θ (lowest validation loss) is kept and
loaded into ``net`` at the end. Training tasks of iteration i depend only on (seed, i), so a run resumed from
a checkpoint continues exactly as a straight run would.

Not implemented yet: the KDE prior and sequence segmentation of eq. 20–21, dynamic families (predict step),
the adaptive time span of the reference, the adjoint method, multi-GPU (torchrun/DDP).
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from operators import gaussian
from operators.models.priors import GaussianMixture
from operators.mpf.network import MPFVelocity
from operators.mpf.step import flow_step
from operators.rng import generator
from training.tasks import Tasks, sample_tasks

_SEED_STRIDE = 1_000_003  # training tasks of iteration i: seed·stride + 2i + 1; validation: seed·stride


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _to_device(tasks: Tasks, device: torch.device) -> Tasks:
    if device.type == "cpu":
        return tasks
    m = tasks.model
    model = type(m)({k: v.to(device) for k, v in m.params.items()}, m.state_dim)
    p = tasks.prior
    prior = GaussianMixture(p.weights.to(device), p.means.to(device), p.covs.to(device))
    return Tasks(model, prior, tasks.obs.to(device), tasks.x_true.to(device), tasks.gens)


def task_loss(
    net: MPFVelocity, tasks: Tasks, N: int, *, steps: int = 1, create_graph: bool = True, device=None
) -> torch.Tensor:
    """The eq. 19 loss of each task [B] (summed over the T steps, mean over particles)."""
    device = torch.device("cpu") if device is None else device
    x = tasks.prior.sample(N, tasks.gens)  # X_0 ~ π, drawn on CPU from the per-task generators
    tasks = _to_device(tasks, device)
    model, prior = tasks.model, tasks.prior
    with torch.device(device):
        x = x.to(device)
        if prior.weights.shape[1] == 1:  # as MPFUpdater._init: exact prior moments at step 0
            x = gaussian.moment_matched(x, *prior.moments())
        log_q = prior.log_prob(x)
        total = torch.zeros(tasks.batch_size, dtype=x.dtype)
        for m in range(tasks.length):
            x, log_q = flow_step(net, model, tasks.obs[:, m], x, log_q, steps=steps, create_graph=create_graph)
            log_joint = prior.log_prob(x)  # eq. 22: log π(x_m) + Σ_{s≤m} log p(o_s | x_m)
            for s in range(m + 1):
                log_joint = log_joint + model.log_likelihood(tasks.obs[:, s], x)
            total = total + (log_q - log_joint).mean(-1)
    return total


def validation_loss(
    net: MPFVelocity,
    family: str,
    dim: int,
    *,
    seed: int,
    val_tasks: int,
    T: int,
    N: int,
    steps: int = 1,
    device=None,
    task_kwargs: dict[str, Any] | None = None,
) -> float:
    """Mean eq. 19 loss over ``val_tasks`` held-out tasks (a fixed seed stream never used for training)."""
    tasks = sample_tasks(family, dim, val_tasks, T, generator(seed * _SEED_STRIDE), **(task_kwargs or {}))
    was_training = net.training
    net.eval()
    with torch.no_grad():
        loss = task_loss(net, tasks, N, steps=steps, create_graph=False, device=device).mean()
    net.train(was_training)
    return float(loss)


def meta_train(
    net: MPFVelocity,
    family: str,
    dim: int,
    *,
    iterations: int,
    batch: int,
    T: int,
    N: int,
    lr: float = 1e-3,
    weight_decay: float = 1e-5,
    steps: int = 1,
    seed: int = 0,
    val_every: int = 10,
    val_tasks: int = 16,
    clip: float = 10.0,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log_path: str | Path | None = None,
    device: str | torch.device = "auto",
    task_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Algorithm 1 (module docstring). Trains ``net`` in place and leaves the best validated θ in it.

    ``iterations`` is the total count: with ``resume`` and an existing ``checkpoint`` the run continues
    from the saved iteration. The checkpoint (torch.save; a training artefact, not an operator) is written
    after every validation and at the end. ``log_path`` gets one JSON line per iteration:
    {"iteration", "train_loss", "val_loss" (null between validations), "seconds"}.

    Returns {"val_loss_untrained", "val_loss_best", "best_iteration", "final_state", "iterations",
    "seconds", "it_per_s", "history"}.
    """
    for name, value in (("iterations", iterations), ("val_every", val_every), ("val_tasks", val_tasks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    dev = resolve_device(device)
    net.to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    val_kw = dict(seed=seed, val_tasks=val_tasks, T=T, N=N, steps=steps, device=dev, task_kwargs=task_kwargs)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    start, seconds, history = 0, 0.0, []
    if resume and ckpt is not None and ckpt.exists():
        # weights_only=False: the file is one this trainer wrote, at a path the caller gave
        state = torch.load(ckpt, map_location=dev, weights_only=False)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["optimizer"])
        start, seconds, history = state["iteration"], state["seconds"], state["history"]
        best_val, best_state, best_it, untrained = (
            state["best_val"],
            state["best_state"],
            state["best_iteration"],
            state["val_untrained"],
        )
        torch.set_rng_state(state["torch_rng"])
    else:
        untrained = validation_loss(net, family, dim, **val_kw)
        best_val, best_state, best_it = untrained, copy.deepcopy(net.state_dict()), 0

    def save(iteration: int) -> None:
        if ckpt is None:
            return
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "net": net.state_dict(),
            "optimizer": opt.state_dict(),
            "iteration": iteration,
            "seconds": seconds,
            "history": history,
            "best_val": best_val,
            "best_state": best_state,
            "best_iteration": best_it,
            "val_untrained": untrained,
            "torch_rng": torch.get_rng_state(),
        }
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(ckpt)

    log = None
    if log_path is not None:  # a fresh run starts a fresh log; a resumed one appends to it
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a" if start > 0 else "w", encoding="utf-8")  # noqa: SIM115
    net.train()
    bar = tqdm(range(start, iterations), initial=start, total=iterations, disable=not progress, desc="meta-train")
    try:
        for it in bar:
            t0 = time.perf_counter()
            tasks = sample_tasks(
                family, dim, batch, T, generator(seed * _SEED_STRIDE + 2 * it + 1), **(task_kwargs or {})
            )
            loss = task_loss(net, tasks, N, steps=steps, create_graph=True, device=dev).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"train loss is {float(loss.detach())} at iteration {it + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            seconds += time.perf_counter() - t0
            done = it + 1
            val = None
            if done % val_every == 0 or done == iterations:
                val = validation_loss(net, family, dim, **val_kw)
                if val < best_val:
                    best_val, best_state, best_it = val, copy.deepcopy(net.state_dict()), done
            row = {"iteration": done, "train_loss": float(loss.detach()), "val_loss": val, "seconds": round(seconds, 4)}
            history.append(row)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", best=f"{best_val:.3f}")
            if val is not None:
                save(done)
    finally:
        if log is not None:
            log.close()
    final_state = copy.deepcopy(net.state_dict())
    net.load_state_dict(best_state)
    n_done = iterations - start
    return {
        "val_loss_untrained": untrained,
        "val_loss_best": best_val,
        "best_iteration": best_it,
        "final_state": final_state,
        "iterations": iterations,
        "seconds": seconds,
        "it_per_s": (len(history) / seconds) if seconds > 0 and n_done > 0 else math.nan,
        "history": history,
    }
