"""The ``mpflow`` command line.

mpflow info                      model families and inference methods available
mpflow filter --family lds ...   run a method on a simulated sequence and compare it with the exact posterior
mpflow train --family gmm ...    meta-train an MPF operator (Algorithm 1) and save it to a registry folder
mpflow evaluate --operator NAME  held-out accuracy of an operator vs the exact posterior, smc and gpf
mpflow fit-sampler --prior P ... cache a GPVI generator for a mixture prior (unlimited samples)
mpflow serve [--host --port]     the HTTP service (docs/API.md)
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch

from mpflow.operators.filtering import ExactPosterior, FilterStep, run_filter
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models import family as family_class
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.mpf.gaussian_flow import LINEARISATIONS
from mpflow.operators.mpf.network import RESIDUAL_GATES, MPFVelocity
from mpflow.operators.rng import generator
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.training.meta_train import LR_SCHEDULES
from mpflow.training.tasks import TASK_FAMILIES


def _info(_: argparse.Namespace) -> int:
    out = {
        "families": [cls.describe() for cls in FAMILIES.values()],
        "methods": {name: {"defaults": cls.defaults, "weighted": cls.weighted} for name, cls in UPDATERS.items()},
    }
    print(json.dumps(out, indent=2, default=str))
    return 0


def _filter(args: argparse.Namespace) -> int:
    """Simulate ``--steps`` observations, filter them (:func:`mpflow.operators.filtering.run_filter`) and print
    each step: update time, log-evidence and, for linear-Gaussian families, the error against Kalman."""
    d = args.dim
    cls = family_class(args.family)
    params = {**cls.example_params(d), **(json.loads(args.params) if args.params else {})}
    model = make_model(args.family, params, d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    updater = get_updater(args.method)
    updater.check_compatible(model, prior)  # before the table's header: a method that cannot run prints only the error
    _, obs = model.simulate(args.steps, torch.ones(1, d), [generator(args.seed + 1)])
    exact = ExactPosterior.kalman(torch.zeros(1, d), torch.eye(d)[None], model, obs) if model.linear_gaussian else None
    print(f"{'step':>4} {'ms':>8} {'log Z':>10} {'mean err (sd)':>14} {'var ratio':>10}")

    def show(step: FilterStep) -> None:
        line = f"{step.t:>4} {step.ms:>8.2f} {float(step.state.log_evidence[0]):>10.3f}"
        if step.scores:
            err, ratio = float(step.scores["mean_error_sd"][0]), float(step.scores["var_ratio"][0])
            line += f" {err:>14.3f} {ratio:>10.3f}"
        print(line)

    result = run_filter(updater, model, prior, obs, args.particles, args.seed, exact, moments=False, on_step=show)
    if result.log_evidence_error is not None:
        print(f"log-evidence error vs Kalman: {float(result.log_evidence_error[0]):+.4f} nats")
    return 0


def _init_distributed() -> tuple[int, int]:
    """Under ``torchrun`` (WORLD_SIZE > 1) join the process group — NCCL when CUDA is present, else gloo —
    and return (rank, world size); (0, 1) otherwise."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def _init_network(name_or_dir: str, family: str, dim: int):
    """(record, a trainable copy of its network) of the operator ``--init-from`` names; it must be for the same
    family and dimension (SystemExit otherwise)."""
    import copy

    from mpflow.operators.registry import resolve
    from mpflow.operators.updaters.mpf import network_from_record

    try:
        record = resolve(name_or_dir)
    except ValueError as exc:
        raise SystemExit(f"--init-from: {exc}") from None
    if (record.family, record.state_dim) != (family, dim):
        found = f"{record.family} with d = {record.state_dim}"
        raise SystemExit(f"--init-from: {record.name} is for {found}, not {family} with d = {dim}")
    net = copy.deepcopy(network_from_record(record)).train()
    for p in net.parameters():
        p.requires_grad_(True)
    return record, net


def launcher(world: int) -> list[str]:
    """How a training command starts, for the operator's README: ``mpflow`` for one process; under torchrun
    the same command with its process count — the global batch (and so θ) depends on it."""
    if world <= 1:
        return ["mpflow"]
    return ["torchrun", "--standalone", "--nproc_per_node", str(world), "-m", "mpflow"]


def _train(args: argparse.Namespace) -> int:
    """Meta-train an MPF operator on sampled tasks, then save it with
    :func:`mpflow.operators.registry.save_operator`."""
    from mpflow.operators.registry import save_operator
    from mpflow.training.meta_train import meta_train, resolve_device
    from mpflow.training.tasks import sample_tasks

    rank, world = _init_distributed()
    torch.set_num_threads(args.threads)
    task_kwargs = json.loads(args.task_options) if args.task_options else {}
    arch = {
        "hidden": args.hidden,
        "layers": args.layers,
        "embed": args.embed,
        "use_base": True,
        "residual_gate": args.residual_gate,
        "linearisation": args.linearisation,
    }
    torch.manual_seed(args.seed)  # the network's initial weights (the same on every rank)
    net = MPFVelocity(args.dim, **arch)
    init_from = None
    if args.init_from:  # fine-tune: start from a registered operator's θ (and its architecture)
        record, source = _init_network(args.init_from, args.family, args.dim)
        arch, net = dict(record.config["architecture"]), source
        init_from = {"name": record.name, "content_hash": record.content_hash}
    out = Path(args.out)
    device = resolve_device(args.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    training = {
        "iterations": args.iterations,
        "batch": args.batch,
        "steps_per_seq": args.steps_per_seq,
        "segment": args.segment,
        "segment_prior": args.segment_prior,
        "predicted_prior": args.predicted_prior,
        "curriculum": args.curriculum,
        "particles": args.particles,
        "lr": args.lr,
        "lr_schedule": args.lr_schedule,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "val_every": args.val_every,
        "val_tasks": args.val_tasks,
        "min_improvement": args.min_improvement,
        "task_kwargs": task_kwargs,
        "world_size": world,
        "device": device.type,
        "loss": "MPF eq. 19 (cumulative; eq. 21 segments; dynamic families: per-step loss vs the predicted density)",
        "init_from": init_from,
    }
    stem = f"{args.family}-d{args.dim}-seed{args.seed}"
    result = meta_train(
        net,
        args.family,
        args.dim,
        iterations=args.iterations,
        batch=args.batch,
        T=args.steps_per_seq,
        N=args.particles,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        weight_decay=args.weight_decay,
        steps=args.ode_steps,
        seed=args.seed,
        val_every=args.val_every,
        val_tasks=args.val_tasks,
        progress=not args.quiet,
        checkpoint=out / "_training" / f"{stem}.pt",
        resume=args.resume,
        log_path=out / "_training" / f"{stem}.jsonl",
        device=device,
        task_kwargs=task_kwargs,
        segment=args.segment,
        segment_prior=args.segment_prior,
        predicted_prior=args.predicted_prior,
        curriculum=args.curriculum,
        adjoint=args.adjoint,
        max_minutes=args.max_minutes,
        min_improvement=args.min_improvement,
    )
    if rank != 0:
        return 0
    training["iterations_done"] = result["iterations"]
    training["seconds"] = round(result["seconds"], 1)
    training["it_per_s"] = round(result["it_per_s"], 3)
    probe = sample_tasks(args.family, args.dim, 1, 1, torch.Generator().manual_seed(0), **task_kwargs)
    config = {
        "family": args.family,
        "state_dim": args.dim,
        "obs_dim": math.prod(abs(n) for n in probe.obs.shape[2:]),
        "architecture": arch,
        "training": training,
        "solver": {"method": "rk4", "steps": args.ode_steps},
        # what the operator has seen: checked against every stream that uses it (docs/API.md "operator_domain")
        "domain": family_class(args.family).task_domain(task_kwargs),
    }
    metrics = {
        "val_loss_best": result["val_loss_best"],
        "val_loss_untrained": result["val_loss_untrained"],
        "best_iteration": result["best_iteration"],
    }
    command = shlex.join([*launcher(world), *(args.argv or [])])
    readme = (
        f"# MPF operator ({args.family}, d = {args.dim})\n\nTrained with\n\n    {command}\n\n"
        f"({result['iterations']} iterations, {result['seconds'] / 60:.1f} min on {device.type}, {world} process(es); "
        f"validation loss {result['val_loss_untrained']:.4f} untrained → {result['val_loss_best']:.4f} "
        f"at iteration {result['best_iteration']}.)\n"
    )
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    record = save_operator(out, None, config, state, metrics, readme)
    print(json.dumps({"saved": str(record.path), "metrics": metrics}))
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
    f.add_argument(
        "--params", help="model parameters as JSON (defaults: the family's example parameters; lds: A = 0.9 I, B = I)"
    )
    f.set_defaults(func=_filter)
    t = sub.add_parser("train", help="meta-train an MPF operator and save it to a registry folder")
    t.add_argument("--family", required=True, choices=sorted(TASK_FAMILIES))
    t.add_argument("--dim", type=int, required=True)
    t.add_argument("--iterations", type=int, required=True)
    t.add_argument("--batch", type=int, default=8, help="tasks per iteration")
    t.add_argument("--steps-per-seq", type=int, default=10, help="observations per task (T)")
    t.add_argument("--particles", type=int, default=256)
    t.add_argument("--out", required=True, help="registry folder to save the operator in")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/_training/<family>-d<d>-seed<S>.pt")
    t.add_argument(
        "--init-from",
        help="start from this registered operator's weights and architecture (a name or folder): fine-tuning",
    )
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument(
        "--lr-schedule", default="constant", choices=LR_SCHEDULES, help="cosine: annealed to 0 over --iterations"
    )
    t.add_argument("--weight-decay", type=float, default=1e-5)
    t.add_argument("--ode-steps", type=int, default=1, help="RK4 steps per observation")
    t.add_argument("--val-every", type=int, default=10)
    t.add_argument("--val-tasks", type=int, default=16)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--embed", type=int, default=64)
    t.add_argument(
        "--residual-gate",
        default="none",
        choices=RESIDUAL_GATES,
        help="information: scale the learned residual by 1 − exp(−KL^1.5), KL the linearised step's information",
    )
    t.add_argument(
        "--linearisation",
        default="stein",
        choices=LINEARISATIONS,
        help="Gaussian fit of a non-Gaussian likelihood for the base flow: stein (scores) or importance (moments)",
    )
    t.add_argument("--segment", type=int, default=None, help="cut sequences every S steps (eq. 21)")
    t.add_argument(
        "--segment-prior", default="kde", choices=["kde", "kde-shrunk", "gaussian"], help="prior of a segment"
    )
    t.add_argument(
        "--predicted-prior",
        default="gaussian",
        choices=["kde", "kde-shrunk", "gaussian"],
        help="dynamic families' step prior",
    )
    t.add_argument("--curriculum", type=float, default=0.0, help="fraction of the run over which T grows from 1")
    t.add_argument("--task-options", help="task distribution options as JSON (training.tasks.TASK_OPTIONS)")
    t.add_argument("--adjoint", action="store_true", help="adjoint-method gradients (O(1) memory in ODE steps)")
    t.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    t.add_argument(
        "--min-improvement", type=float, default=0.0, help="relative validation gain needed to replace the best θ"
    )
    t.add_argument("--max-minutes", type=float, help="stop after this much training time (validates first)")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)
    from mpflow.training.evaluate import add_parser as add_evaluate_parser

    add_evaluate_parser(sub)
    from mpflow.training.fit_sampler import add_parser as add_fit_sampler_parser

    add_fit_sampler_parser(sub)
    from mpflow.cli.serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
