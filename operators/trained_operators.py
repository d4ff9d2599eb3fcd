"""Trained MPF operators: find, load and check the domain of one — the one place the package does any of the three.

The registry (:mod:`mpflow.operators.registry`) owns the format on disk (folders, hashes, listing, saving); this
module owns what a caller does with what it lists:

* **find** — :func:`find_operator`: the newest operator for (family, d) over the operator roots
  (:func:`operator_dirs`: the package's ``operators/pretrained/``, ``$MPFLOW_OPERATOR_DIRS`` and any extra folders,
  each once), skipping ``"auto_select": false``; a factorised family
  (:attr:`~mpflow.operators.models.base.ModelFamily.factorised`) without one of that d falls back to d = 1, which
  serves every d one dimension at a time (:func:`serves_dimension`);
* **load** — :func:`load_operator` (name or folder → record and network, cached per folder and content hash) and
  :func:`network_from_record` (config.json's architecture with its weights, eval mode); :func:`load_correction`
  (a registered name → the learned ring correction ``ienkf`` runs after its analysis);
* **check domain** — :func:`operator_domain` (the ranges the operator's task distribution covered: config.json's
  ``domain``, else the family's :meth:`~mpflow.operators.models.base.ModelFamily.task_domain` under its recorded task
  options) and :func:`outside_domain` (what of a stream — its model and its prior's mean and covariance, measured by
  :meth:`~mpflow.operators.models.base.ModelFamily.domain_measures` — lies outside it).

The ``mpf`` updater, the service's catalogue, the command line, the training code and the benchmarks call these.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from mpflow.operators import registry
from mpflow.operators.models import FAMILIES, family
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.mpf.network import MPFVelocity


def operator_dirs(extra_dirs: list[str] | list[Path] | None = None) -> list[Path]:
    """The operator roots: the registry's defaults (``operators/pretrained/``, ``$MPFLOW_OPERATOR_DIRS``) and then
    ``extra_dirs``, each folder once (by its resolved path), in that order."""
    dirs: list[Path] = []
    for d in [*registry.default_dirs(), *map(Path, extra_dirs or [])]:
        d = d.expanduser()
        if d.resolve() not in {x.resolve() for x in dirs}:
            dirs.append(d)
    return dirs


def find_operator(
    family: str, state_dim: int, dirs=None, *, include_named_only: bool = False
) -> registry.OperatorRecord | None:
    """The newest trained operator for (family, state_dim) in ``dirs`` (default: the registry's default dirs,
    i.e. ``operators/pretrained/`` and ``$MPFLOW_OPERATOR_DIRS``), or None; for a factorised family
    (:attr:`~mpflow.operators.models.base.ModelFamily.factorised`) without one of that d, the newest of d = 1, which
    serves every d one dimension at a time. An operator whose ``config.json`` has ``"auto_select": false``
    (shipped, but measured no better than its base flow at more cost) serves only a stream that names it, so it
    is skipped here unless ``include_named_only``."""
    found = [
        r
        for r in registry.list_operators(registry.default_dirs() if dirs is None else dirs)
        if r.kind == "operator"
        and is_mpf_operator(r)
        and r.family == family
        and r.state_dim in (state_dim, 1)
        and (include_named_only or r.auto_select)
    ]
    exact = [r for r in found if r.state_dim == state_dim]
    if not exact and family in FAMILIES and FAMILIES[family].factorised:
        exact = found
    return max(exact, key=lambda r: r.version, default=None)


def is_mpf_operator(record: registry.OperatorRecord) -> bool:
    """Whether ``record`` is an MPF velocity (its ``architecture`` an object without a ``kind``, the form
    :class:`MPFVelocity` takes) and not another learned map (a ``ring_correction`` after ``ienkf``)."""
    arch = record.config["architecture"]
    return isinstance(arch, dict) and "kind" not in arch


def load_correction(name):
    """The trained ring correction (:mod:`mpflow.operators.mpf.ring_correction`) of the registered operator *name*
    (``<family>-d<d>-v<k>``, never a path: :func:`mpflow.operators.registry.resolve_name`); ValueError when the name is
    not registered or names another kind of operator."""
    from mpflow.operators.mpf.ring_correction import correction_from_record

    return correction_from_record(registry.resolve_name(name, kind="operator"))


def load_observer(name):
    """The trained ring observer (:mod:`mpflow.operators.mpf.ring_observer`) of the registered operator *name*;
    ValueError if it is not registered or names another kind of operator."""
    from mpflow.operators.mpf.ring_observer import observer_from_record

    return observer_from_record(registry.resolve_name(name, kind="operator"))


def serves_dimension(operator_dim: int, model: ModelFamily) -> bool:
    """Whether an operator trained at d = ``operator_dim`` serves ``model``: its own d, or d = 1 on a factorised
    family (one dimension at a time)."""
    return operator_dim == model.state_dim or (operator_dim == 1 and model.factorised)


def network_from_record(record: registry.OperatorRecord) -> MPFVelocity:
    """Build the MPFVelocity described by ``config.json`` and load its weights (eval mode)."""
    arch = record.config["architecture"]
    if not is_mpf_operator(record):
        raise ValueError(f"operator: {record.name} is not an MPF operator (architecture {arch!r})")
    net = MPFVelocity(record.state_dim, **arch)
    try:
        net.load_state_dict(registry.load_weights(record))
    except RuntimeError as exc:
        raise ValueError(f"operator: weights of {record.name} do not fit its architecture ({exc})") from None
    return net.eval()


@lru_cache(maxsize=64)
def _load(path: str, content_hash: str) -> MPFVelocity:
    return network_from_record(registry.load_record(path, "operator"))


def load_operator(name_or_dir: str | Path, dirs=None) -> tuple[registry.OperatorRecord, MPFVelocity]:
    """(record, network) of a registered operator; networks are cached per folder and content hash."""
    rec = registry.resolve(name_or_dir, dirs)
    return rec, _load(str(rec.path), rec.content_hash)


def operator_domain(record: registry.OperatorRecord) -> dict[str, list[float]]:
    """The region (family parameters, prior) an operator was trained on, as ranges of named quantities
    (:meth:`~mpflow.operators.models.base.ModelFamily.task_domain`): its config.json's ``domain``, written by
    ``mpflow train``, or else the family's task domain under the operator's recorded task options."""
    if "domain" in record.config:
        return record.config["domain"]
    task_options = (record.config.get("training") or {}).get("task_kwargs") or {}
    return family(record.family).task_domain(task_options)


def outside_domain(
    model: ModelFamily, domain: dict[str, list[float]], prior_mean: torch.Tensor, prior_cov: torch.Tensor
) -> list[str]:
    """What of a one-stream ``model`` with a prior of mean [d] and covariance [d, d] lies outside an operator's
    ``domain`` (:func:`operator_domain`), one phrase per quantity of the family's
    :meth:`~mpflow.operators.models.base.ModelFamily.domain_measures`; empty when the stream is inside. Bounds are
    compared with a relative slack of 1e-6."""
    measures = model.domain_measures(prior_mean, prior_cov)
    outside = []
    for name, (lo, hi) in domain.items():
        if name not in measures:
            continue
        low, high = measures[name]
        slack = 1e-6 * max(abs(lo), abs(hi), 1.0)
        if low < lo - slack or high > hi + slack:
            value = f"{low:.4g}" if low == high else f"{low:.4g} … {high:.4g}"
            outside.append(f"{name} {value} outside the trained [{lo:.4g}, {hi:.4g}]")
    return outside


__all__ = [
    "find_operator",
    "load_operator",
    "network_from_record",
    "operator_dirs",
    "operator_domain",
    "outside_domain",
    "serves_dimension",
]
