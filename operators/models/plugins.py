"""Model families as plugins: the entry-point group ``mpflow.families``.

A family is a :class:`~mpflow.operators.models.base.ModelFamily` subclass named by an entry point of the group
``mpflow.families`` — ``name = "package.module:Class"``, the entry point's name equal to the class's ``name``. mpflow
registers its built-in families the same way (``pyproject.toml``); any installed distribution adds its own::

    [project.entry-points."mpflow.families"]
    poisson_counts = "mpflow_example_family:PoissonCounts"

:func:`load_families` reads the group through :func:`importlib.metadata.entry_points` and checks each class before
it is admitted (:func:`family_problem`): a subclass of ModelFamily under its own name, the methods a family must
give implemented, and one small model of its demonstration parameters (:meth:`ModelFamily.example_params`)
evaluated — a drawn observation of ``obs_shape``, ``log_likelihood`` [B, N], ``score`` [B, N, d] and, for a dynamic
family, ``transition`` [B, N, d]. A plugin that fails to import or to pass is left out with a message naming it
and what is wrong (:data:`mpflow.operators.models.FAMILY_ERRORS`; the service logs each at start), and everything
else is served as usual.

Two methods are optional, and a family without them silently loses what depends on them:
:meth:`~ModelFamily.observation_cdf` (the conditional CDF F_j(o_j | x): predictive p-values — ``per_step``'s ``pit``
and ``pit_two_sided``, the summary's flags) and :meth:`~ModelFamily.observation_draws` (o ~ p(o | x): the
observation forecasts of ``GET .../forecast``). Both have defaults for a family with ``gaussian_observation`` (o =
h(x) + N(0, R)). A plugin admitted without either is told at registration — a :class:`FamilyWarning` naming the
plugin, each missing method and what it loses (:func:`family_losses`, evaluated on its demonstration model), also
kept in :data:`FAMILY_LOSSES` — instead of finding out from answers without them.
"""

from __future__ import annotations

import importlib
import tomllib
import warnings
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.rng import generator, randn

GROUP = "mpflow.families"
#: the distribution whose entry points are the built-in families
OWN_DISTRIBUTION = "mpflow"
#: the catalogue order of the built-in families (the order of ``mpflow info``, the meta-training families and the
#: benchmarks), by name only: where each one lives is its entry point in pyproject.toml, the one registration (read
#: from the package's metadata, or from pyproject.toml itself in a source tree without an install); a built-in not
#: named here follows these, by name
CATALOGUE_ORDER = (
    "linear_gaussian",
    "lds",
    "gmm",
    "logistic",
    "stochastic_volatility",
    "range_bearing",
    "lorenz96",
    "structural",
)
#: pyproject.toml of a source tree (operators/models/plugins.py → the repository root)
SOURCE_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: what every family must implement itself (the base class only raises)
REQUIRED = ("log_likelihood", "sample_observation", "obs_shape")
#: particles of the admission check
CHECK_PARTICLES = 5
#: the optional methods of a family, and what a family loses without them (module docstring)
OPTIONAL = {
    "observation_cdf": "no predictive p-values: per_step's pit and pit_two_sided, the summary's pit flags, are absent",
    "observation_draws": 'no observation forecasts: GET .../forecast answers "observation": null',
}
#: per admitted plugin family that lacks some :data:`OPTIONAL` method, the warning it was given at registration
FAMILY_LOSSES: dict[str, str] = {}


class FamilyWarning(UserWarning):
    """A model family plugin was admitted without an optional method, and loses what depends on it."""


def load_families() -> tuple[dict[str, type[ModelFamily]], dict[str, str]]:
    """(families by name, problems by plugin name): the built-ins first in :data:`CATALOGUE_ORDER`, then the other
    distributions' families by name. A plugin named like a family already loaded is refused (a built-in cannot be
    replaced)."""
    points = list(entry_points(group=GROUP))
    families: dict[str, type[ModelFamily]] = {}
    problems: dict[str, str] = {}
    for ep in builtin_entry_points(points):
        _admit(ep, families, problems)
    others = sorted((ep for ep in points if _distribution(ep) != OWN_DISTRIBUTION), key=lambda ep: ep.name)
    for ep in others:
        if ep.name in families:
            problems[ep.name] = (
                f"{describe(ep)}: a family named {ep.name!r} is already loaded ({families[ep.name].__module__}); "
                "rename the plugin's family"
            )
            continue
        _admit(ep, families, problems)
        if ep.name in families:
            _tell_losses(ep, families[ep.name])
    return families, problems


def _tell_losses(ep: EntryPoint, cls: type[ModelFamily]) -> None:
    """Warn (:class:`FamilyWarning`) that the admitted plugin ``ep`` lacks optional methods, naming each and what it
    loses; kept in :data:`FAMILY_LOSSES`."""
    losses = family_losses(cls)
    if not losses:
        FAMILY_LOSSES.pop(ep.name, None)
        return
    message = (
        f"{describe(ep)} is admitted without {'; '.join(losses)}. Implement "
        f"{' and '.join(m.split(' ')[0] for m in losses)} on the family (mpflow.operators.models.base.ModelFamily), "
        "or set gaussian_observation with observation_function and observation_noise for o = h(x) + N(0, R)"
    )
    FAMILY_LOSSES[ep.name] = message
    warnings.warn(message, FamilyWarning, stacklevel=3)


def family_losses(cls: type[ModelFamily]) -> list[str]:
    """What family ``cls`` loses for lack of each :data:`OPTIONAL` method — one line each, ``"<method> — <what>"`` —
    judged on its demonstration model (a method that answers None, or raises, is missing); empty when it has both."""
    d = cls.example_state_dim()
    try:
        model = cls.from_params(cls.example_params(d), d)
        gens = [generator(0)]
        x = randn(gens, [CHECK_PARTICLES, d])
        obs = model.sample_observation(x[:, 0], gens)
    except Exception:  # family_problem reports a broken demonstration model; nothing more to say here
        return []
    tries = {
        "observation_cdf": lambda: model.observation_cdf(obs, x, gens),
        "observation_draws": lambda: model.observation_draws(x, gens[0]),
    }
    losses = []
    for method, what in OPTIONAL.items():
        try:
            got = tries[method]()
        except Exception as exc:  # a plugin's optional method may fail in any way: it is as good as missing
            got, what = None, f"{what}; it raised {type(exc).__name__}: {exc}"
        if got is None:
            losses.append(f"{method} — {what}")
    return losses


def builtin_entry_points(points: list[EntryPoint]) -> list[EntryPoint]:
    """mpflow's own entry points among ``points`` — else, in a source tree without an install, those of its
    pyproject.toml — in catalogue order (:data:`CATALOGUE_ORDER`)."""
    own = [ep for ep in points if _distribution(ep) == OWN_DISTRIBUTION]
    if not own and SOURCE_PYPROJECT.is_file():
        declared = tomllib.loads(SOURCE_PYPROJECT.read_text())["project"]["entry-points"][GROUP]
        own = [EntryPoint(name, value, GROUP) for name, value in declared.items()]
    rank = {name: i for i, name in enumerate(CATALOGUE_ORDER)}
    return sorted(own, key=lambda ep: (rank.get(ep.name, len(rank)), ep.name))


def _admit(ep: EntryPoint, families: dict[str, type[ModelFamily]], problems: dict[str, str]) -> None:
    try:
        cls = ep.load() if ep.dist is not None else _import(ep.value)
    except Exception as exc:  # a plugin's import may fail in any way; it must not stop the others
        problems[ep.name] = f"{describe(ep)}: cannot be imported ({type(exc).__name__}: {exc})"
        return
    problem = family_problem(ep.name, cls)
    if problem is not None:
        problems[ep.name] = f"{describe(ep)}: {problem}"
        return
    families[ep.name] = cls


def _import(value: str) -> object:
    module, _, attr = value.partition(":")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def family_problem(name: str, cls: object) -> str | None:
    """What is wrong with the class ``cls`` registered as family ``name`` (module docstring), or None."""
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        return f"{cls!r} is not a subclass of mpflow.operators.models.base.ModelFamily"
    if getattr(cls, "name", None) != name:
        return f"the class's name is {getattr(cls, 'name', None)!r}, not the entry point's name {name!r}"
    missing = [m for m in REQUIRED if getattr(cls, m) is getattr(ModelFamily, m)]
    if (
        cls.dynamic
        and cls.transition_affine is ModelFamily.transition_affine
        and cls.transition is ModelFamily.transition
    ):
        missing.append("transition_affine (or transition)")
    if missing:
        return f"does not implement {', '.join(missing)}"
    d = cls.example_state_dim()
    try:
        return _shape_problem(cls, d)
    except Exception as exc:  # whatever a broken plugin raises is its problem, reported as such
        return f"fails on its demonstration model (d = {d}): {type(exc).__name__}: {exc}"


def _shape_problem(cls: type[ModelFamily], d: int) -> str | None:
    model = cls.from_params(cls.example_params(d), d)
    gens = [generator(0)]
    x = randn(gens, [CHECK_PARTICLES, d])
    obs = model.sample_observation(x[:, 0], gens)
    expected = [1, *model.obs_shape]
    if obs.dim() != len(expected) or any(e >= 0 and e != n for e, n in zip(expected, obs.shape, strict=True)):
        return f"sample_observation gives shape {list(obs.shape)}, expected {expected} (B = 1, obs_shape)"
    checks = [("log_likelihood", model.log_likelihood(obs, x), [1, CHECK_PARTICLES])]
    checks.append(("score", model.score(obs, x), [1, CHECK_PARTICLES, d]))
    if cls.dynamic:
        checks.append(("transition", model.transition(x, gens), [1, CHECK_PARTICLES, d]))
    for what, got, shape in checks:
        if not isinstance(got, torch.Tensor) or list(got.shape) != shape:
            found = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{what} gives {found}, expected a tensor of shape {shape} (B = 1, N = {CHECK_PARTICLES}, d = {d})"
        if bool(torch.isnan(got).any()):
            return f"{what} gives NaN on its demonstration model"
    return None


def _distribution(ep: EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def describe(ep: EntryPoint) -> str:
    """The plugin in words: its name, value and distribution."""
    dist = f" from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
    return f"model family plugin {ep.name!r} ({ep.value}{dist})"


__all__ = [
    "CATALOGUE_ORDER",
    "FAMILY_LOSSES",
    "GROUP",
    "OPTIONAL",
    "FamilyWarning",
    "builtin_entry_points",
    "family_losses",
    "family_problem",
    "load_families",
]
