"""Held-out evaluation of a trained MPF operator against exact or long-run references (MPF §5, App. C.1).

    mpflow evaluate --operator NAME_OR_DIR [--quick] --out DIR [--particles 64,256] [--tasks 5] [--steps T]

1. **Tasks.** ``n_tasks`` new tasks of the operator's family and dimension from
   :func:`mpflow.training.tasks.sample_tasks` with the task keyword arguments the operator was trained with
   (``config["training"]["task_kwargs"]``), drawn from ``torch.Generator().manual_seed(seed)``; the default
   ``EVAL_SEED = 2**41 + 17`` cannot coincide with meta-training's seeds (``s·1_000_003 + 2i + 1``) or its
   validation seed (``s·1_000_003``) for any training seed s < 2**20, so the tasks (for ``lds`` their A, B
   too) are unseen. T and the particle counts default to the family's (``eval_steps`` of its task distribution,
   :mod:`mpflow.training.task_distribution`: the paper's sequence lengths, and ``eval_particles``).
2. **Reference** posterior p_t = p(x_t | o_1..t) at every step t:
   * linear-Gaussian families (``linear_gaussian``, ``lds``) with a Gaussian prior: the exact Kalman filter in float64
     (:func:`mpflow.operators.references.kalman_filter`; for static families its predict step is the identity, so
     it is the conjugate posterior), with ``REF_SAMPLES`` draws of N(μ_t, Σ_t) from a fixed generator;
   * otherwise a long-run particle reference with ``REF_PARTICLES`` = 10⁵ particles (10⁴ with ``--quick``):
     for static families importance sampling from the prior, w ∝ Π_{s≤t} p(o_s | x) (the ``smc`` updater
     with ``ess_threshold=0``: consistent, no resampling/rejuvenation kernel that would smear a multimodal
     posterior; measured on gmm, T = 30, 10⁵ particles: variances within 1% of a fine-grid exact posterior,
     where the resampling ``smc`` with Liu–West moves was 2–5% low), unless its effective sample size falls
     below the number of reference samples (e.g. ``logistic``: the prior is far from the late posteriors) —
     then the resampling ``smc`` updater; for dynamic families the bootstrap particle filter (``smc``).
     ``REF_SAMPLES`` draws are resampled by weight; the reference's kind and ESS are reported.
3. **Methods** ``mpf`` (the operator), ``smc`` and ``gpf`` run batched over the tasks (one independent
   stream per task, ``Updater.init(prior, model, N, seed=[...])``) at each particle count N, through
   :func:`mpflow.operators.filtering.run_filter`. After every update, with m_q, C_q the (weighted) particle
   moments (float64):
   * ``mean_error_sd``  sqrt(mean_d ((m_q,d − μ_t,d) / σ_t,d)²)  (:func:`mpflow.operators.accuracy.mean_error_sd`);
   * ``var_ratio``      C_q,dd / Σ_t,dd per dimension (``var_ratio`` is its mean over d);
   * ``mmd2``           unbiased MMD² of the particles against the reference samples (App. C.1);
   * ``cross_entropy``  H(p_t, q̂) = −mean_m log q̂(y_m), y_m ~ p_t, q̂ the KDE of the particles (eq. 30;
     lower is better, ≥ H(p_t), which is reported for Gaussian references);
   * ``logz_increment_error``  |log p̂(o_t | o_<t) − log p(o_t | o_<t)| against Kalman (exact) or the
     particle reference's estimate;
   * ``ms_per_update``  wall time of one batched ``update`` call (B streams), median over steps;
   * families with known posterior modes (``ModelFamily.posterior_modes``; ``gmm``: x and (x₁ + x₂, −x₂),
     (1, −2) and (−1, 2) in the paper's setting, §5.2): the fraction of (weighted) particles nearer to each.
4. **Output** ``metrics.json`` (settings, operator name and content hash, per (method, N) a summary —
   averages over steps and tasks with the standard error over tasks, values at steps 10/50/100 — and the
   per-step curves), PNG plots (:mod:`mpflow.training.eval_plots`), a table on stdout. ``--write-registry`` merges
   the summary into the operator folder's ``metrics.json`` under ``"evaluation"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import accuracy, gaussian
from mpflow.operators.filtering import ExactPosterior, FilterStep, run_filter
from mpflow.operators.models import FAMILIES
from mpflow.operators.models.gmm import GMM
from mpflow.operators.mpf.network import MPFVelocity
from mpflow.operators.registry import METRICS_FILE, OperatorRecord, resolve
from mpflow.operators.rng import generator
from mpflow.operators.updaters import NonFiniteError, Updater, get_updater
from mpflow.training import eval_plots
from mpflow.training.eval_types import MethodRun, Reference, slice_model, slice_prior
from mpflow.training.task_distribution import task_distribution
from mpflow.training.tasks import Tasks, sample_tasks

EVAL_SEED = 2**41 + 17
#: family → default T and particle counts (read from the task distributions: ``eval_steps``, ``eval_particles``)
DEFAULT_STEPS = {name: task_distribution(name).eval_steps for name in FAMILIES}
DEFAULT_PARTICLES: dict[str, tuple[int, ...]] = {name: task_distribution(name).eval_particles for name in FAMILIES}
#: "mpf-base" is the operator's untrained base flow (the Daum–Huang flow alone, zero residual): the
#: difference to "mpf" is what meta-training added
DEFAULT_METHODS = ("mpf", "mpf-base", "smc", "gpf")
DEFAULT_TASKS = 5
REPORT_STEPS = (10, 50, 100)
SNAPSHOT_STEPS = (1, 2, 5, 10, 20, 30)
REF_PARTICLES, REF_PARTICLES_QUICK = 100_000, 10_000
REF_SAMPLES, REF_SAMPLES_QUICK = 1000, 500
QUICK_TASKS, QUICK_MAX_STEPS = 2, 10
REF_CHUNK_ELEMENTS = 1 << 23  # reference particle clouds are run in task chunks of about this many numbers
METRICS = ("mean_error_sd", "var_ratio", "mmd2", "cross_entropy", "logz_increment_error")
# seed streams derived from the evaluation seed (the tasks use the seed itself)
_STREAM_METHODS, _STREAM_REF_PARTICLES, _STREAM_REF_SAMPLES, _STREAM_PLOTS = 1, 2, 3, 4


# ----------------------------------------------------------------------------------------------------------
# operator and tasks


def operator_record(record_or_dir: OperatorRecord | str | Path) -> OperatorRecord:
    """An :class:`OperatorRecord` as is, else :func:`mpflow.operators.registry.resolve` (a name or a folder)."""
    return record_or_dir if isinstance(record_or_dir, OperatorRecord) else resolve(record_or_dir)


def mpf_updater(record: OperatorRecord) -> Updater:
    """The ``mpf`` updater running ``record``'s network with its solver settings (from its config)."""
    return get_updater("mpf", operator=str(record.path))


def method_updater(method: str, record: OperatorRecord) -> Updater:
    """ "mpf" → the operator, "mpf-base" → its untrained base flow (a zero-residual network of the operator's
    architecture: the same linearisation), anything else → that registered method."""
    if method == "mpf":
        return mpf_updater(record)
    if method == "mpf-base":
        return get_updater("mpf", network=MPFVelocity(record.state_dim, **record.config["architecture"]).eval())
    return get_updater(method)


def task_kwargs(record: OperatorRecord) -> dict[str, Any]:
    """The task distribution's keyword arguments the operator was meta-trained with ({} = the defaults)."""
    return dict(record.config.get("training", {}).get("task_kwargs", {}) or {})


def held_out_tasks(record: OperatorRecord, n_tasks: int, T: int, seed: int = EVAL_SEED) -> Tasks:
    """``n_tasks`` evaluation tasks of T steps from the operator's training task distribution."""
    gen = torch.Generator().manual_seed(seed)
    return sample_tasks(record.family, record.state_dim, n_tasks, T, gen, **task_kwargs(record))


def _derived_seeds(seed: int, stream: int, n: int) -> list[int]:
    """n seeds for one purpose (``stream``), independent of the other purposes' seeds."""
    gen = generator((seed * 7919 + stream) % 2**63)
    return torch.randint(0, 2**62, (n,), generator=gen).tolist()


def gmm_modes(x_true: torch.Tensor) -> torch.Tensor:
    """The two posterior modes of the gmm family for true states x [B, 2] → [B, 2, 2] (:meth:`GMM.posterior_modes`)."""
    return GMM.posterior_modes(x_true)


def mode_fractions(x: torch.Tensor, log_weights: torch.Tensor | None, modes: torch.Tensor) -> torch.Tensor:
    """Weight of the particles x [B, N, d] nearest to each mode [B, K, d] → [B, K] (rows sum to 1)."""
    d2 = ((x.to(torch.float64)[:, :, None] - modes[:, None]) ** 2).sum(-1)  # [B, N, K]
    nearest = torch.nn.functional.one_hot(d2.argmin(-1), modes.shape[1]).to(torch.float64)
    B, N = x.shape[:2]
    w = (
        torch.full((B, N), 1.0 / N, dtype=torch.float64)
        if log_weights is None
        else torch.softmax(log_weights.to(torch.float64), -1)
    )
    return torch.einsum("bn,bnk->bk", w, nearest)


# ----------------------------------------------------------------------------------------------------------
# references


def kalman_reference(tasks: Tasks, n_samples: int, seed: int) -> Reference:
    """Exact filtering posteriors of linear-Gaussian tasks and ``n_samples`` draws of each."""
    mean0, cov0 = tasks.prior.moments()
    exact = ExactPosterior.kalman(mean0, cov0, tasks.model, tasks.obs)
    means, covs, log_z = exact.means, exact.covs, exact.log_z
    B, T, d = means.shape
    chol = gaussian.cholesky(covs.flatten(0, 1)).unflatten(0, (B, T))
    gen = generator(_derived_seeds(seed, _STREAM_REF_SAMPLES, 1)[0])
    z = torch.randn(B, T, n_samples, d, generator=gen, dtype=torch.float64)
    samples = means[:, :, None] + z @ chol.transpose(-1, -2)
    return Reference("kalman", means, covs, log_z, samples)


def particle_reference(
    tasks: Tasks, n_particles: int, n_samples: int, seed: int, *, resample: bool | None = None
) -> Reference:
    """A long-run particle reference (module docstring, item 2), run in task chunks to bound memory.

    ``resample``: None = importance sampling for static families, the bootstrap filter for dynamic ones;
    True = the ``smc`` updater with its resampling (and, for static families, Liu–West rejuvenation)."""
    static = not tasks.model.dynamic
    importance = static if resample is None else not resample
    updater = get_updater("smc", ess_threshold=0.0) if importance else get_updater("smc")
    B, T = tasks.obs.shape[:2]
    d = tasks.prior.dim
    seeds = _derived_seeds(seed, _STREAM_REF_PARTICLES, B)
    gen = generator(_derived_seeds(seed, _STREAM_REF_SAMPLES, 1)[0])
    modes = tasks.model.posterior_modes(tasks.x_true)
    per_chunk = max(1, REF_CHUNK_ELEMENTS // (n_particles * max(d, math.prod(tasks.model.obs_shape))))
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("means", "covs", "log_z", "samples", "ess", "modes")}
    for lo in range(0, B, per_chunk):
        sl = slice(lo, min(B, lo + per_chunk))

        def draw(step: FilterStep, sl: slice = sl) -> dict[str, torch.Tensor]:
            """``n_samples`` draws of the weighted cloud (and the mode fractions)."""
            x, lw = step.state.particles.to(torch.float64), step.state.log_weights.to(torch.float64)
            idx = torch.multinomial(torch.softmax(lw, -1), n_samples, replacement=True, generator=gen)
            extra = {"samples": torch.gather(x, 1, idx[..., None].expand(-1, -1, d))}
            if modes is not None:
                extra["modes"] = mode_fractions(x, lw, modes[sl])
            return extra

        prior = slice_prior(tasks.prior, sl)
        run = run_filter(
            updater, slice_model(tasks.model, sl), prior, tasks.obs[sl], n_particles, seeds[sl], on_step=draw
        )
        rows = {
            "means": run.means,
            "covs": run.covs,
            "log_z": run.log_evidence_increments.to(torch.float64),
            "ess": run.ess.to(torch.float64),
            **run.values,
        }
        for k, v in rows.items():  # [T, b, ...] → [b, T, ...]
            out[k].append(v.transpose(0, 1).contiguous())
    cat = {k: torch.cat(v) if v else None for k, v in out.items()}
    kind = "importance" if importance else "smc"
    return Reference(
        kind, cat["means"], cat["covs"], cat["log_z"], cat["samples"], n_particles, cat["ess"], cat["modes"]
    )


def reference(tasks: Tasks, *, quick: bool, seed: int) -> Reference:
    """Kalman for linear-Gaussian tasks with a Gaussian prior, else the long-run particle reference."""
    n_samples = REF_SAMPLES_QUICK if quick else REF_SAMPLES
    if tasks.model.linear_gaussian and tasks.prior.weights.shape[1] == 1:
        return kalman_reference(tasks, n_samples, seed)
    n_particles = REF_PARTICLES_QUICK if quick else REF_PARTICLES
    ref = particle_reference(tasks, n_particles, n_samples, seed)
    if ref.kind == "importance" and float(ref.ess.min()) < n_samples:
        # the prior is too far from the late posteriors for importance sampling: resample and rejuvenate
        ref = particle_reference(tasks, n_particles, n_samples, seed, resample=True)
    return ref


# ----------------------------------------------------------------------------------------------------------
# running one method


def sample_metrics(x: torch.Tensor, log_weights: torch.Tensor, ref: Reference, t: int) -> dict[str, torch.Tensor]:
    """The metrics against the reference samples of step index t (0-based) of the clouds x [B, N, d] → each [B]:
    ``mmd2`` and ``cross_entropy`` (module docstring; the moment metrics come from
    :func:`mpflow.operators.filtering.run_filter`)."""
    x = x.to(torch.float64)
    lw = log_weights.to(torch.float64)
    samples = ref.samples[:, t]
    return {
        "mmd2": accuracy.mmd2(x, samples, x_log_weights=lw),
        "cross_entropy": accuracy.cross_entropy(samples, x, q_log_weights=lw),
    }


def run_method(
    method: str,
    updater: Updater,
    tasks: Tasks,
    N: int,
    seeds: list[int],
    ref: Reference,
    *,
    snapshot_steps: Sequence[int] = (),
    bar=None,
) -> MethodRun:
    """Filter every task's observations with ``updater`` (B streams in one batch, :func:`run_filter`) and score
    each step; a NonFiniteError or ValueError ends the run early and is reported in ``MethodRun.error``."""
    run = MethodRun(method, N)
    modes = tasks.model.posterior_modes(tasks.x_true)

    def score(step: FilterStep) -> dict[str, torch.Tensor]:
        state = step.state
        vals = sample_metrics(state.particles, state.log_weights, ref, step.t - 1)
        if modes is not None:
            vals["mode_fraction"] = mode_fractions(state.particles, state.log_weights, modes)
        if step.t in snapshot_steps:
            run.snapshots[step.t] = (state.particles[0].clone(), state.log_weights[0].clone())
        if bar is not None:
            bar.update(1)
        return vals

    result = run_filter(
        updater, tasks.model, tasks.prior, tasks.obs, N, seeds, ref, on_step=score, catch=(NonFiniteError, ValueError)
    )
    run.values, run.ms, run.error = result.values, result.ms, result.error
    if result.error is not None and bar is not None:  # report the failure, keep evaluating the other methods
        bar.update(tasks.length - result.steps)
    return run


# ----------------------------------------------------------------------------------------------------------
# summaries


def _num(v: float | torch.Tensor) -> float | None:
    """A JSON number (None for NaN / ±inf)."""
    v = float(v)
    return v if math.isfinite(v) else None


def _floats(t: torch.Tensor) -> list:
    return [None if not math.isfinite(v) else v for v in t.tolist()] if t.dim() == 1 else [_floats(r) for r in t]


def _sem(per_task: torch.Tensor) -> float | None:
    """Standard error over tasks of per-task values [B]."""
    B = per_task.shape[0]
    return _num(per_task.std(unbiased=True) / math.sqrt(B)) if B > 1 else None


def report_steps(T: int) -> list[int]:
    """The steps a summary reports for a T-step run: :data:`REPORT_STEPS` up to T, and T itself (the final
    posterior, e.g. gmm "after 30 observations")."""
    return sorted({s for s in REPORT_STEPS if s <= T} | ({T} if T > 0 else set()))


def summarize_run(run: MethodRun) -> dict[str, Any]:
    """Summary (averages over steps and tasks, SE over tasks, values at :func:`report_steps` and the SE over
    tasks at the final step) and curves."""
    T = next(iter(run.values.values())).shape[0] if run.values else 0
    summary: dict[str, Any] = {"steps_completed": T}
    curves: dict[str, Any] = {}
    for name in METRICS:
        v = run.values.get(name)
        if v is None:
            continue
        summary[name] = {
            "avg": _num(v.mean()),
            "sem": _sem(v.mean(0)),
            "at": {str(s): _num(v[s - 1].mean()) for s in report_steps(T)},
            "sem_final": _sem(v[-1]),
        }
        curves[name] = _floats(v.mean(1))
        curves[f"{name}_sem"] = _floats(v.std(1) / math.sqrt(v.shape[1])) if v.shape[1] > 1 else None
    if "var_ratio_per_dim" in run.values:
        curves["var_ratio_per_dim"] = _floats(run.values["var_ratio_per_dim"].mean(1))
    if "mode_fraction" in run.values:
        mf = run.values["mode_fraction"].mean(1)  # [T, K]
        curves["mode_fraction"] = _floats(mf)
        summary["mode_fraction_final"] = _floats(mf[-1])
    summary["ms_per_update"] = statistics.median(run.ms) if run.ms else None
    out: dict[str, Any] = {"method": run.method, "particles": run.particles, "summary": summary, "curves": curves}
    if run.error:
        out["error"] = run.error
    return out


def reference_summary(ref: Reference) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": ref.kind, "samples": ref.samples.shape[2]}
    if ref.particles is not None:
        out["particles"] = ref.particles
    if ref.ess is not None:
        out["ess_min"] = _num(ref.ess.min())
        out["ess_curve"] = _floats(ref.ess.mean(0))
    entropy = ref.entropy()
    if entropy is not None:
        out["entropy_curve"] = _floats(entropy.mean(0))
    if ref.mode_fraction is not None:
        out["mode_fraction_curve"] = _floats(ref.mode_fraction.mean(0))
    return out


# ----------------------------------------------------------------------------------------------------------
# the evaluation


def evaluate(
    record_or_dir: OperatorRecord | str | Path,
    *,
    quick: bool = False,
    out: str | Path | None = None,
    particles: Sequence[int] | None = None,
    tasks: int | None = None,
    steps: int | None = None,
    methods: Sequence[str] = DEFAULT_METHODS,
    seed: int = EVAL_SEED,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate an operator on held-out tasks (module docstring); write metrics.json and plots to ``out``.

    Returns the metrics dict (as written to ``out/metrics.json``)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    record = operator_record(record_or_dir)
    family = record.family
    unknown = sorted(set(methods) - {"mpf-base", *get_methods()})
    if unknown or not methods:
        raise ValueError(f"methods: unknown method(s) {unknown}; choose from {['mpf-base', *get_methods()]}")
    n_tasks = tasks if tasks is not None else (QUICK_TASKS if quick else DEFAULT_TASKS)
    T = steps if steps is not None else task_distribution(family).eval_steps
    if quick:
        T = min(T, QUICK_MAX_STEPS)
    Ns = tuple(particles) if particles else task_distribution(family).eval_particles
    for name, value in (("tasks", n_tasks), ("steps", T), *(("particles", n) for n in Ns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    data = held_out_tasks(record, n_tasks, T, seed)
    ref = reference(data, quick=quick, seed=seed)
    seeds = _derived_seeds(seed, _STREAM_METHODS, n_tasks)
    runs: list[MethodRun] = []
    bar = tqdm(total=len(Ns) * len(methods) * T, desc="evaluate", unit="step", disable=not progress, file=sys.stderr)
    for i, N in enumerate(Ns):
        for method in methods:
            bar.set_postfix_str(f"{method} N={N}")
            updater = method_updater(method, record)
            snap = SNAPSHOT_STEPS if i == 0 else ()
            runs.append(run_method(method, updater, data, N, seeds, ref, snapshot_steps=snap, bar=bar))
    bar.close()

    result: dict[str, Any] = {
        "operator": {
            "name": record.name,
            "content_hash": record.content_hash,
            "path": str(record.path),
            "family": family,
            "state_dim": record.state_dim,
            "solver": record.config.get("solver"),
            "training": record.config.get("training"),
        },
        "settings": {
            "quick": quick,
            "tasks": n_tasks,
            "steps": T,
            "particles": list(Ns),
            "methods": list(methods),
            "seed": seed,
            "task_kwargs": task_kwargs(record),
            "report_steps": report_steps(T),
            "timing": "ms_per_update = median wall time of one update call over B = tasks streams",
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "reference": reference_summary(ref),
        "results": [summarize_run(r) for r in runs],
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        result["plots"] = eval_plots.write_plots(result, runs, data, ref, out, seed=seed)
    result["wall_s"] = time.perf_counter() - start
    if out is not None:
        _write_json(Path(out) / "metrics.json", result)
    return result


def get_methods() -> list[str]:
    from mpflow.operators.updaters import UPDATERS

    return sorted(UPDATERS)


# ----------------------------------------------------------------------------------------------------------
# output


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (a temp file in the same folder, then rename); NaN/inf are refused."""
    text = json.dumps(obj, indent=2, default=str, allow_nan=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def registry_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The compact evaluation entry of an operator's metrics.json (no curves)."""
    keep = ("quick", "tasks", "steps", "particles", "seed", "task_kwargs")
    return {
        "created": result["created"],
        "settings": {k: result["settings"][k] for k in keep},
        "reference": {k: v for k, v in result["reference"].items() if not k.endswith("_curve")},
        "results": [
            {k: r[k] for k in ("method", "particles", "summary", "error") if k in r} for r in result["results"]
        ],
    }


def write_registry(record: OperatorRecord, result: dict[str, Any]) -> Path:
    """Merge :func:`registry_summary` into ``record``'s metrics.json under "evaluation" (the content hash
    covers config and weights only, so it does not change)."""
    path = record.path / METRICS_FILE
    current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    current["evaluation"] = registry_summary(result)
    _write_json(path, current)
    return path


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None or not math.isfinite(v) else format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    """One line per (method, N): mean error, variance ratio at the report steps, MMD² (average and at the final
    step), cross-entropy, ms."""
    steps, last = result["settings"]["report_steps"], str(result["settings"]["steps"])
    head = ["method", "N", "mean err", *(f"var@{s}" for s in steps), "MMD²", f"MMD²@{last}", "x-ent", "logZ err"]
    head.append("ms/upd")
    lines = [" ".join(f"{h:>9}" for h in head)]
    for r in result["results"]:
        s = r["summary"]

        def avg(name: str, s=s) -> float | None:
            return s[name]["avg"] if name in s else None

        cells = [
            r["method"],
            str(r["particles"]),
            _fmt(avg("mean_error_sd")),
            *(_fmt(s["var_ratio"]["at"].get(str(k))) if "var_ratio" in s else "—" for k in steps),
            _fmt(avg("mmd2"), ".2e"),
            _fmt(s["mmd2"]["at"].get(last) if "mmd2" in s else None, ".2e"),
            _fmt(avg("cross_entropy")),
            _fmt(avg("logz_increment_error")),
            _fmt(s.get("ms_per_update"), ".2f"),
        ]
        lines.append(" ".join(f"{c:>9}" for c in cells) + (f"  ({r['error']})" if "error" in r else ""))
    ref = result["reference"]
    note = f"reference: {ref['kind']}" + (f", {ref['particles']} particles" if "particles" in ref else "")
    if ref.get("ess_min") is not None:
        note += f", min ESS {ref['ess_min']:.0f}"
    tasks, T = result["settings"]["tasks"], result["settings"]["steps"]
    lines.append(f"{note}; {tasks} tasks × {T} steps; ms/upd = one batched update of {tasks} streams")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _run_cli(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    record = operator_record(args.operator)
    result = evaluate(
        record,
        quick=args.quick,
        out=args.out,
        particles=args.particles,
        tasks=args.tasks,
        steps=args.steps,
        methods=[m for m in args.methods.split(",") if m],
        seed=args.seed,
        progress=not args.quiet,
    )
    print(f"operator {record.name} ({record.content_hash[:12]}), wall {result['wall_s']:.1f} s")
    print(format_table(result))
    print(f"wrote {Path(args.out) / 'metrics.json'} and {len(result.get('plots', []))} plots")
    if args.write_registry:
        print(f"merged the summary into {write_registry(record, result)}")
    return 0


def add_parser(subparsers) -> None:
    """Register ``mpflow evaluate`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate a trained MPF operator on held-out tasks against exact/long-run references",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--operator", required=True, help="a registered operator name or an operator folder")
    p.add_argument("--out", required=True, help="folder for metrics.json and the plots")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_TASKS} tasks, T ≤ {QUICK_MAX_STEPS}, small refs")
    p.add_argument("--particles", type=_int_list, help="comma-separated particle counts (default 256; lds 64,256,1024)")
    p.add_argument("--tasks", type=int, help=f"held-out tasks (default {DEFAULT_TASKS})")
    p.add_argument("--steps", type=int, help="observations per task (default: the paper's T for the family)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="evaluation seed (never a training seed)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (timings)")
    p.add_argument("--write-registry", action="store_true", help="merge the summary into the operator's metrics.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_cli)


__all__ = [
    "DEFAULT_PARTICLES",
    "DEFAULT_STEPS",
    "EVAL_SEED",
    "MethodRun",
    "Reference",
    "add_parser",
    "evaluate",
    "format_table",
    "held_out_tasks",
    "mode_fractions",
    "mpf_updater",
    "reference",
    "write_registry",
]
