"""Meta-training of the MPF operator (Chen, Dai & Song, §3, Algorithm 1, eq. 19 and 22).

For a task (π, p(· | x), o_{1:M}) the particles X_0 = {x_0^n} ~ π start with log q_0 = log π, and each Bayes
step m = 1..M does what :class:`mpflow.operators.updaters.mpf.MPFUpdater` does at serving time — linearise the
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

Sequence segmentation with a KDE prior (eq. 20–21), the dynamic-family loss (predict, then the per-step
loss against the predicted density), a curriculum on sequence length, adjoint gradients and data-parallel
training under torchrun (DistributedDataParallel; gloo on CPU, NCCL on GPUs) and a cosine step-size schedule
are options of :func:`meta_train`. Not implemented: the reference's learned integration span.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mpflow.operators import accuracy, gaussian
from mpflow.operators.models import FAMILIES
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf.divergence import EXACT_MAX_DIM, rademacher_probes
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.mpf.step import flow_step, predict
from mpflow.operators.rng import generator
from mpflow.training.scores import PREDICTIVE, SCORES, predictive_log_score, score
from mpflow.training.task_distribution import task_distribution
from mpflow.training.tasks import Tasks, sample_tasks
from torch import nn
from tqdm.auto import tqdm

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
    states = None if tasks.states is None else tasks.states.to(device)
    return Tasks(model, prior, tasks.obs.to(device), tasks.x_true.to(device), tasks.gens, states)


def _density(kind: str, particles: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A density fitted to (detached) particles [B, N, d] → log π̂ as a function: "kde" is π̂(x; X) of eq. 20
    (Silverman widths per dimension; its variance exceeds the particles' by the kernel's, (1 + c²)σ²),
    "kde-shrunk" the same kernels on centres shrunk towards the mean, m + a (x_i − m) with a² = 1 − c²
    (Liu & West 1999), so π̂ keeps the particles' variances — an operator trained against eq. 20's KDE learns
    posteriors too wide by that factor — and "gaussian" the moment-matched Gaussian (exact for Gaussian
    clouds)."""
    X = particles.detach()
    if kind == "kde":
        return lambda x: accuracy.kde_log_density(x, X).to(x.dtype)
    if kind == "kde-shrunk":  # Liu & West (1999): centres shrunk towards the mean keep the covariance
        X64 = X.double()
        h = accuracy.silverman_bandwidth(X64)  # [B, d] = c·σ_d with the same c in every dimension
        mean, cov = gaussian.moments(X64)
        sd = torch.diagonal(cov, dim1=-2, dim2=-1).sqrt()
        a = torch.sqrt((1 - (h / sd) ** 2).clamp_min(0.0))  # a² σ² + h² = σ²
        centres = mean[:, None] + a[:, None] * (X64 - mean[:, None])
        return lambda x: accuracy.kde_log_density(x, centres, bandwidth=h).to(x.dtype)
    if kind == "gaussian":
        mean, cov = gaussian.moments(X.double())
        chol = gaussian.cholesky(cov)
        return lambda x: gaussian.log_prob(x.double(), mean, chol).to(x.dtype)
    raise ValueError(f"segment_prior: expected 'kde', 'kde-shrunk' or 'gaussian', got {kind!r}")


def task_loss(
    net: MPFVelocity,
    tasks: Tasks,
    N: int,
    *,
    steps: int = 1,
    create_graph: bool = True,
    device=None,
    segment: int | None = None,
    segment_prior: str = "kde",
    predicted_prior: str = "gaussian",
    adjoint: bool = False,
    loss: str = "kl",
    tbptt: int | None = None,
) -> torch.Tensor:
    """The loss of each task [B]: the eq. 19 loss (``loss="kl"``, the paper's; summed over the T steps, mean over
    particles), or a scoring rule of the clouds against the simulated truth (``"energy"``, ``"crps"``:
    :func:`score_loss`, which ``tbptt`` truncates).

    Static families: the cumulative loss with eq. 22. ``segment`` = S cuts the sequence every S steps
    (eq. 21): at a cut the particles are detached, the new segment's prior is π̂(x; X_cut) (``segment_prior``:
    the KDE of eq. 20 or the moment-matched Gaussian), log q restarts at log π̂, and the inner sum of eq. 22
    runs over the segment's observations only.
    Dynamic families (MPF §5 LDS): each step predicts (:func:`mpflow.operators.mpf.step.predict`) and its loss is
    (1/N) Σ_n [log q_m(x_m^n) − log p(o_m | x_m^n) − log p̂_m(x_m^n)] with p̂_m the predicted density — the
    Gaussian pushed through the transition (exact for linear-Gaussian models, and what the updater uses), or
    the KDE of the predicted particles with ``predicted_prior="kde"``.
    For d > 8 the divergence is Hutchinson's with one Rademacher probe per particle and step (drawn from the
    task's generator), else exact (:mod:`mpflow.operators.mpf.divergence`).
    """
    if loss != "kl":
        kw = dict(steps=steps, create_graph=create_graph, device=device, adjoint=adjoint, tbptt=tbptt)
        return score_loss(net, tasks, N, loss=loss, **kw)
    x, tasks, device = _initial_cloud(tasks, N, device)
    model, prior = tasks.model, tasks.prior
    with torch.device(device):
        log_q = prior.log_prob(x)
        log_prior, start = prior.log_prob, 0
        total = torch.zeros(tasks.batch_size, dtype=x.dtype)
        for m in range(tasks.length):
            obs = tasks.obs[:, m]
            white = None  # the predicted cloud's whitened form, as serving passes it to flow_step
            if model.dynamic:
                x, _, white = predict(model, x, tasks.gens, density=False)  # the loss fits its own p̂_m below
                log_prior = _density(predicted_prior, x)
                log_q, start = log_prior(x), m
            elif segment and m > 0 and m % segment == 0:  # eq. 21: a new task from the particles at the cut
                x = x.detach()
                log_prior = _density(segment_prior, x)
                log_q, start = log_prior(x), m
            probes = rademacher_probes(tasks.gens, 1, N, x.shape[-1], x.dtype) if x.shape[-1] > EXACT_MAX_DIM else None
            x, log_q = flow_step(
                net,
                model,
                obs,
                x,
                log_q,
                steps=steps,
                create_graph=create_graph,
                adjoint=adjoint,
                probes=probes,
                whitened=white,
            )
            log_joint = log_prior(x)  # eq. 22: log π(x_m) + Σ_{start≤s≤m} log p(o_s | x_m)
            for s in range(start, m + 1):
                log_joint = log_joint + model.log_likelihood(tasks.obs[:, s], x)
            total = total + (log_q - log_joint).mean(-1)
    return total


def _initial_cloud(tasks: Tasks, N: int, device) -> tuple[torch.Tensor, Tasks, torch.device]:
    """(X_0 ~ π [B, N, d] on ``device``, the tasks moved there, the device): drawn on CPU from the per-task
    generators, with the exact prior moments for a Gaussian prior (as MPFUpdater._init)."""
    device = torch.device("cpu") if device is None else device
    x = tasks.prior.sample(N, tasks.gens)
    tasks = _to_device(tasks, device)
    with torch.device(device):
        x = x.to(device)
        if tasks.prior.weights.shape[1] == 1:
            x = gaussian.moment_matched(x, *tasks.prior.moments())
    return x, tasks, device


LOSSES = ("kl", *SCORES, PREDICTIVE)


def score_loss(
    net: MPFVelocity,
    tasks: Tasks,
    N: int,
    *,
    loss: str = "energy",
    steps: int = 1,
    create_graph: bool = True,
    device=None,
    adjoint: bool = False,
    tbptt: int | None = None,
) -> torch.Tensor:
    """The mean over the T steps of a strictly proper score of the step's posterior cloud against the simulated true
    state, per task [B] (:mod:`mpflow.training.scores`: ``"energy"`` or per-dimension ``"crps"``), or
    (``"predictive"``) of the predictive log score of each step's observation under the cloud carried to it,
    −log (1/N) Σ_j p(o_m | x̃_j) with x̃ the predicted cloud (:func:`~mpflow.training.scores.predictive_log_score`:
    the flows of the steps before m are rated by how much of the next observation's probability their cloud keeps;
    step 1's term rates the prior alone, a constant).

    The cloud is carried from step to step as at serving time (dynamic families predict first,
    :func:`mpflow.operators.mpf.step.predict`), with its graph: the gradient of step m's score reaches the flows of
    the earlier steps, truncated every ``tbptt`` steps (the cloud is detached there: truncated back-propagation
    through time, memory O(tbptt)); None keeps the whole sequence. No log-density is tracked (the score needs
    none), so a step costs one velocity evaluation per RK4 stage and no divergence."""
    if loss not in (*SCORES, PREDICTIVE):
        raise ValueError(f"loss: expected one of {list(LOSSES)}, got {loss!r}")
    if tasks.states is None and loss != PREDICTIVE:
        raise ValueError("a scoring-rule loss needs the tasks' true states (sample_tasks gives them)")
    x, tasks, device = _initial_cloud(tasks, N, device)
    model = tasks.model
    with torch.device(device):
        total = torch.zeros(tasks.batch_size, dtype=x.dtype)
        for m in range(tasks.length):
            white = None
            if model.dynamic:  # the predictive score reads the predicted moments, so they keep their graph for it
                moved = model.propagate(x, tasks.gens, moments_graph=loss == PREDICTIVE)
                x, _, white = predict(model, x, tasks.gens, density=False, propagated=moved)
            if loss == PREDICTIVE:  # rates the flows before step m (cut below at a truncation, after it is taken)
                total = total + predictive_log_score(model.log_likelihood(tasks.obs[:, m], x))
                if m == tasks.length - 1:  # the last step's flow would be rated by no observation
                    break
            if tbptt and m > 0 and m % tbptt == 0:
                x = x.detach()
                if white is not None:
                    white = gaussian.Whitened(white.mean.detach(), white.chol.detach(), white.z.detach())
            x, _ = flow_step(
                net,
                model,
                tasks.obs[:, m],
                x,
                None,
                steps=steps,
                divergence="none",
                create_graph=create_graph,
                adjoint=adjoint,
                whitened=white,
            )
            if loss != PREDICTIVE:
                total = total + score(loss, x, tasks.states[:, m].to(x.dtype))
    return total / tasks.length


def check_score_truth(family: str, loss: str, task_kwargs: dict[str, Any]) -> None:
    """ValueError when a scoring-rule loss would rate a static family's clouds against one fixed point: E S(Q, x) is
    minimised by the posterior p(x | o) only when the truth x is drawn from the task's prior (then (x, o) ~
    π(x) p(o | x)); against a fixed x (``true_x`` "paper" — the default where the family has a paper point — or a
    point) the minimiser is a cloud collapsed on that point, not the posterior. Dynamic families draw x_0 ~ π and
    move it, so they need nothing."""
    if loss == "kl" or FAMILIES[family].dynamic:
        return
    true_x = task_kwargs.get("true_x", "paper" if task_distribution(family).paper_true_x is not None else "prior")
    if true_x != "prior":
        raise ValueError(
            f"loss {loss!r} on the static family {family}: the truth must be drawn from the prior (a proper score "
            f"against a fixed true_x {true_x!r} is minimised by a point, not the posterior); "
            '--task-options \'{"true_x": "prior"}\''
        )


def validation_loss(
    net: MPFVelocity,
    family: str,
    dim: int,
    *,
    seed: int,
    val_tasks: int,
    T: int,
    N: int,
    device=None,
    task_kwargs: dict[str, Any] | None = None,
    **loss_kw: Any,
) -> float:
    """Mean eq. 19 loss over ``val_tasks`` held-out tasks (a fixed seed stream never used for training);
    ``loss_kw`` as for :func:`task_loss` (steps, segment, segment_prior)."""
    tasks = sample_tasks(family, dim, val_tasks, T, generator(seed * _SEED_STRIDE), **(task_kwargs or {}))
    was_training = net.training
    net.eval()
    with torch.no_grad():
        loss = task_loss(net, tasks, N, create_graph=False, device=device, **loss_kw).mean()
    net.train(was_training)
    return float(loss)


class TaskLoss(nn.Module):
    """The batch loss as a module, so DistributedDataParallel can wrap it (its forward is where DDP hooks
    in; the network's own methods — context, field — are called inside)."""

    def __init__(self, net: MPFVelocity):
        super().__init__()
        self.net = net

    def forward(self, tasks: Tasks, N: int, **loss_kw: Any) -> torch.Tensor:
        return task_loss(self.net, tasks, N, create_graph=True, **loss_kw).mean()


def _world() -> tuple[int, int]:
    """(rank, world size) under torch.distributed (torchrun), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def curriculum_length(T: int, iteration: int, iterations: int, curriculum: float) -> int:
    """Sequence length of training iteration ``iteration`` (0-based): grows linearly from 1 to T over the
    first ``curriculum`` fraction of the run (0 = always T)."""
    if curriculum <= 0:
        return T
    return max(1, min(T, math.ceil(T * (iteration + 1) / (curriculum * iterations))))


LR_SCHEDULES = ("constant", "cosine")


def learning_rate(lr: float, iteration: int, iterations: int, schedule: str = "constant") -> float:
    """Adam's step size at training iteration ``iteration`` (0-based) of ``iterations``: ``lr`` throughout
    ("constant"), or cosine annealing from ``lr`` to 0 (Loshchilov & Hutter 2017, without restarts):
    lr·½(1 + cos(π·i/I)). A function of the iteration alone, so a resumed run follows the same schedule."""
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * min(iteration, iterations) / iterations))
    raise ValueError(f"lr_schedule: expected one of {list(LR_SCHEDULES)}, got {schedule!r}")


def projected_total(iterations: int, done: int, start: int, seconds: float, max_minutes: float | None) -> int:
    """The iterations a run will reach: ``iterations``, or under ``max_minutes`` fewer — the ones done plus those
    the time left allows at this run's pace (``done - start`` iterations in ``seconds``). The progress bar's total,
    so that its ETA counts down to the time limit rather than to ``iterations``."""
    if max_minutes is None or done <= start or seconds <= 0:
        return iterations
    left = max(0.0, 60 * max_minutes - seconds)
    return max(done, min(iterations, done + math.ceil(left * (done - start) / seconds)))


def stop_reason(done: int, iterations: int, out_of_time: bool, max_minutes: float | None) -> str:
    """Why a run stopped, in words (the closing summary of ``mpflow train``)."""
    if out_of_time:
        return f"the time limit (--max-minutes {max_minutes:g}) after {done} of {iterations} iterations"
    return f"all {iterations} iterations done"


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
    lr_schedule: str = "constant",
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
    segment: int | None = None,
    segment_prior: str = "kde",
    predicted_prior: str = "gaussian",
    curriculum: float = 0.0,
    adjoint: bool = False,
    skip_above: float = 1e7,
    max_minutes: float | None = None,
    min_improvement: float = 0.0,
    loss: str = "kl",
    tbptt: int | None = None,
) -> dict[str, Any]:
    """Algorithm 1 (module docstring). Trains ``net`` in place and leaves the best validated θ in it.

    ``loss``: "kl" (eq. 19, the paper's), or a strictly proper scoring rule of each step's cloud against the
    simulated truth, "energy" or "crps" (:func:`score_loss`; ``tbptt`` truncates its back-propagation through the
    steps). Validation uses the same loss.

    ``lr_schedule``: "constant" or "cosine" (:func:`learning_rate`, annealed over ``iterations``; with
    ``max_minutes``, choose ``iterations`` the time allows, or the run stops before the schedule ends).
    ``segment``/``segment_prior``: sequence segmentation (eq. 21, :func:`task_loss`); ``curriculum``: the
    fraction of the run over which the training sequence length grows from 1 to T
    (:func:`curriculum_length`; validation always uses T); ``adjoint``: adjoint-method gradients.
    An iteration whose loss is non-finite, above ``skip_above`` or raises on a degenerate particle cloud is
    skipped (no update; counted in the log as ``skipped``); more than max(10, iterations/10) skips abort. A
    validation that raises on a degenerate cloud (a θ that collapses a held-out task's cloud) logs ``val_loss`` null
    and counts in ``val_failed``; that θ is never the best.
    ``min_improvement``: a validation loss replaces the best only when lower by this fraction of it — so an
    operator whose base flow is already exact (linear-Gaussian families) keeps θ₀ rather than a θ that only
    won on validation noise. ``max_minutes`` stops after that much training time (validating first); the
    result's ``iterations`` says where, and rerunning with that many ``iterations`` and no time limit
    reproduces the run exactly.
    Under ``torchrun`` (torch.distributed initialised) the loss is wrapped in DistributedDataParallel:
    every rank draws its own ``batch`` tasks (the global batch is batch × world size; tasks of iteration i
    on rank r come from the seed stream position i·world + r, so one process reproduces the plain run)
    and gradients are averaged; rank 0 validates, logs, checkpoints and shows the progress bar.

    ``iterations`` is the total count: with ``resume`` and an existing ``checkpoint`` the run continues
    from the saved iteration (if the loss options differ from the checkpoint's, the best-so-far restarts at
    the resumed θ, validated under the new loss). The checkpoint (torch.save; a training artefact, not an
    operator) is written after every validation and at the end; it holds tensors, numbers, strings, lists and
    dicts only, and is read back with ``torch.load(weights_only=True)``, which refuses anything else. ``log_path``
    gets one JSON line per iteration: {"iteration", "train_loss", "val_loss" (null between validations),
    "seconds"}.

    Returns {"val_loss_untrained", "val_loss_best", "best_iteration", "final_state", "iterations",
    "seconds", "it_per_s", "history"}.
    """
    for name, value in (("iterations", iterations), ("val_every", val_every), ("val_tasks", val_tasks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    learning_rate(lr, 0, iterations, lr_schedule)  # validates the schedule's name before any work
    dev = resolve_device(device)
    net.to(dev)
    rank, world = _world()
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {list(LOSSES)}, got {loss!r}")
    check_score_truth(family, loss, task_kwargs or {})
    loss_kw = dict(steps=steps, segment=segment, segment_prior=segment_prior, predicted_prior=predicted_prior)
    if loss != "kl":  # (not in the KL run's key: a checkpoint of an earlier version resumes under the same loss)
        loss_kw.update(loss=loss, tbptt=tbptt)
    loss_module: nn.Module = TaskLoss(net)
    if world > 1:
        loss_module = nn.parallel.DistributedDataParallel(
            loss_module, device_ids=[dev.index] if dev.type == "cuda" else None
        )
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    val_kw = dict(seed=seed, val_tasks=val_tasks, T=T, N=N, device=dev, task_kwargs=task_kwargs, **loss_kw)
    lead = rank == 0
    ckpt = Path(checkpoint) if checkpoint is not None else None
    start, seconds, history, skipped, val_failed = 0, 0.0, [], 0, 0
    if resume and ckpt is not None and ckpt.exists():
        # weights_only: tensors, numbers, strings, lists and dicts only — a checkpoint that holds any other object
        # (a pickle that would run code) is refused, whoever put it at that path
        state = torch.load(ckpt, map_location=dev, weights_only=True)
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
        if state.get("loss_kw") != loss_kw and lead:
            # resumed with another loss (e.g. a new segment prior): earlier validation losses are not comparable,
            # so the resumed θ becomes the best so far under the new loss
            best_val, best_state, best_it = (
                validation_loss(net, family, dim, **val_kw),
                copy.deepcopy(net.state_dict()),
                start,
            )
    else:
        untrained = validation_loss(net, family, dim, **val_kw) if lead else math.nan
        best_val, best_state, best_it = untrained, copy.deepcopy(net.state_dict()), 0

    def save(iteration: int) -> None:
        if ckpt is None or not lead:
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
            "loss_kw": loss_kw,
        }
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(ckpt)

    log = None
    if log_path is not None and lead:  # a fresh run starts a fresh log; a resumed one appends to it
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a" if start > 0 else "w", encoding="utf-8")  # noqa: SIM115
    net.train()
    bar = tqdm(
        range(start, iterations), initial=start, total=iterations, disable=not (progress and lead), desc="meta-train"
    )
    out_of_time = False
    try:
        for it in bar:
            t0 = time.perf_counter()
            T_it = curriculum_length(T, it, iterations, curriculum)
            position = it * world + rank
            tasks = sample_tasks(
                family, dim, batch, T_it, generator(seed * _SEED_STRIDE + 2 * position + 1), **(task_kwargs or {})
            )
            opt.zero_grad(set_to_none=True)
            try:
                loss = loss_module(tasks, N, device=dev, adjoint=adjoint, **loss_kw)
                ok = bool(torch.isfinite(loss)) and float(loss.detach()) < skip_above
            except ValueError:  # a degenerate cloud (covariance not PD) from a bad θ on a hard task
                loss, ok = torch.tensor(math.nan), False
            if world > 1:  # every rank must agree to step (DDP all-reduces in backward)
                flag = torch.tensor([float(ok)], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                ok = bool(flag.item() > 0)
            if ok:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                for group in opt.param_groups:
                    group["lr"] = learning_rate(lr, it, iterations, lr_schedule)
                opt.step()
            else:
                skipped += 1
                if skipped > max(10, iterations // 10):
                    raise FloatingPointError(f"{skipped} iterations skipped (non-finite or exploding loss); lower lr")
            seconds += time.perf_counter() - t0
            done = it + 1
            val = None
            out_of_time = max_minutes is not None and seconds >= 60 * max_minutes
            if world > 1 and max_minutes is not None:  # stop together
                flag = torch.tensor([float(out_of_time)], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                out_of_time = bool(flag.item() > 0)
            if lead and (done % val_every == 0 or done == iterations or out_of_time):
                try:
                    val = validation_loss(net, family, dim, **val_kw)
                except ValueError:  # a degenerate validation cloud (covariance not PD) under this θ: not a best
                    val, val_failed = None, val_failed + 1
                if val is not None and val < best_val - min_improvement * abs(best_val):
                    best_val, best_state, best_it = val, copy.deepcopy(net.state_dict()), done
            row = {
                "iteration": done,
                "T": T_it,
                "train_loss": float(loss.detach()),
                "val_loss": val,
                "val_failed": val_failed,
                "skipped": skipped,
                "seconds": round(seconds, 4),
            }
            history.append(row)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
            bar.total = projected_total(iterations, done, start, seconds, max_minutes)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", best=f"{best_val:.3f}")
            if val is not None:
                save(done)
            if out_of_time:
                break
    finally:
        if log is not None:
            log.close()
    final_state = copy.deepcopy(net.state_dict())
    net.load_state_dict(best_state)
    last = history[-1]["iteration"] if history else start
    return {
        "val_loss_untrained": untrained,
        "val_loss_best": best_val,
        "best_iteration": best_it,
        "final_state": final_state,
        "iterations": last,
        "stopped": stop_reason(last, iterations, out_of_time, max_minutes),
        "seconds": seconds,
        # over every iteration, resumed runs' included (a resumed run that was already finished did none itself)
        "it_per_s": (len(history) / seconds) if seconds > 0 and history else 0.0,
        "history": history,
    }
