"""The ``mpflow`` command line.

  mpflow info                      model families, methods, trained operators and the service settings in force
  mpflow filter --family lds ...   run a method on a simulated sequence and compare it with the exact posterior
  mpflow filter --data F --model M filter a CSV or Parquet file (in-process, or --server URL)
  mpflow train --family gmm ...    meta-train an MPF operator and save it to a registry folder
  mpflow evaluate --operator NAME  held-out accuracy of an operator against the exact posterior, smc and gpf
  mpflow fit-sampler --prior P ... cache a learned sampler for a mixture prior (unlimited samples)
  mpflow serve [--host --port]     the HTTP service (docs/API.md)

``mpflow COMMAND --help`` lists a command's options, each with its default.

Start-up stays light: the parser of a command, and so the modules it needs (torch among them), is built only when
that command is the one asked for; ``mpflow --help`` imports neither torch nor the service.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: what ``mpflow --help`` says above the commands
DESCRIPTION = """Online Bayesian inference for streams of noisy observations: serve it over HTTP (mpflow serve), try a
method on simulated data (mpflow filter), train and evaluate learned operators (mpflow train, mpflow evaluate).

mpflow COMMAND --help lists a command's options, each with its default."""

#: each command and its line of ``mpflow --help``
COMMANDS = {
    "info": "model families, methods, trained operators and the service settings in force",
    "filter": "filter a simulated sequence and compare with the exact posterior",
    "train": "meta-train an MPF operator and save it to a registry folder",
    "evaluate": "evaluate a trained MPF operator on held-out tasks against exact/long-run references",
    "fit-sampler": "fit a sampler to a prior density and cache it in a registry folder",
    "serve": "run the HTTP service",
}

#: help for options that the modules defining them leave without one: (command, option) → help
_MISSING_HELP = {("fit-sampler", "--seed"): "seed of the noise draws and the generator's initial weights"}


class HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help followed by ``(default: …)`` — unless the help already says it, or there is none to say
    (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or not action.option_strings:
            return text
        if "default" in text or f"({default})" in text:
            return text
        return f"{text} (default: %(default)s)"


def json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """An argparse ``type`` reading a JSON object; a bad value is refused with the flag's name (argparse adds it)."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
        return value

    parse.__name__ = flag
    return parse


def _first_paragraph(doc: str | None) -> str:
    """The first paragraph of a module docstring, without reStructuredText's double backquotes."""
    return (doc or "").strip().split("\n\n", 1)[0].replace("``", "")


def _finish(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """Every option of ``command`` with help and its default shown (:class:`HelpWithDefaults`)."""
    parser.formatter_class = HelpWithDefaults
    for action in parser._actions:
        for flag in action.option_strings:
            action.help = action.help or _MISSING_HELP.get((command, flag))
    return parser


# ---------------------------------------------------------------------------------------------- info
def _add_info(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("info", help=COMMANDS["info"], description=COMMANDS["info"].capitalize() + ".")
    p.add_argument("--json", action="store_true", help="print everything as one JSON document instead")
    p.set_defaults(func=_info)
    return p


def _redacted(settings: Any) -> dict[str, Any]:
    """The service settings in force (``MPFLOW_*``), secrets left out: the API keys as a count, a store URL's
    password as ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    out = settings.model_dump()
    out["api_keys"] = f"{len(settings.api_key_tenants)} key(s)" if settings.api_keys else ""
    url = settings.redis_url
    if url and urlsplit(url).password:
        parts = urlsplit(url)
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        out["redis_url"] = urlunsplit(parts._replace(netloc=netloc))
    return out


def _accuracy(metrics: dict[str, Any]) -> str:
    """An operator's held-out accuracy in words, from its evaluation (``mpflow evaluate --write-registry``), or a
    ring observer's validation (``observer_train``), or a parameter observer's (``param_observer_train``)."""
    if "best_loss" in metrics:  # a parameter observer (smc2's mh kernel): its held-out calibration
        v = metrics.get("validation") or {}
        cover = [f"{k[: -len('_coverage90')]} {x:.2f}" for k, x in v.items() if k.endswith("_coverage90")]
        return f"parameter observer for smc2's mh kernel: held-out 90 % coverage {', '.join(cover) or 'not measured'}"
    if "validation" in metrics:  # a ring observer (ienkf's relock): its validation on the two published regimes
        v = metrics["validation"]
        return (
            f"observer for ienkf's relock: validation RMSE {v['spantini2019_rmse']:.3f} (spantini2019), "
            f"{v['sakov2008_rmse']:.3f} (sakov2008)"
        )
    results = (metrics.get("evaluation") or {}).get("results") or []
    mpf = [r for r in results if r.get("method") == "mpf"]
    if not mpf:
        if "val_loss_best" not in metrics:
            return "not evaluated"
        return (
            f"no held-out evaluation (mpflow evaluate); validation loss {metrics['val_loss_untrained']:.4f} "
            f"untrained → {metrics['val_loss_best']:.4f}"
        )
    r = mpf[-1]
    summary = r["summary"]
    return (
        f"mean error {summary['mean_error_sd']['avg']:.3f} posterior sd, variance ratio "
        f"{summary['var_ratio']['avg']:.2f} ({r['particles']} particles)"
    )


#: what an empty setting means
_UNSET = {
    "redis_url": "not set: an embedded Redis under data_dir",
    "api_keys": "not set: no authentication",
    "operator_dirs": "not set: the shipped operators only",
}


def _info_text(families: list[dict], methods: list[str], operators: list[dict], settings: dict) -> str:
    lines = ["Model families (mpflow filter --family NAME; the service's model.family):"]
    for f in families:
        dims = f["state_dim"]
        d = f"d = {dims['fixed']}" if dims["fixed"] else f"d = {dims['min']}..{dims['max']}"
        lines.append(f"  {f['family']:<24}{f['description']}")
        lines.append(f"  {'':<24}{d}; one observation: {f['observation']}")
        params = ", ".join(
            p["name"] + ("" if p["required"] else f" = {p['default']}" if p["default"] else " (optional)")
            for p in f["parameters"]
        )
        lines.append(f"  {'':<24}parameters: {params or 'none'}")
        lines.append(f"  {'':<24}methods: {', '.join(f['methods'])}")
    lines += ["", f"Methods: {', '.join(methods)} (docs/methods.md explains each)", ""]
    lines += _operator_lines(operators)
    lines += ["", "Service settings in force (environment variables MPFLOW_<NAME>):"]
    lines += [
        f"  {name:<30}{_UNSET.get(name, 'not set') if value in (None, '') else json.dumps(value)}"
        for name, value in settings.items()
    ]
    return "\n".join(lines)


def _operator_lines(operators: list[dict]) -> list[str]:
    """The operators as ``GET /v1/operators`` gives them, in two groups by ``auto_select``, each with why."""
    picked = [o for o in operators if o["auto_select"]]
    named = [o for o in operators if not o["auto_select"]]
    lines = ["Trained operators picked by method mpf for a stream of their family and d that names none (auto_select):"]
    for o in picked:
        lines.append(f"  {o['name']:<30}{o['family']}, d = {o['state_dim']}: {_accuracy(o['metrics'])}")
        if o["auto_select_note"]:
            lines.append(f"  {'':<30}why: {o['auto_select_note']}")
    if not picked:
        lines.append("  none (mpf runs its untrained base flow unless a stream names an operator)")
    if named:
        lines += ["", "Trained operators that serve only a stream naming them (auto_select: false):"]
    for o in named:
        lines.append(f"  {o['name']:<30}{o['family']}, d = {o['state_dim']}: {_accuracy(o['metrics'])}")
        lines.append(f"  {'':<30}why: {o['auto_select_note'] or 'its config.json says so (no note)'}")
    return lines


def _catalogue(operator_dirs: list[str], max_state_dim: int) -> dict[str, Any]:
    """Families, methods and operators as the service lists them (imports torch: :mod:`mpflow.cli.info_cache`
    keeps the result)."""
    from mpflow.operators.updaters import UPDATERS
    from mpflow.service.engine import catalogue

    operators = catalogue.OperatorCatalogue(operator_dirs)
    operators.load()
    return {
        "families": catalogue.models(max_state_dim),
        "methods": {name: {"defaults": cls.defaults, "weighted": cls.weighted} for name, cls in UPDATERS.items()},
        "operators": json.loads(json.dumps(operators.to_json(), default=str)),
    }


def _default_catalogue() -> dict[str, Any]:
    """:func:`_catalogue` under the default settings, with those settings (``"settings"``, redacted)."""
    from mpflow.service.settings import Settings

    settings = Settings()
    shown = json.loads(json.dumps(_redacted(settings), default=str))  # as the cache keeps it
    return {**_catalogue([], settings.max_state_dim), "settings": shown}


def _info(args: argparse.Namespace) -> int:
    """The catalogue and the settings from the cache (:mod:`mpflow.cli.info_cache`); the settings module is
    imported only when some ``MPFLOW_*`` variable is set."""
    from mpflow.cli.info_cache import cached_catalogue, service_env

    if service_env():
        from mpflow.service.settings import Settings

        settings = Settings()
        dirs, max_d = settings.operator_dir_list, settings.max_state_dim
        found = {**cached_catalogue(dirs, max_d, lambda: _catalogue(dirs, max_d)), "settings": _redacted(settings)}
    else:
        found = cached_catalogue([], None, _default_catalogue)
    if args.json:
        print(json.dumps(found, indent=2, default=str))
    else:
        print(_info_text(found["families"], sorted(found["methods"]), found["operators"], found["settings"]))
    return 0


# ---------------------------------------------------------------------------------------------- filter
def _add_filter(sub: Any) -> argparse.ArgumentParser:
    # no choices: listing the families and methods imports torch, and --help stays fast without it (unknown names
    # are refused naming the known ones)
    p = sub.add_parser("filter", help=COMMANDS["filter"], description=_filter.__doc__)
    p.add_argument("--family", default="linear_gaussian", help="model family (mpflow info lists them)")
    p.add_argument(
        "--method",
        help="inference method (mpflow info lists them; default: the one the service gives a stream of this model, "
        "its measured default, with its particle count; mpf when --operator is given)",
    )
    p.add_argument(
        "--operator",
        help="method mpf: a trained operator, by name (mpflow info lists them) or folder (default: the newest one "
        "for --family and --dim; the untrained base flow when none fits)",
    )
    p.add_argument("--dim", type=int, help="state dimension d (default: the family's demonstration d, e.g. 2)")
    p.add_argument("--particles", type=int, help="particles N (default: the method's measured N, else 256)")
    p.add_argument("--steps", type=int, default=20, help="observations to simulate and filter")
    p.add_argument("--seed", type=int, default=0, help="seed of the method (the simulation uses seed + 1)")
    p.add_argument(
        "--params",
        type=json_object("--params"),
        help="model parameters as a JSON object (default: the family's example parameters; lds: A = 0.9 I, B = I)",
    )
    from mpflow.cli import filter_data

    filter_data.add_options(p)
    p.set_defaults(func=_filter)
    return p


def _filter(args: argparse.Namespace) -> int:
    """Simulate --steps observations of a model family, filter them with a method (by default the one the service
    would choose) and print each step: update time, log-evidence and, for linear-Gaussian families, the error
    against the exact (Kalman) posterior. With --data FILE --model model.json: filter a CSV or Parquet file instead
    (mpflow.cli.filter_data)."""
    if args.data is not None:
        from mpflow.cli import filter_data

        return filter_data.run(args)
    import torch

    from mpflow.cli.filter_method import filter_method
    from mpflow.operators.filtering import ExactPosterior, FilterStep, run_filter
    from mpflow.operators.models import family as family_class
    from mpflow.operators.models import make_model
    from mpflow.operators.models.priors import prior_from_spec
    from mpflow.operators.rng import generator

    cls = family_class(args.family)
    d = args.dim or cls.example_state_dim()
    params = {**cls.example_params(d), **(args.params or {})}
    model = make_model(args.family, params, d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    chosen = filter_method(args.method, args.operator, model, args.particles)
    updater = chosen.updater
    updater.check_compatible(model, prior)  # before the table's header: a method that cannot run prints only the error
    _, obs = model.simulate(args.steps, torch.ones(1, d), [generator(args.seed + 1)])
    exact = ExactPosterior.kalman(torch.zeros(1, d), torch.eye(d)[None], model, obs) if model.linear_gaussian else None
    print(chosen.note)
    print(f"{'step':>4} {'ms':>8} {'log Z':>10} {'mean err (sd)':>14} {'var ratio':>10}")

    def show(step: FilterStep) -> None:
        line = f"{step.t:>4} {step.ms:>8.2f} {float(step.state.log_evidence[0]):>10.3f}"
        if step.scores:
            err, ratio = float(step.scores["mean_error_sd"][0]), float(step.scores["var_ratio"][0])
            line += f" {err:>14.3f} {ratio:>10.3f}"
        print(line)

    result = run_filter(updater, model, prior, obs, chosen.particles, args.seed, exact, moments=False, on_step=show)
    if result.log_evidence_error is not None:
        print(f"log-evidence error vs Kalman: {float(result.log_evidence_error[0]):+.4f} nats")
    return 0


# ---------------------------------------------------------------------------------------------- train
def _init_distributed() -> tuple[int, int]:
    """Under ``torchrun`` (WORLD_SIZE > 1) join the process group — NCCL when CUDA is present, else gloo —
    and return (rank, world size); (0, 1) otherwise."""
    import os

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def _leave_distributed(world: int) -> None:
    """Under ``torchrun``, leave the process group once training needs no more collectives (every rank, at once):
    a rank that exits without ``destroy_process_group`` leaves gloo's worker threads holding tensors that the
    interpreter's shutdown frees without the GIL — a SIGABRT at exit, seen once in CI on rank 1 while rank 0 still
    wrote the operator (pytorch/pytorch#179291; the documented shutdown is this call, near the end of main)."""
    import torch.distributed as dist

    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def _init_network(name_or_dir: str, family: str, dim: int):
    """(record, a trainable copy of its network) of the operator ``--init-from`` names; it must be for the same
    family and dimension (SystemExit otherwise)."""
    import copy

    from mpflow.operators.registry import resolve
    from mpflow.operators.trained_operators import network_from_record

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
    import torch

    from mpflow.operators.models import family as family_class
    from mpflow.operators.mpf.network import MPFVelocity
    from mpflow.operators.registry import save_operator
    from mpflow.training.meta_train import meta_train, resolve_device
    from mpflow.training.tasks import sample_tasks
    from mpflow.training.train_summary import closing_summary, selection

    rank, world = _init_distributed()
    torch.set_num_threads(args.threads)
    task_kwargs = args.task_options or {}
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
        "loss": LOSS_DESCRIPTIONS[args.loss],
        "tbptt": args.tbptt,
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
        loss=args.loss,
        tbptt=args.tbptt,
    )
    _leave_distributed(world)
    if rank != 0:
        return 0
    improved = result["best_iteration"] > 0
    if not improved:
        print(no_improvement_warning(result, args.require_improvement), file=sys.stderr)
        if args.require_improvement:
            print(closing_summary(result, None), file=sys.stderr)
            return 3
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
    config = selection(config)  # auto_select false: nothing here compared it with its base at equal compute
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
    print(closing_summary(result, str(record.path)), file=sys.stderr)
    return 0


def no_improvement_warning(result: dict[str, Any], refused: bool) -> str:
    """What ``mpflow train`` says when the validation loss never went below the untrained network's (the best
    iteration is 0): the operator is no better than the base flow."""
    what = "nothing was saved (--require-improvement)" if refused else "the saved operator is the untrained network"
    return (
        "\n" + "!" * 100 + "\n"
        f"WARNING: the validation loss never improved on the untrained network's "
        f"({result['val_loss_untrained']:.4f}; best iteration 0 of {result['iterations']}): {what}.\n"
        "Train longer (--iterations), with another learning rate (--lr), or on more tasks (--batch).\n" + "!" * 100
    )


#: ``mpflow train --loss``: what the operator's config records as its training loss
LOSS_DESCRIPTIONS = {
    "kl": "MPF eq. 19 (cumulative; eq. 21 segments; dynamic families: per-step loss vs the predicted density)",
    "energy": "fair energy score of each step's cloud against the simulated truth, mean over the steps",
    "crps": "fair CRPS summed over the dimensions, of each step's cloud against the simulated truth, mean over steps",
    "predictive": "log score −log (1/N) Σ_j p(o_m | x̃_j) of each step's observation under the carried cloud, mean",
}


def _add_train(sub: Any) -> argparse.ArgumentParser:
    from mpflow.operators.mpf.daum_huang import LINEARISATIONS
    from mpflow.operators.mpf.network import RESIDUAL_GATES
    from mpflow.training.meta_train import LR_SCHEDULES
    from mpflow.training.tasks import TASK_FAMILIES

    t = sub.add_parser("train", help=COMMANDS["train"], description=COMMANDS["train"].capitalize() + ".")
    t.add_argument("--family", required=True, choices=sorted(TASK_FAMILIES), help="model family of the tasks")
    t.add_argument("--dim", type=int, required=True, help="state dimension d")
    t.add_argument("--iterations", type=int, required=True, help="training iterations (one batch of tasks each)")
    t.add_argument("--batch", type=int, default=8, help="tasks per iteration")
    t.add_argument("--steps-per-seq", type=int, default=10, help="observations per task (T)")
    t.add_argument("--particles", type=int, default=256, help="particles per task")
    t.add_argument("--out", required=True, help="registry folder to save the operator in")
    t.add_argument("--seed", type=int, default=0, help="seed of the tasks and the initial weights")
    t.add_argument("--resume", action="store_true", help="continue from OUT/_training/<family>-d<d>-seed<S>.pt")
    t.add_argument(
        "--init-from",
        help="start from this registered operator's weights and architecture (a name or folder): fine-tuning",
    )
    t.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    t.add_argument(
        "--lr-schedule", default="constant", choices=LR_SCHEDULES, help="cosine: annealed to 0 over --iterations"
    )
    t.add_argument("--weight-decay", type=float, default=1e-5, help="AdamW weight decay")
    t.add_argument("--ode-steps", type=int, default=1, help="RK4 steps per observation")
    t.add_argument("--val-every", type=int, default=10, help="validate every this many iterations")
    t.add_argument("--val-tasks", type=int, default=16, help="held-out validation tasks")
    t.add_argument("--hidden", type=int, default=64, help="width of the network's hidden layers")
    t.add_argument("--layers", type=int, default=3, help="hidden layers")
    t.add_argument("--embed", type=int, default=64, help="width of the observation-set embedding")
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
        help="Gaussian fit of a non-Gaussian likelihood for the base flow: stein (scores at the prior), posterior "
        "(re-fitted at the posterior it gives) or importance (reweighted moments)",
    )
    t.add_argument("--segment", type=int, default=None, help="cut sequences every S steps (default: no cuts)")
    t.add_argument(
        "--segment-prior", default="kde", choices=["kde", "kde-shrunk", "gaussian"], help="prior of a segment"
    )
    t.add_argument(
        "--predicted-prior",
        default="gaussian",
        choices=["kde", "kde-shrunk", "gaussian"],
        help="dynamic families' step prior",
    )
    t.add_argument(
        "--loss",
        default="kl",
        choices=list(LOSS_DESCRIPTIONS),
        help="kl: MPF eq. 19 (the paper's); energy: the energy score of each step's cloud against the simulated "
        "truth; crps: the CRPS summed over the dimensions; predictive: the log score of each observation under the "
        "cloud carried to it, minus the step's log-evidence estimate (strictly proper scores: no divergence)",
    )
    t.add_argument(
        "--tbptt", type=int, default=None, help="a score loss: detach the cloud every K steps (default: never)"
    )
    t.add_argument("--curriculum", type=float, default=0.0, help="fraction of the run over which T grows from 1")
    t.add_argument(
        "--task-options",
        type=json_object("--task-options"),
        help="task distribution options as a JSON object (training.tasks.TASK_OPTIONS)",
    )
    t.add_argument("--adjoint", action="store_true", help="adjoint-method gradients (O(1) memory in ODE steps)")
    t.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    t.add_argument(
        "--min-improvement", type=float, default=0.0, help="relative validation gain needed to replace the best θ"
    )
    t.add_argument("--max-minutes", type=float, help="stop after this much training time (validates first)")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    t.add_argument(
        "--require-improvement",
        action="store_true",
        help="save nothing and exit with status 3 when the validation loss never improved on the untrained network",
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)
    return t


# ---------------------------------------------------------------------------------------------- the others
def _add_evaluate(sub: Any) -> argparse.ArgumentParser:
    from mpflow.training import evaluate

    return _from_module(sub, "evaluate", evaluate.add_parser, evaluate)


def _add_fit_sampler(sub: Any) -> argparse.ArgumentParser:
    from mpflow.training import fit_sampler

    return _from_module(sub, "fit-sampler", fit_sampler.add_parser, fit_sampler)


def _add_serve(sub: Any) -> argparse.ArgumentParser:
    from mpflow.cli import serve

    serve.add_parser(sub)
    return sub.choices["serve"]


def _from_module(sub: Any, command: str, add_parser: Callable[[Any], None], module: Any) -> argparse.ArgumentParser:
    """The parser a module registers, with its docstring's first paragraph as the description (the rest, the
    method in full, is for ``python -m pydoc``)."""
    add_parser(sub)
    p = sub.choices[command]
    p.description = _first_paragraph(module.__doc__)
    p.epilog = f"In full: python -m pydoc {module.__name__}"
    return p


_BUILDERS: dict[str, Callable[[Any], argparse.ArgumentParser]] = {
    "info": _add_info,
    "filter": _add_filter,
    "train": _add_train,
    "evaluate": _add_evaluate,
    "fit-sampler": _add_fit_sampler,
    "serve": _add_serve,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mpflow`` parser with ``command``'s options in full; the other commands are listed by name and help
    only, so nothing they need is imported."""
    parser = argparse.ArgumentParser(
        prog="mpflow", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, line in COMMANDS.items():
        if name == command:
            _finish(_BUILDERS[name](sub), name)
        else:
            sub.add_parser(name, help=line)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has no options but --help
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
