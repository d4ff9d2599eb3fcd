"""``mpflow fit-sampler``: fit a GPVI generator to a prior density and cache it in a registry folder.

    mpflow fit-sampler --prior prior.json --out ./operators-local [--name NAME] [--iterations 3000] [--seed 0]

The prior is the API's JSON form (docs/API.md, ``prior``): ``gaussian`` or ``mixture`` — a density, whose score
∇x log p(x) = Σ_k r_k(x) Σ_k⁻¹ (μ_k − x) (:class:`mpflow.operators.models.priors.GaussianMixture`) drives GPVI
(Ratzlaff et al. 2021, Algorithm 1, :class:`mpflow.operators.samplers.gpvi.GPVIGenerator`). The generator is fitted
in the prior's whitened coordinates x = m + L y (m, C = L Lᵀ the exact mean and covariance; see
:mod:`mpflow.operators.samplers.cached`), so its start f(z) = z is already the moment-matched Gaussian q₀ = N(0, I).

Limits (measured with the defaults): GPVI only sees scores, which are blind to the mixing proportions of
well-separated modes (Wenliang & Kanagawa 2020; Song & Ermon 2019, §3.2), and reverse KL is mode-seeking:
started from q₀, the generator first drifts towards the heavier mode and then splits. With the defaults, on a
2-D two-component mixture whose means are ≈ 5.7 apart in the components' Mahalanobis distance the mode
weights come out within ≈ 0.05–0.1 (MMD² ≈ 0.03 vs 0.15 for N(m, C)); at ≈ 7.7 apart the generator stayed
collapsed on the heavier mode. ``metrics.json`` says which happened: compare
``mmd2.generator`` with ``mmd2.moment_matched_gaussian`` (the CLI warns when the generator is not better).

The result is written atomically to ``OUT/samplers/<name>/`` (:func:`mpflow.operators.registry.save_sampler`):
``config.json`` (GPVI architecture, the prior spec, its moments, the training settings), ``weights.safetensors``,
``metrics.json`` and ``README.md`` (the exact command). ``<name>`` is ``gpvi-d<d>-v<k>`` with the next free k,
``--name LABEL`` gives ``LABEL-d<d>-v<k>``, and a full ``LABEL-d<d>-v<k>`` is used as it is. Streams then start
from it with ``"prior": {"type": "sampler", "name": "<name>"}`` once OUT is in ``MPFLOW_OPERATOR_DIRS``.

metrics.json — held-out accuracy against the exact prior, ``EVAL_SAMPLES`` draws each, fresh seeds:

* ``mmd2.generator``     MMD² (:func:`mpflow.operators.accuracy.mmd2`, unbiased, 5 RBF kernels) of generator draws vs
                         exact prior draws;
* ``mmd2.noise_floor``   the same for a second, independent exact sample: what a perfect sampler scores;
* ``mmd2.moment_matched_gaussian``  the same for N(m, C): what ignoring the prior's shape scores;
* ``moments``            mean error in prior-sd units, ‖Δm‖₂, ‖ΔC‖_F, ‖ΔC‖_F / ‖C‖_F and per-dimension
                         variance ratios of the generator's draws against the exact (m, C), and the same
                         for the second exact sample (``moments_noise_floor``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import accuracy, gaussian, registry, rng
from mpflow.operators.models.priors import GaussianMixture, prior_from_spec
from mpflow.operators.registry import NAME_RE, SAMPLERS_DIR, OperatorRecord
from mpflow.operators.samplers.cached import MOMENTS_KEY, CachedSampler, score_in_whitened
from mpflow.operators.samplers.gpvi import GPVIGenerator
from mpflow.operators.validation import positive_int

F64 = torch.float64
DEFAULT_ITERATIONS = 3000
DEFAULT_PARTICLES = 128  # GPVI batch: z and z′ per step
DEFAULT_HIDDEN = (64, 64)
DEFAULT_LR = 1e-3
DEFAULT_FINAL_LR = 1e-4
EXACT_JACOBIAN_MAX_DIM = 16  # up to this d, J_f^{-T} by exact Jacobians (d backward passes) instead of the helper
EVAL_SAMPLES = 2000
EVAL_SEED_OFFSET = 1_000_003  # evaluation draws never share a seed with training
LABEL_RE = re.compile(r"^[a-z_]+$")


# ---- the fit --------------------------------------------------------------------------------------------


def density_prior(spec: Any) -> GaussianMixture:
    """The prior spec as a float64 :class:`GaussianMixture` (B = 1); ValueError unless it has a density."""
    if isinstance(spec, dict) and spec.get("type") in ("particles", "sampler"):
        raise ValueError(f"prior.type: fit-sampler needs a density (gaussian or mixture), got {spec['type']!r}")
    prior = prior_from_spec(spec, None, F64)
    assert isinstance(prior, GaussianMixture)
    return prior


def _family_and_name(out: Path, name: str | None, d: int) -> tuple[str, str | None]:
    """(family, folder name or None = the next free version, picked by :func:`registry.save_sampler`)."""
    if name is None or (isinstance(name, str) and LABEL_RE.match(name)):
        return name or "gpvi", None
    m = NAME_RE.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"name: expected a label [a-z_]+ or '<label>-d<d>-v<k>' (e.g. 'gpvi-d{d}-v1'), got {name!r}")
    if int(m["d"]) != d:
        raise ValueError(f"name: {name!r} says d = {m['d']} but the prior has dimension {d}")
    if (out / SAMPLERS_DIR / name).exists():
        raise ValueError(f"name: {out / SAMPLERS_DIR / name} already exists; pick another name or version")
    return m["family"], name


def sampler_metrics(sampler: CachedSampler, prior: GaussianMixture, n: int = EVAL_SAMPLES, seed: int = 0) -> dict:
    """Held-out accuracy of ``sampler`` against the exact ``prior`` (module docstring), all in float64."""
    n = positive_int("n", n)
    seeds = [seed + EVAL_SEED_OFFSET + i for i in range(4)]
    mean, cov = (t[0] for t in prior.moments())
    draws = sampler.sample(n, rng.generator(seeds[0]), F64)
    exact = prior.sample(n, [rng.generator(seeds[1])])[0]
    exact2 = prior.sample(n, [rng.generator(seeds[2])])[0]
    matched = GaussianMixture.gaussian(mean[None], cov[None]).sample(n, [rng.generator(seeds[3])])[0]

    def moment_errors(x: torch.Tensor) -> dict[str, Any]:
        m, c = gaussian.moments(x[None])
        dm, dc = accuracy.mean_cov_errors(m[0], c[0], mean, cov)
        return {
            "mean_error_sd": float(accuracy.mean_error_sd(m[0], mean, cov)),
            "mean_error": float(dm),
            "cov_error_fro": float(dc),
            "cov_error_rel": float(dc / torch.linalg.matrix_norm(cov)),
            "variance_ratio": accuracy.variance_ratio(c[0], cov).tolist(),
        }

    return {
        "samples": n,
        "seeds": seeds,
        "mmd2": {
            "generator": float(accuracy.mmd2(draws, exact)),
            "noise_floor": float(accuracy.mmd2(exact2, exact)),
            "moment_matched_gaussian": float(accuracy.mmd2(matched, exact)),
            "kernel": "sum of 5 RBF kernels, median heuristic x (0.25, 0.5, 1, 2, 4); unbiased U-statistic",
        },
        "moments": moment_errors(draws),
        "moments_noise_floor": moment_errors(exact2),
    }


def fit_command(prior_spec: dict, out: str | Path, name: str | None, **options: Any) -> str:
    """The self-contained ``mpflow fit-sampler`` command (inline prior JSON) that reproduces a fit. ``options``:
    iterations, particles, seed, hidden, lr, final_lr, eval_samples — all written out, so that the command
    stays exact if the defaults change."""
    args = ["mpflow", "fit-sampler", "--prior", json.dumps(prior_spec, separators=(",", ":")), "--out", str(out)]
    if name is not None:
        args += ["--name", name]
    for key in ("iterations", "particles", "seed", "hidden", "lr", "final_lr", "eval_samples"):
        value = options[key]
        args += [f"--{key.replace('_', '-')}", ",".join(map(str, value)) if key == "hidden" else str(value)]
    return shlex.join(args)


def _readme(family: str, d: int, command: str, argv_command: str | None, spec: dict, m: dict, fit: dict) -> str:
    mm = m["mmd2"]
    lines = [
        f"# GPVI sampler ({family}, d = {d})",
        "",
        "A GPVI generator (Ratzlaff et al. 2021) fitted to the prior density below, in the prior's whitened",
        "coordinates x = m + L f(z), z ~ N(0, I) (see `operators/samplers/cached.py`). Start a stream from it with",
        '`"prior": {"type": "sampler", "name": "<this folder\'s name>"}` once its registry root is in',
        "`MPFLOW_OPERATOR_DIRS`.",
        "",
        "Fitted with",
        "",
        f"    {command}",
        "",
    ]
    if argv_command and argv_command != command:
        lines += ["(as typed:", "", f"    {argv_command}", "", ")", ""]
    lines += [
        "Prior:",
        "",
        f"    {json.dumps(spec, separators=(',', ':'))}",
        "",
        f"Held-out accuracy ({m['samples']} draws each, `metrics.json`):",
        "",
        "| sample vs exact prior draws | MMD² |",
        "|---|---|",
        f"| this generator | {mm['generator']:.5f} |",
        f"| a second exact sample (noise floor) | {mm['noise_floor']:.5f} |",
        f"| moment-matched Gaussian | {mm['moment_matched_gaussian']:.5f} |",
        "",
        f"Mean error {m['moments']['mean_error_sd']:.3f} prior sd; relative covariance error "
        f"{m['moments']['cov_error_rel']:.3f} (exact sample: {m['moments_noise_floor']['mean_error_sd']:.3f}, "
        f"{m['moments_noise_floor']['cov_error_rel']:.3f}).",
        "",
        f"Fit: {fit['iterations']} iterations in {fit['seconds']:.1f} s.",
    ]
    return "\n".join(lines) + "\n"


def fit_sampler(
    prior_spec: dict,
    *,
    out: str | Path,
    name: str | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    particles: int = DEFAULT_PARTICLES,
    seed: int = 0,
    progress: bool = True,
    hidden: Sequence[int] = DEFAULT_HIDDEN,
    lr: float = DEFAULT_LR,
    final_lr: float = DEFAULT_FINAL_LR,
    eval_samples: int = EVAL_SAMPLES,
    argv_command: str | None = None,
) -> OperatorRecord:
    """Fit a GPVI generator to the density of ``prior_spec`` and save it under ``out/samplers/`` (module docstring).

    ``iterations`` GPVI steps (Algorithm 1) with ``particles`` noise draws z and z′ each, Adam with a learning
    rate decaying geometrically from ``lr`` to ``final_lr``; ``seed`` fixes the initial weights and every draw.
    ``name``: None (``gpvi-d<d>-v<next>``), a label ``[a-z_]+`` (``<label>-d<d>-v<next>``) or a full folder name.
    Returns the saved sampler's :class:`~mpflow.operators.registry.OperatorRecord`.
    """
    prior = density_prior(prior_spec)
    try:
        registry.canonical_json(prior_spec)  # stored in config.json
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prior: must be plain JSON ({exc})") from None
    d = prior.dim
    out = Path(out)
    iterations = positive_int("iterations", iterations)
    particles = positive_int("particles", particles)
    if particles < 2:
        raise ValueError("particles: at least 2 (the kernel bandwidth needs log m > 0)")
    hidden = [positive_int("hidden", int(h)) for h in hidden]
    if positive_int("eval_samples", eval_samples) < 2:
        raise ValueError("eval_samples: at least 2 (the unbiased MMD² needs two draws)")
    family, folder = _family_and_name(out, name, d)

    mean, cov = (t[0] for t in prior.moments())
    score_x = lambda x: prior.score(x[None])[0]  # noqa: E731
    score_y = score_in_whitened(score_x, mean, gaussian.cholesky(cov))
    gen = GPVIGenerator(d, hidden=hidden, exact_jacobian=d <= EXACT_JACOBIAN_MAX_DIM, generator=rng.generator(seed))
    t0 = time.perf_counter()
    history = gen.fit(
        score_y, iterations, particles, lr, final_lr=final_lr, generator=rng.generator(seed + 1), progress=progress
    )
    seconds = time.perf_counter() - t0
    gen.eval()
    sampler = CachedSampler.whitened(gen, mean, cov)
    fit = {
        "iterations": iterations,
        "seconds": seconds,
        "final_grad_norm": float(history.grad_norm[-min(100, iterations) :].mean()),
    }
    result = {**sampler_metrics(sampler, prior, eval_samples, seed), "fit": fit}
    training = {
        "iterations": iterations,
        "particles": particles,
        "lr": lr,
        "final_lr": final_lr,
        "seed": seed,
    }
    config = {
        **asdict(gen.config),
        "family": family,
        "state_dim": d,
        "obs_dim": 0,
        "architecture": "gpvi",
        "prior": prior_spec,
        MOMENTS_KEY: {"mean": mean.tolist(), "cov": cov.tolist()},
        "whitening": "x = mean + cholesky(cov) f(z), z ~ N(0, I_dim)",
        "training": training,
    }
    command = fit_command(prior_spec, out, name, **training, hidden=hidden, eval_samples=eval_samples)
    readme = _readme(family, d, command, argv_command, prior_spec, result, fit)
    return registry.save_sampler(out, folder, config, gen.state_dict(), result, readme)


# ---- command line ---------------------------------------------------------------------------------------


def read_prior(text: str) -> dict:
    """``--prior``: inline JSON (starting with ``{``) or the path of a JSON file."""
    raw = text.strip()
    if not raw.startswith("{"):
        path = Path(raw).expanduser()
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"prior: cannot read {path} ({exc.strerror or exc})") from None
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"prior: not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"prior: expected a JSON object, got {type(spec).__name__}")
    return spec


def _hidden(text: str) -> list[int]:
    try:
        return [int(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _run_cli(args: argparse.Namespace) -> int:
    argv = getattr(args, "argv", None)
    record = fit_sampler(
        read_prior(args.prior),
        out=args.out,
        name=args.name,
        iterations=args.iterations,
        particles=args.particles,
        seed=args.seed,
        hidden=args.hidden,
        lr=args.lr,
        final_lr=args.final_lr,
        eval_samples=args.eval_samples,
        progress=not args.quiet,
        argv_command=shlex.join(["mpflow", *argv]) if argv else None,
    )
    m = record.metrics
    summary = {"saved": str(record.path), "name": record.name, "mmd2": m["mmd2"], "fit_seconds": m["fit"]["seconds"]}
    print(json.dumps(summary))
    if m["mmd2"]["generator"] >= m["mmd2"]["moment_matched_gaussian"]:
        print(
            f"warning: {record.name} is no closer to the prior than its moment-matched Gaussian (MMD² "
            f"{m['mmd2']['generator']:.4f} vs {m['mmd2']['moment_matched_gaussian']:.4f}); "
            "try more --iterations or another --seed",
            file=sys.stderr,
        )
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``mpflow fit-sampler`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "fit-sampler",
        help="fit a GPVI sampler to a prior density and cache it in a registry folder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prior", required=True, help="the prior as JSON (docs/API.md schema): a file path or inline JSON")
    p.add_argument("--out", required=True, help="registry root; the sampler goes to OUT/samplers/<name>/")
    p.add_argument("--name", help="a label [a-z_]+ or a full '<label>-d<d>-v<k>' (default gpvi-d<d>-v<next>)")
    p.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="GPVI steps")
    p.add_argument("--particles", type=int, default=DEFAULT_PARTICLES, help="noise draws z and z' per step")
    p.add_argument("--hidden", type=_hidden, default=list(DEFAULT_HIDDEN), help="generator widths, e.g. 64,64")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="Adam rate of the generator at the start")
    p.add_argument("--final-lr", type=float, default=DEFAULT_FINAL_LR, help="... decayed geometrically to this")
    p.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES, help="draws per sample in metrics.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_cli)


__all__ = [
    "add_parser",
    "density_prior",
    "fit_command",
    "fit_sampler",
    "read_prior",
    "sampler_metrics",
]


if __name__ == "__main__":  # python -m training.fit_sampler ... (same arguments as `mpflow fit-sampler`)
    _parser = argparse.ArgumentParser(prog="mpflow")
    add_parser(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args(["fit-sampler", *sys.argv[1:]])
    _args.argv = ["fit-sampler", *sys.argv[1:]]
    try:
        raise SystemExit(_args.func(_args))
    except ValueError as _exc:
        print(f"error: {_exc}", file=sys.stderr)
        raise SystemExit(2) from None
