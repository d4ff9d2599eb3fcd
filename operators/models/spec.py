"""A family's declarative spec: how the REST API reads its parameters and how the catalogue describes it.

Each family declares one :class:`FamilySpec` next to its class (``spec = FamilySpec(...)``): the model in one line
(``description``), the JSON form of one step's observation (``observation``) and its parameters, each a
:class:`Param` (name, parser, default). Everything that reads or describes a family's parameters reads this table —
:func:`read_params` (``model.params`` → tensors, for :meth:`ModelFamily.from_params`), :func:`learnable` and
:func:`param_domain` (which parameters may be given as priors, and their ranges), :func:`catalogue_entry` (the
``GET /v1/models`` entry, which ``mpflow info`` prints) and the docs' drift test — so none of it is a method of the
family; the family class keeps the probabilistic model.

A parser is ``parse(field, value, d, dtype) -> tensor`` (``ValueError("model.params.X: …")`` on a bad value, which
the service answers with 422); :func:`kind` marks it with what it accepts in words (the catalogue's ``kind``) and,
for a parameter that may be given as a prior (a scalar, or a covariance read as r·I), the open range of its value.
A default is ``default(d, dtype) -> tensor`` (``None`` from it: an optional parameter without a default); a
:class:`Param` without a default is required. The parsers and defaults most families share are here:
:func:`parse_matrix`, :func:`parse_cov`, :func:`parse_psd`, :func:`parse_per_dim`, :func:`parse_positive`;
:func:`identity`, :func:`filled`, :func:`absent`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from mpflow.operators import validation
from mpflow.operators.models.param_priors import ParamPrior, is_prior, parse_prior

if TYPE_CHECKING:
    from mpflow.operators.models.base import ModelFamily

Parser = Callable[..., torch.Tensor]
Default = Callable[[int, torch.dtype], Any]


class Param(NamedTuple):
    """One parameter as the API takes it: its name, its parser and its default (None: required). A tuple, so a
    family may write ``("R", parse_cov, identity())``."""

    name: str
    parse: Parser
    default: Default | None = None

    @property
    def kind(self) -> str:
        """What the parser accepts, in words (its ``kind`` mark; "value" when it has none)."""
        return param_kind(self.parse)

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class FamilySpec:
    """A family's parameters and catalogue text (module docstring)."""

    #: the model in one line
    description: str = ""
    #: the JSON form of one step's observation
    observation: str = ""
    #: the parameters, in the order the catalogue lists them
    params: tuple[Param, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(Param(*p) for p in self.params))

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


def read_params(
    cls: type[ModelFamily], params: dict[str, Any], state_dim: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, ParamPrior]]:
    """The API's ``model.params`` of one stream read by the family's spec: (parameter → tensor, without a batch
    dimension; parameter → prior, for those given as priors, whose tensor is then the unit value of
    :meth:`ModelFamily.param_unit`). ValueError naming ``model.params.X`` for an unknown, missing or bad one."""
    validation.unknown_keys("model.params", params, cls.spec.names)
    parsed, unknown = {}, {}
    for name, parse, default in cls.spec.params:
        where = f"model.params.{name}"
        if name in params and is_prior(params[name]):
            parsed[name] = cls.param_unit(name, params, state_dim, dtype)
            unknown[name] = parse_prior(where, params[name], param_domain(cls, name))
        elif name in params:
            parsed[name] = parse(where, params[name], state_dim, dtype)
        elif default is not None:
            value = default(state_dim, dtype)
            if value is not None:  # None: an optional parameter without a default (``absent``)
                parsed[name] = value
        else:
            raise ValueError(f"{where}: required for the {cls.name} family")
    return parsed, unknown


def learnable_param(cls: type[ModelFamily], name: str) -> Param:
    """The parameter ``name`` where it may be given as a prior; ValueError naming it otherwise."""
    p = cls.spec.param(name)
    if not getattr(p.parse, "learnable", False) or p.default is None or name in cls.substep_params:
        raise ValueError(
            f"model.params.{name}: a prior may stand for a scalar parameter or a covariance (read as r·I), not "
            f"for {name} ({p.kind}) of the {cls.name} family; give it as a value"
        )
    return p


def learnable(cls: type[ModelFamily], name: str) -> bool:
    """Whether the parameter may be given as a prior (the catalogue's ``learnable``)."""
    try:
        learnable_param(cls, name)
    except ValueError:
        return False
    return True


def param_domain(cls: type[ModelFamily], name: str) -> tuple[float, float]:
    """The open range (lo, hi) a learnable parameter's value must lie in: the family's ``param_domains``, else
    (0, ∞) for a covariance or positive number and ℝ for the others (its parser's ``domain``)."""
    if name in cls.param_domains:
        return cls.param_domains[name]
    return getattr(learnable_param(cls, name).parse, "domain", (-math.inf, math.inf))


def catalogue_entry(cls: type[ModelFamily], max_state_dim: int) -> dict[str, Any]:
    """The family's ``GET /v1/models`` entry, without "methods" (the service adds those)."""
    fixed = cls.fixed_state_dim
    return {
        "family": cls.name,
        "dynamic": cls.dynamic,
        "linear_gaussian": cls.linear_gaussian,
        "description": cls.spec.description,
        "state_dim": {"fixed": fixed, "min": fixed or cls.min_state_dim, "max": fixed or max_state_dim},
        "observation": cls.spec.observation,
        "parameters": [
            {
                "name": p.name,
                "kind": p.kind,
                "required": p.required,
                "default": describe_default(p.default),
                "learnable": learnable(cls, p.name),
            }
            for p in cls.spec.params
        ],
    }


def param_kind(parse: Parser) -> str:
    """What a parameter parser accepts, in words (its ``kind`` attribute; "value" when it has none)."""
    return getattr(parse, "kind", "value")


def describe_default(default: Default | None) -> str | None:
    """The default of a parameter in words, read off the family's default at d = 2 (c·I, or a value; a vector
    whose length does not follow d, as ``range_bearing``'s ``sensor``, as the vector: ``[0, 0]``)."""
    if default is None:
        return None
    t = default(2, torch.float64)
    if t is None:  # optional, no default
        return None
    if t.dim() == 2 and torch.equal(t, t[0, 0] * torch.eye(2, dtype=t.dtype)):
        return f"{t[0, 0].item():g}·I"
    follows_d = t.dim() == 1 and default(3, torch.float64).shape != t.shape
    if follows_d and bool((t == t[0]).all()):
        return f"{t[0].item():g}"
    if t.dim() == 1:
        return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"
    if t.dim() == 0:
        return f"{t.item():g}"
    return str(t.tolist())


def kind(words: str, domain: tuple[float, float] | None = None) -> Callable[[Parser], Parser]:
    """Mark a parameter parser with what it accepts (:func:`param_kind`) and, for a parameter that may be given as a
    prior (a scalar, or a covariance read as r·I), the open range of its value (``domain``)."""

    def mark(parse: Parser) -> Parser:
        parse.kind = words  # type: ignore[attr-defined]
        if domain is not None:
            learnable_parser(domain)(parse)
        return parse

    return mark


def learnable_parser(domain: tuple[float, float]) -> Callable[[Parser], Parser]:
    """Mark a parameter parser as one whose parameter may be given as a prior, with the open range of its value."""

    def mark(parse: Parser) -> Parser:
        parse.learnable = True  # type: ignore[attr-defined]
        parse.domain = domain  # type: ignore[attr-defined]
        return parse

    return mark


#: the domain of a variance or a positive number, and of an unconstrained number
POSITIVE = (0.0, math.inf)
REAL = (-math.inf, math.inf)


def absent(d: int, dtype: torch.dtype) -> None:
    """The "default" of an optional parameter that has none: the model simply does not have it."""
    return None


def identity(scale: float = 1.0) -> Callable[[int, torch.dtype], torch.Tensor]:
    return lambda d, dtype: scale * torch.eye(d, dtype=dtype)


def filled(value: float) -> Callable[[int, torch.dtype], torch.Tensor]:
    return lambda d, dtype: torch.full((d,), value, dtype=dtype)


@kind("matrix")
def parse_matrix(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.matrix(name, value, None, None, dtype)


@kind("covariance matrix (symmetric positive definite)", POSITIVE)
def parse_cov(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.covariance(name, value, None, dtype)


@kind("covariance matrix (symmetric positive semi-definite)", POSITIVE)
def parse_psd(name: str, value, d: int, dtype) -> torch.Tensor:
    """A symmetric positive semi-definite matrix (a diffusion may drive only some coordinates)."""
    c = validation.matrix(name, value, None, None, torch.float64)
    if c.shape[0] != c.shape[1] or not torch.allclose(c, c.T, atol=1e-8 * float(c.abs().max().clamp_min(1.0))):
        raise ValueError(f"{name}: must be a symmetric square matrix, got {list(c.shape)}")
    eig_min = float(torch.linalg.eigvalsh(c).min())
    if eig_min < -1e-10 * float(c.abs().max().clamp_min(1.0)):
        raise ValueError(f"{name}: must be positive semi-definite (smallest eigenvalue {eig_min:.3g})")
    return c.to(dtype)


@kind("number or vector of length d", REAL)
def parse_per_dim(name: str, value, d: int, dtype) -> torch.Tensor:
    """A number (broadcast to all d dimensions) or a vector of length d."""
    t = validation.as_tensor(name, value, dtype)
    if t.dim() == 0:
        return t.expand(d).clone()
    return validation.check_shape(name, t, [d])


@kind("positive number", POSITIVE)
def parse_positive(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.positive(name, value, dtype)


__all__ = [
    "POSITIVE",
    "REAL",
    "FamilySpec",
    "Param",
    "absent",
    "catalogue_entry",
    "describe_default",
    "filled",
    "identity",
    "kind",
    "learnable",
    "learnable_parser",
    "param_domain",
    "param_kind",
    "parse_cov",
    "parse_matrix",
    "parse_per_dim",
    "parse_positive",
    "parse_psd",
    "read_params",
]
