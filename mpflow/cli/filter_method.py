"""The method ``mpflow filter`` runs, chosen as the service chooses it (one source of defaults).

Without ``--method`` (and ``--operator``) the command runs what a stream of the same model would get from the
service when its request names no method: :meth:`mpflow.service.engine.methods.Methods.default`, the method
``benchmarks.equal_compute`` (and the family benchmarks) measured most accurate for the family, d and regime
(``service/engine/default_methods.json``), with its measured options and particle count N — under this machine's
``MPFLOW_METHOD_OPTIONS``, as the service applies them. ``--particles`` overrides N; without it a method the table
gives no N for runs the service's default, 256 (:data:`mpflow.service.streams.creation.DEFAULT_PARTICLES`).

With ``--method`` the updater is that method's own defaults (``mpf``: the operator named, else the newest one that
the service would pick automatically for the family and d, else the untrained base flow).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpflow.operators.models.base import ModelFamily
from mpflow.operators.updaters import Updater


@dataclass(frozen=True)
class FilterMethod:
    """What ``mpflow filter`` runs: the updater, its name, the particle count and a line saying why."""

    name: str
    updater: Updater
    particles: int
    note: str


def service_default(model: ModelFamily, particles: int | None) -> FilterMethod:
    """The service's measured default for ``model`` (module docstring)."""
    from mpflow.service.engine.catalogue import OperatorCatalogue
    from mpflow.service.engine.methods import Methods
    from mpflow.service.settings import Settings
    from mpflow.service.streams.creation import DEFAULT_PARTICLES

    settings = Settings()
    operators = OperatorCatalogue(settings.operator_dir_list)
    operators.load()
    methods = Methods(settings, operators)
    choice = methods.default(model)
    updater = methods.updater(choice.method, choice.operator, choice.options)
    n = particles or min(choice.num_particles or DEFAULT_PARTICLES, settings.max_particles)
    what = choice.method + (f" with the operator {choice.operator}" if choice.operator else "")
    options = f", options {choice.options}" if choice.options else ""
    note = (
        f"# {what}{options}, N = {n}: the service's default for {model.name}, d = {model.state_dim} "
        f"(--method picks another)\n#   why: {choice.reason}"
    )
    return FilterMethod(choice.method, updater, n, note)


def named_method(method: str, operator: str | None, model: ModelFamily, particles: int | None) -> FilterMethod:
    """``--method`` (and ``--operator``, for ``mpf``) as asked, with ``particles`` or 256."""
    from mpflow.operators.updaters import get_updater
    from mpflow.service.streams.creation import DEFAULT_PARTICLES

    if operator and method != "mpf":
        raise ValueError(f"--operator: only used with --method mpf, not {method}")
    options, note = {}, f"# {method}"
    if method == "mpf":
        options["operator"], note = mpf_operator(operator, model.name, model.state_dim)
    return FilterMethod(method, get_updater(method, **options), particles or DEFAULT_PARTICLES, note)


def mpf_operator(name: str | None, family: str, dim: int) -> tuple[str | None, str]:
    """(the operator ``mpflow filter --method mpf`` runs, a line saying which): the one named, else the newest
    trained operator for (family, dim) that the service picks automatically, else None — the untrained base
    flow."""
    if name is not None:
        return name, f"# mpf with the operator {name}"
    from mpflow.operators.trained_operators import find_operator

    record = find_operator(family, dim)
    if record is None:
        return None, (
            f"# mpf: no trained operator fits {family} with d = {dim} (mpflow info lists them; --operator NAME "
            "runs a named-only one); running the base flow, untrained"
        )
    return record.name, f"# mpf with the operator {record.name} (the newest for {family}, d = {dim})"


def filter_method(method: str | None, operator: str | None, model: ModelFamily, particles: int | None) -> FilterMethod:
    """The service's default without ``method`` and ``operator``; else the one asked for."""
    if method is None and operator is None:
        return service_default(model, particles)
    return named_method(method or "mpf", operator, model, particles)


__all__ = ["FilterMethod", "filter_method", "mpf_operator", "named_method", "service_default"]
