"""Request and response bodies of the REST API (docs/API.md; field names are binding), as pydantic v2 models.

These models check the *form* of a request (types, finite numbers, required fields, unknown fields); the
*values* — shapes against the model family, positive-definite covariances, method/model compatibility — are
checked by :mod:`mpflow.operators.models` and :mod:`mpflow.operators.updaters`, whose ``ValueError("field: ...")`` the
service
answers with 422; configured limits (particles, body size, ...) are checked by the service (413), since they
come from :class:`~mpflow.service.settings.Settings`. Every model carries an example so ``/openapi.json`` is complete.

Hostile bodies stay cheap: numbers must lie in the float32 range (the particles' dtype; a larger number is
infinite to the operators, and a 4000-digit integer would not even convert), every list of numbers or items is
validated ``fail_fast`` (a million bad items cost one error, not a million error objects: measured 12 s → ms for
a 3 MB body), unknown fields are refused by one error, and lists whose size no setting governs are bounded
(mixture components, model parameters).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from mpflow.operators.models import FAMILIES
from mpflow.operators.smoothing import MAX_LAG as MAX_SMOOTHING_LAG
from mpflow.operators.updaters import CAPABILITIES, UPDATERS
from mpflow.service.engine import anomaly
from mpflow.service.engine.numerics import FALLBACK_ORDER
from mpflow.service.engine.summary import MAX_LEVELS, QUANTILES, check_levels
from mpflow.service.store.stream_store import NAME_PATTERN
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
    model_validator,
)

#: every stream id the API takes — at creation, in a path, a batch's update, an import's ``stream_id`` — is checked
#: against this one pattern, the store's (422 naming the field, before anything is looked up)
STREAM_ID_PATTERN = NAME_PATTERN
MAX_SEED = 2**63 - 1
#: the largest integer every JSON number holds exactly (2⁵³ − 1): the bound of ``seq``, and of a float sent for an
#: integer field (``5.0``; beyond it a float is no faithful integer)
MAX_EXACT_INT = 2**53 - 1
#: the largest float32: particles and operators compute in float32, so a larger number is infinite to them
FLOAT32_MAX = 3.4028234663852886e38
#: ttl_seconds at most ~68 years (Redis keeps expiry times in milliseconds; far larger values overflow)
MAX_TTL_SECONDS = 2**31 - 1
#: components of a mixture prior (each is validated and factorised: 100k of them took seconds)
MAX_MIXTURE_COMPONENTS = 1024
#: the longest name of a state dimension (``state_names``)
MAX_STATE_NAME_LENGTH = 64
#: the creation options of the anomaly score: their bounds and default (mpflow.service.engine.anomaly)
MAX_ANOMALY_MEMORY = anomaly.MAX_MEMORY
MAX_ANOMALY_WARMUP = anomaly.MAX_WARMUP
DEFAULT_ANOMALY_WARMUP = anomaly.DEFAULT_WARMUP
_OUT_OF_RANGE = f"beyond ±{FLOAT32_MAX:.4g}, the float32 range the service computes in; rescale the values"


_NUMBER = {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}
_VECTOR = {"type": "array", "items": _NUMBER}
_MATRIX = {"type": "array", "items": _VECTOR}

# the range as pydantic constraints (checked in Rust: a Python validator per number doubled the time of a 3 MB body)
FiniteFloat = Annotated[float, Field(allow_inf_nan=False, strict=True, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]

# fail_fast: a list of a million bad items is refused at the first (one error, not a million: module docstring)
Vector = Annotated[list[FiniteFloat], Field(fail_fast=True)]
Matrix = Annotated[list[Vector], Field(fail_fast=True)]


class EntryError(ValueError):
    """A ``ValueError`` about one entry of a field: ``subfield`` (``[3][1]``, ``.value[0]``) is appended to the field's
    name in the answer (:func:`mpflow.service.errors.validation_message`: ``observations[3][1]: ...``)."""

    def __init__(self, subfield: str, message: str):
        super().__init__(f"{subfield}: {message}" if subfield else message)
        self.subfield, self.message = subfield, message


def _literal(value: float) -> str:
    """The JSON literal of a non-finite number, as a client wrote it (``1e400`` reads as Infinity)."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _array(value: Any, max_depth: int, gaps: bool = False, path: str = "") -> Any:
    """A finite number, or a list of them, or a list of such lists (up to ``max_depth`` levels), each list
    holding only numbers or only lists. NaN/inf, numbers beyond the float32 range, strings, booleans and
    objects are refused with an :class:`EntryError` naming the entry (below ``path``, where ``value`` is in the
    field); ``gaps``: ``null`` stands in for a number (an entry not observed), which the refusal of NaN/inf says to
    send. The entry's path is built only on the way out of a refusal: nothing per number of a valid body."""
    try:
        return _entries(value, max_depth, gaps)
    except EntryError as exc:
        if not path:
            raise
        raise EntryError(path + exc.subfield, exc.message) from None


def _entries(value: Any, max_depth: int, gaps: bool) -> Any:
    if gaps and value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | list):
        raise EntryError("", "expected a number or an array of numbers")
    if isinstance(value, float) and not math.isfinite(value):
        fix = "send null for a missing entry" if gaps else "send finite numbers only"
        raise EntryError("", f"{_literal(value)} is not a number; {fix}")
    if isinstance(value, int | float) and not -FLOAT32_MAX <= value <= FLOAT32_MAX:
        raise EntryError("", _OUT_OF_RANGE)
    if isinstance(value, list):
        if max_depth == 0:
            raise EntryError("", "arrays nested too deeply")
        if any(isinstance(v, list) for v in value) and not all(isinstance(v, list) for v in value):
            raise EntryError("", "mixes numbers and arrays at one level")
        for i, v in enumerate(value):
            try:
                _entries(v, max_depth - 1, gaps)
            except EntryError as exc:
                raise EntryError(f"[{i}]{exc.subfield}", exc.message) from None
    return value


def _param(value: Any) -> Any:
    """A number, vector or matrix; or a prior ``{"prior": {"type": ..., ...}}`` of an unknown parameter (its fields
    are the family's to check: :mod:`mpflow.operators.models.param_priors`)."""
    if isinstance(value, dict):
        spec = value.get("prior")
        if set(value) != {"prior"} or not isinstance(spec, dict) or len(spec) > 3:
            raise ValueError('expected a number, an array, or a prior {"prior": {"type": ..., ...}}')
        if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in spec.values()):
            raise ValueError("a prior's fields are its type (a string) and numbers")
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return _components(value)
    return _array(value, 2)


#: the most components a parameter given as a list of objects may have, and the most keys of one
MAX_PARAM_COMPONENTS, MAX_COMPONENT_KEYS = 64, 8


def _components(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A list of components, each an object of named numbers (``structural``'s ``seasonal``: ``[{"period": 24,
    "harmonics": 2, "sd": 0.1}]``); the names and values are the family's to check."""
    if len(value) > MAX_PARAM_COMPONENTS:
        raise ValueError(f"at most {MAX_PARAM_COMPONENTS} components, got {len(value)}")
    for i, comp in enumerate(value):
        if len(comp) > MAX_COMPONENT_KEYS or not all(isinstance(k, str) and len(k) <= 64 for k in comp):
            raise EntryError(f"[{i}]", f"expected an object of at most {MAX_COMPONENT_KEYS} named numbers")
        for k, v in comp.items():
            _array(v, 0, path=f"[{i}].{k}")
    return value


#: the keys of an observation given as an object (docs/API.md): ``value`` and, optionally, ``dt`` and ``u``
STEP_KEYS = ("value", "dt", "u")


def _observation_value(value: Any, path: str = "") -> Any:
    """``null`` (no measurement), an array (up to a matrix; ``null`` entries: not observed), or a logistic
    minibatch {"x": matrix, "y": vector}; ``path``: where it is in the step (``.value`` of an object)."""
    if isinstance(value, dict):
        if set(value) != {"x", "y"}:
            raise ValueError(
                'expected an array, a minibatch object with exactly the keys "x" and "y", or an object with '
                '"value" (and optionally "dt", "u")'
            )
        x, y = value["x"], value["y"]
        if not isinstance(x, list) or not all(isinstance(row, list) for row in x) or not isinstance(y, list):
            raise ValueError('expected "x" an array of feature rows and "y" an array of labels')
        if None in y or any(None in row for row in x):
            # as the published schema says: a minibatch is whole (null for the whole step: no measurement)
            raise ValueError('a minibatch\'s "x" and "y" are numbers only; send null for a step without one')
        _array(x, 2, path=f"{path}.x")
        _array(y, 1, path=f"{path}.y")
        return value
    return _array(value, 2, gaps=True, path=path)


def _observation(value: Any) -> Any:
    """One step: an observation value (:func:`_observation_value`), or an object ``{"value", "dt", "u"}`` — the
    value, the time since the previous step (a positive number, as the published schema says) and the inputs (an array
    of numbers)."""
    if not (isinstance(value, dict) and "value" in value):
        return _observation_value(value)
    unknown = [k for k in value if k not in STEP_KEYS]
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(repr(k)[:40] for k in unknown[:5])}; allowed: value, dt, u")
    _observation_value(value["value"], ".value")
    if "dt" in value and (isinstance(value["dt"], list) or value["dt"] is None):
        raise ValueError("dt: expected a number, the time since the previous step")
    if "dt" in value:
        _array(value["dt"], 0, path=".dt")
        if value["dt"] <= 0:  # the published exclusiveMinimum, for one stream and a batch's update alike
            raise EntryError(".dt", f"the time since the previous step must be a positive number, got {value['dt']!r}")
    if "u" in value and not isinstance(value["u"], list):
        raise ValueError("u: expected an array of numbers, the step's inputs")
    if "u" in value:
        _array(value["u"], 1, path=".u")
    return value


#: an unknown parameter's prior (docs/API.md "Unknown parameters")
_PARAM_PRIOR = {
    "type": "object",
    "properties": {
        "prior": {
            "type": "object",
            "properties": {
                "type": {"enum": ["lognormal", "uniform", "normal"]},
                "mean": {"type": "number"},
                "sd": {"type": "number"},
                "low": {"type": "number"},
                "high": {"type": "number"},
            },
            "required": ["type"],
        }
    },
    "required": ["prior"],
}

#: a list of components, each an object of named numbers (``structural``'s ``seasonal``)
_PARAM_COMPONENTS = {
    "type": "array",
    "items": {"type": "object", "additionalProperties": _NUMBER, "maxProperties": MAX_COMPONENT_KEYS},
    "minItems": 1,
    "maxItems": MAX_PARAM_COMPONENTS,
}

#: a JSON number, array of numbers or matrix — a model parameter
ParamValue = Annotated[
    Any,
    AfterValidator(_param),
    WithJsonSchema(
        {
            "anyOf": [_NUMBER, _VECTOR, _MATRIX, _PARAM_PRIOR, _PARAM_COMPONENTS],
            "description": "a number, vector or matrix; or a prior, for a parameter the stream learns (method smc2); "
            "or a list of components, each an object of named numbers (structural's seasonal)",
        }
    ),
]

_GAP = {"type": "null"}
_OBSERVATION_VALUES = [
    _GAP,
    _NUMBER,
    {"type": "array", "items": {"anyOf": [_NUMBER, _GAP]}},
    {"type": "array", "items": {"type": "array", "items": {"anyOf": [_NUMBER, _GAP]}}},
    {
        "type": "object",
        "properties": {"x": _MATRIX, "y": _VECTOR},
        "required": ["x", "y"],
        "additionalProperties": False,
        "description": "logistic: a minibatch of feature rows x and 0/1 labels y",
    },
]

#: one time step's observation: shape set by the family (see GET /v1/models)
Observation = Annotated[
    Any,
    AfterValidator(_observation),
    WithJsonSchema(
        {
            "anyOf": [
                *_OBSERVATION_VALUES,
                {
                    "type": "object",
                    "properties": {
                        "value": {"anyOf": _OBSERVATION_VALUES, "description": "the observation (null: none)"},
                        "dt": {
                            "type": "number",
                            "exclusiveMinimum": 0,
                            "maximum": FLOAT32_MAX,
                            "description": "time since the previous step (default 1)",
                        },
                        "u": {**_VECTOR, "description": "the step's inputs (lds with an input matrix C)"},
                    },
                    "required": ["value"],
                    "additionalProperties": False,
                    "description": "an observation with its time step and inputs",
                },
            ],
            "description": "one step's observation; its shape is the family's observation shape. null: no "
            "measurement at this step (predict only); a null entry of a vector: that entry not observed",
        }
    ),
]

FamilyName = Literal[tuple(sorted(FAMILIES))]  # type: ignore[valid-type]
MethodName = Literal[tuple(sorted(UPDATERS))]  # type: ignore[valid-type]
FallbackName = Literal[FALLBACK_ORDER]  # type: ignore[valid-type]


class _Request(BaseModel):
    """Requests are validated strictly: no coercion of strings or booleans to numbers. Unknown fields are
    refused with one error naming (the first few of) them, before anything else is validated."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.__pydantic_fields__  # (the model_fields property costs ~6 µs a call, per item of a list)
            unknown = [k for k in data if k not in fields]
            if unknown:
                names = ", ".join(repr(k)[:60] for k in unknown[:5]) + (
                    f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
                )
                raise ValueError(f"unknown field(s) {names}; allowed: {', '.join(fields)}")
            integral = [k for k in _int_fields(cls) if _integral(data.get(k))]
            if integral:  # 5.0 is an integer to JSON Schema (the published contract), not to a strict model
                data = {**data, **{k: int(data[k]) for k in integral}}
        return data


_INT_FIELDS: dict[type, tuple[str, ...]] = {}


def _integral(value: Any) -> bool:
    """Whether ``value`` is a float that is an exact integer a JSON client means as one (|x| ≤ 2⁵³ − 1)."""
    return isinstance(value, float) and value.is_integer() and abs(value) <= MAX_EXACT_INT


def _int_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``cls`` typed ``int`` or ``int | None`` (cached per class)."""
    if cls not in _INT_FIELDS:
        _INT_FIELDS[cls] = tuple(
            name for name, f in cls.__pydantic_fields__.items() if f.annotation in (int, int | None)
        )
    return _INT_FIELDS[cls]


# ---------------------------------------------------------------------------------------------- model / prior
class ModelSpec(_Request):
    family: FamilyName = Field(description="the model family (GET /v1/models)")
    params: dict[str, ParamValue] = Field(
        default_factory=dict,
        max_length=32,
        description="the family's parameters; defaults where the family has one",
    )

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"family": "lds", "params": {"A": [[0.9, 0], [0, 0.9]], "B": [[1, 0]]}}]},
    )


class GaussianPrior(_Request):
    type: Literal["gaussian"]
    mean: Vector
    cov: Matrix = Field(description="symmetric positive-definite")


class ParticlesPrior(_Request):
    type: Literal["particles"]
    particles: Matrix = Field(description="N particles of dimension d, used as given")


class MixturePrior(_Request):
    type: Literal["mixture"]
    weights: Vector = Field(min_length=1, max_length=MAX_MIXTURE_COMPONENTS)
    means: Matrix = Field(min_length=1, max_length=MAX_MIXTURE_COMPONENTS)
    covs: list[Matrix] = Field(min_length=1, max_length=MAX_MIXTURE_COMPONENTS, fail_fast=True)


class SamplerPrior(_Request):
    """An extension of docs/API.md: a GPVI generator cached with ``mpflow fit-sampler`` (registry ``samplers/``);
    the stream's particles are drawn from it."""

    type: Literal["sampler"]
    name: str = Field(min_length=1, max_length=200, description="a cached sampler's name, e.g. gpvi-d2-v1")


Prior = Annotated[GaussianPrior | ParticlesPrior | MixturePrior | SamplerPrior, Field(discriminator="type")]


# ---------------------------------------------------------------------------------------------- requests
class CreateStreamRequest(_Request):
    stream_id: str | None = Field(
        default=None, pattern=STREAM_ID_PATTERN, description="client-chosen id; generated when absent"
    )
    model: ModelSpec
    prior: Prior
    method: MethodName | None = Field(
        default=None,
        description="default: the method the shipped equal-compute benchmark measured most accurate for this family "
        "and state dimension (the stream document's method_reason says which and why)",
    )
    operator: str | None = Field(
        default=None,
        description="mpf only: a trained operator by name (GET /v1/operators); default the newest that fits",
    )
    method_options: dict[str, Any] | None = Field(
        default=None,
        description="the stream's own method options: mpf substeps (1–64), max_substeps, ess_threshold, correct, "
        'flow_fraction (0–1 or "auto", with correct and a linear observation), '
        "rejuvenate, shrinkage, inflation, linearisation (posterior, stein, importance), moves (auto or 0–64, "
        "static families), window (0–16); smc ess_threshold, "
        "rejuvenate, shrinkage; enkf variant, inflation, localisation; ienkf inflation, iterations, tolerance; "
        "ukf alpha, beta, kappa; smc2 theta_particles, "
        "ess_threshold, kernel, jitter. With no method they "
        "adjust the default method's",
    )
    num_particles: int | None = Field(
        default=None,
        ge=2,
        description="default: a particles prior's count; with no method, the count the default method was measured "
        "with; else 256",
    )
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="default: drawn at random")
    pit_alert: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="two-sided level α at which the summary flags a predictive p-value (pit): |pit − 0.5| > "
        "0.5 − α/2; default 0.01 (1 % of the readings of a stream that follows its model)",
    )
    anomaly_memory: int | None = Field(
        default=None,
        ge=0,
        le=MAX_ANOMALY_MEMORY,
        description="steps of surprise history the anomaly_score ranks against: with M > 0 the history's counts "
        "decay by exp(−1/M) a step (about the last M steps); 0 (the default) keeps the whole history",
    )
    anomaly_warmup: int | None = Field(
        default=None,
        ge=0,
        le=MAX_ANOMALY_WARMUP,
        description="scored steps the stream takes before its anomaly_score is given (null until then); default "
        f"{DEFAULT_ANOMALY_WARMUP}",
    )
    ttl_seconds: int | None = Field(
        default=None, ge=1, le=MAX_TTL_SECONDS, description="idle time after which the stream expires"
    )
    state_names: list[Annotated[str, Field(min_length=1, max_length=MAX_STATE_NAME_LENGTH)]] | None = Field(
        default=None,
        description='names of the state\'s d dimensions (exactly d distinct names), e.g. ["x", "y", "vx", '
        '"vy"]; default: the family\'s (GET /v1/models), else none',
    )
    smoothing_lag: int = Field(
        default=0,
        ge=0,
        le=MAX_SMOOTHING_LAG,
        description="L: keep what the method's smoother needs of the last L steps, so that GET .../smoothed answers "
        "p(x_s | o_1..t) for s = t−L+1 … t (0: no smoothing)",
    )

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "stream_id": "sensor-42",
                    "model": {"family": "lds", "params": {"A": [[0.9, 0.1], [0, 0.9]], "B": [[1, 0], [0, 1]]}},
                    "prior": {"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]},
                    "method": "gpf",
                    "num_particles": 256,
                    "seed": 0,
                    "ttl_seconds": 86400,
                    "state_names": ["position", "velocity"],
                }
            ]
        },
    )


def _levels(levels: list[float]) -> list[float]:
    return list(check_levels(levels))


#: a request's quantile levels (:func:`mpflow.service.engine.summary.check_levels`: sorted, without repeats)
QuantileLevels = Annotated[
    list[Annotated[float, Field(gt=0, lt=1)]], Field(min_length=1, max_length=MAX_LEVELS), AfterValidator(_levels)
]


class ObservationsRequest(_Request):
    seq: int | None = Field(
        default=None, ge=1, le=MAX_EXACT_INT, description="1-based step number of the first observation"
    )
    observations: list[Observation] = Field(min_length=1, fail_fast=True, description="time steps, applied in order")
    return_samples: int = Field(default=0, ge=0, description="posterior draws to return after the last step")
    per_step_params: bool = Field(
        default=False,
        description="a stream with unknown parameters (smc2): also give each per_step entry the parameters' "
        "posterior after that step (params, params_ess, params_distinct, params_degenerate); by default they are "
        "in the answer's summary only, the posterior after the last step",
    )
    levels: QuantileLevels | None = Field(
        default=None,
        description="the quantile levels of the answer's quantiles (summary and per_step), each in (0, 1), at most "
        f'{MAX_LEVELS}, e.g. [0.025, 0.5, 0.975]; keys are the levels as decimals ("0.975"). Default '
        f"{list(QUANTILES)}: the bounds of the 95 % and 90 % central intervals and the median",
    )
    per_step_cov: bool = Field(
        default=False, description="also give each per_step entry the state's covariance after that step (cov)"
    )

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"seq": 1, "observations": [[0.3, -1.2], [0.1, -0.9]], "return_samples": 0}]},
    )


class BatchUpdate(ObservationsRequest):
    stream_id: str = Field(pattern=STREAM_ID_PATTERN, description="the stream to update")

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"stream_id": "sensor-42", "seq": 5, "observations": [[0.3, -1.2]]}]},
    )


class BatchRequest(_Request):
    updates: list[BatchUpdate] = Field(min_length=1, fail_fast=True)


# ---------------------------------------------------------------------------------------------- responses
class ErrorDetail(BaseModel):
    code: str = Field(description="snake_case error code")
    message: str = Field(description="what is wrong and how to fix it")


class ErrorResponse(BaseModel):
    error: ErrorDetail

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"error": {"code": "stream_not_found", "message": "stream_id: no stream 'x'"}}]}
    )


class Quantiles(BaseModel):
    """Per-dimension marginal quantiles keyed by their level as a decimal string: by default the bounds of the 95 %
    (0.025, 0.975) and 90 % (0.05, 0.95) central intervals and the median; a request's ``levels`` give others."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")

    q025: list[float] | None = Field(default=None, alias="0.025")
    q05: list[float] | None = Field(default=None, alias="0.05")
    q50: list[float] | None = Field(default=None, alias="0.5")
    q95: list[float] | None = Field(default=None, alias="0.95")
    q975: list[float] | None = Field(default=None, alias="0.975")


class ParamPosterior(BaseModel):
    """The posterior of one unknown parameter given the observations so far (its θ-particles, weighted)."""

    mean: float
    sd: float
    q025: float | None = Field(default=None, description="the 2.5 % quantile (with q975: the 95 % credible interval)")
    q05: float = Field(description="the 5 % quantile")
    q95: float = Field(description="the 95 % quantile")
    q975: float | None = Field(default=None, description="the 97.5 % quantile")


_PARAMS_DESCRIPTION = (
    "present for a stream with unknown parameters (smc2; model.params given as priors): each one's posterior"
)


class ParamCloud(BaseModel):
    """How much of a smc2 stream's cloud of parameter particles is left (docs/API.md "Unknown parameters"): present
    beside ``params`` — in every answer's summary, and in a per_step entry where the request asked for
    per_step_params."""

    params_ess: float | None = Field(
        default=None,
        description="the effective sample size 1 / sum w_j^2 of the parameter particles' weights (at most "
        "theta_particles; reset to it when the stream resamples and moves them)",
    )
    params_distinct: int | None = Field(
        default=None,
        description="the distinct parameter particles: two are one value when each parameter agrees to a relative "
        "1e-6 in its unconstrained coordinate (log for a positive one, logit for an interval)",
    )
    params_degenerate: bool | None = Field(
        default=None,
        description="true when the cloud has collapsed: params_ess or params_distinct below 10, or some parameter's "
        "sd (unconstrained coordinate) below 1e-3 of its magnitude (at least 1); the stream can no longer learn "
        "it — recreate it with a wider prior or more theta_particles",
    )
    params_rejuvenation: Literal["exact", "checkpointed"] | None = Field(
        default=None,
        description="with kernel mh: 'exact' while the stream has taken at most `history` steps (the moves target "
        "the exact posterior), 'checkpointed' after (they target the posterior of the observations since the last "
        "checkpoint under a Gaussian summary, in the unconstrained coordinates, of what the earlier ones said; "
        "docs/methods.md 'Exact rejuvenation')",
    )


class Summary(ParamCloud):
    mean: list[float]
    cov: list[list[float]]
    std: list[float]
    quantiles: Quantiles = Field(description="per-dimension marginal quantiles (by weight for a weighted cloud)")
    ess: float | None = Field(
        description="effective sample size of the current particles; null for kalman and ukf, whose posterior is a "
        "Gaussian kept exactly (their particles are draws from it, not a weighted cloud)"
    )
    log_evidence: float = Field(description="estimate of log p(o_1..o_step); 0 at step 0")
    params: dict[str, ParamPosterior] | None = Field(default=None, description=_PARAMS_DESCRIPTION)
    pit: list[float | None] | None = Field(
        default=None, description="the latest observed step's predictive p-values (per_step's pit); absent before"
    )
    pit_two_sided: list[float | None] | None = Field(
        default=None, description="per entry of pit, its two-sided p-value 2 min(pit, 1 − pit); null where not observed"
    )
    pit_step: int | None = Field(default=None, description="the step pit belongs to")
    pit_alert: float | None = Field(default=None, description="the stream's two-sided level α (creation's pit_alert)")
    pit_flagged: bool | None = Field(
        default=None, description="true when some entry of pit has |pit − 0.5| > 0.5 − pit_alert/2"
    )
    pit_flags: list[bool] | None = Field(default=None, description="per entry of pit: whether it is flagged")
    log_tail_lower: list[float | None] | None = Field(
        default=None, description="the latest observed step's per_step log_tail_lower (pit's step); absent before"
    )
    log_tail_upper: list[float | None] | None = Field(
        default=None, description="the latest observed step's per_step log_tail_upper (pit's step); absent before"
    )
    surprise: float | None = Field(
        default=None, description="the latest observed step's per_step surprise (nats; pit's step); absent before"
    )
    anomaly_score: float | None = Field(
        default=None,
        description="the latest observed step's per_step anomaly_score (pit's step); null during the warm-up",
    )
    change_score: float | None = Field(
        default=None,
        description="the latest observed step's per_step change_score (pit's step); null during the warm-up",
    )


class StepSummary(ParamCloud):
    step: int
    mean: list[float]
    std: list[float]
    quantiles: dict[str, list[float]] | None = Field(
        default=None,
        description='the marginal quantiles of the state after the step, {"0.025": [...], "0.05": [...], "0.5": '
        '[...], "0.95": [...], "0.975": [...]} (as the summary\'s; at the request\'s levels when it gave some)',
    )
    cov: list[list[float]] | None = Field(
        default=None, description="the state's covariance after the step, where the request asked (per_step_cov)"
    )
    log_evidence_increment: float | None = Field(
        description="estimate of log p(o_m | o_1..o_{m-1}); null for a step with nothing observed (it has no score)"
    )
    ess: float | None = Field(description="the step's effective sample size (docs/API.md); null for kalman and ukf")
    params: dict[str, ParamPosterior] | None = Field(
        default=None, description=_PARAMS_DESCRIPTION + ", only where the request asked for per_step_params"
    )
    pit: list[float | None] | None = Field(
        default=None,
        description="predictive p-value of each observed entry: P(O_j <= o_j | o_1..o_{m-1}) under the method's "
        "predictive (randomised for discrete observations), uniform on (0, 1) when the stream follows its model; "
        "null where the entry was not observed; absent for a family without an observation CDF",
    )
    pit_two_sided: list[float | None] | None = Field(
        default=None,
        description="per entry of pit, the two-sided p-value 2 min(pit, 1 − pit) — what to threshold: below the "
        "stream's pit_alert α exactly where the summary flags the entry; null where not observed",
    )
    log_tail_lower: list[float | None] | None = Field(
        default=None,
        description="per observed entry, ln P(O_j <= o_j | o_1..o_{m-1}) under the same predictive as pit, computed "
        "in log space so that it does not saturate where pit reaches 0 or 1 (a 40-sd reading: about −804.6); "
        "null where not observed; absent for a family without an observation CDF",
    )
    log_tail_upper: list[float | None] | None = Field(
        default=None,
        description="per observed entry, ln P(O_j >= o_j | o_1..o_{m-1}) (as log_tail_lower, the upper tail)",
    )
    surprise: float | None = Field(
        default=None,
        description="the step's surprise in nats (>= 0): −min(0, ln k + min_j ln p_j) over the k observed entries, "
        "ln p_j = min(0, ln 2 + min(log_tail_lower_j, log_tail_upper_j)) — minus the log of the Bonferroni-combined "
        "two-sided p-value; null for a step with nothing observed (and for a family without an observation CDF)",
    )
    anomaly_score: float | None = Field(
        default=None,
        description="in [0, 1]: the larger of change_score and the surprise's rank — the fraction of the stream's "
        "earlier scored steps (those of this request included) whose surprise is below this step's, ties half: the "
        "empirical CDF of the stream's own surprise history (within its sketch's bins; decayed with the stream's "
        "anomaly_memory); what a detector thresholds; null for a step without a surprise and until the stream has "
        "scored anomaly_warmup steps",
    )
    change_score: float | None = Field(
        default=None,
        description="in [0, 1]: evidence of a change (a shift of the mean up or down, or a variance that grew): the "
        "rank of Page's CUSUM log-likelihood ratios on the step's Gaussianised residual among their earlier values, "
        "given when it rises above the highest of the change's run so far, else 0 (docs/API.md 'Surprise and "
        "anomaly score'); null as anomaly_score is",
    )
    acceptance: float | None = Field(
        default=None,
        description="present when the step ran posterior moves (mpf on a static family, method_options.moves): the "
        "mean Metropolis acceptance rate of its MALA moves, 0.5–0.6 when healthy; near 0 the moves left the cloud "
        "where the flow put it",
    )
    flow_fraction: float | None = Field(
        default=None,
        description='present for mpf with method_options.flow_fraction "auto": the share γ of the likelihood the '
        "step's Kalman flow took (0: none, the bootstrap update; the weights took the rest)",
    )
    rescued: bool | None = Field(
        default=None,
        description='present for mpf with method_options.flow_fraction "auto": true when the observation was '
        "inconsistent with the predictive (a χ² test at 1e-7) and the step inflated the cloud before its flow "
        "pulled it back onto the observations — the filter had lost the truth",
    )
    fallback: FallbackName | None = Field(
        default=None,
        description="present when the stream's method failed numerically on this step (non-finite particles, a "
        "covariance no longer positive definite) and the step was computed by this safe method instead (gpf, then "
        "kalman for linear-Gaussian families, then smc); the stream keeps its method",
    )


class OperatorDomain(BaseModel):
    inside: bool = Field(description="the model and the prior lie inside the operator's training domain")
    outside: list[str] = Field(description="each quantity outside it, with its value and the trained range")


#: an mpf stream after two steps (null fields are left out: the OpenAPI examples drop them)
STREAM_DOCUMENT_EXAMPLE: dict[str, Any] = {
    "stream_id": "sensor-42",
    "model": {"family": "linear_gaussian", "params": {}},
    "method": "mpf",
    "operator": "linear_gaussian-d2-v2",
    "untrained": False,
    "method_options": {},
    "capabilities": UPDATERS["mpf"].capabilities_with({}),
    "operator_domain": {"inside": True, "outside": []},
    "num_particles": 256,
    "state_dim": 2,
    "state_names": ["position", "velocity"],
    "seed": 0,
    "ttl_seconds": 86400,
    "step": 2,
    "summary": {
        "mean": [0.4, -0.1],
        "cov": [[0.6, 0.05], [0.05, 0.5]],
        "std": [0.77, 0.71],
        "quantiles": {
            "0.025": [-1.11, -1.49],
            "0.05": [-0.87, -1.27],
            "0.5": [0.4, -0.1],
            "0.95": [1.67, 1.07],
            "0.975": [1.91, 1.29],
        },
        "ess": 256.0,
        "log_evidence": -6.42,
    },
    "created_at": "2026-01-01T00:00:00.000Z",
    "updated_at": "2026-01-01T00:00:01.000Z",
}
#: the answer that took that stream from step 0 to step 2
OBSERVATION_RESULT_EXAMPLE: dict[str, Any] = {
    **STREAM_DOCUMENT_EXAMPLE,
    "duplicate": False,
    "per_step": [
        {
            "step": 1,
            "mean": [0.3, 0.1],
            "std": [0.82, 0.8],
            "quantiles": {
                "0.025": [-1.31, -1.47],
                "0.05": [-1.05, -1.22],
                "0.5": [0.3, 0.1],
                "0.95": [1.65, 1.42],
                "0.975": [1.91, 1.67],
            },
            "log_evidence_increment": -3.3,
            "ess": 256.0,
        },
        {  # the last step is the stream's summary
            "step": 2,
            **{k: STREAM_DOCUMENT_EXAMPLE["summary"][k] for k in ("mean", "std", "quantiles")},
            "log_evidence_increment": -3.12,
            "ess": 256.0,
        },
    ],
}


#: what a method can do (:data:`mpflow.operators.updaters.CAPABILITIES`, declared by each updater class)
Capabilities = create_model(
    "Capabilities",
    __doc__="What the stream's method does, with the stream's options (declared by the method; GET /v1/models).",
    **{name: (bool, Field(description=meaning)) for name, meaning in CAPABILITIES.items()},
)
MethodInfo = create_model(
    "MethodInfo",
    __base__=Capabilities,
    __doc__="A method and what it does with its default options.",
    weighted_with=(
        dict[str, Any],
        Field(description='options that make the cloud weighted (mpf: {"flow_fraction": "auto"}); {} for none'),
    ),
)


class StreamDocument(BaseModel):
    stream_id: str
    model: dict[str, Any]
    method: str
    operator: str | None = Field(description="the trained operator (mpf), else null")
    untrained: bool = Field(
        description="true for an mpf stream without a trained operator (operator null): it runs the untrained "
        "Daum–Huang base flow; false otherwise"
    )
    method_options: dict[str, Any] = Field(
        default_factory=dict, description="the stream's own method options (mpf: substeps), chosen with the default"
    )
    method_reason: str | None = Field(
        default=None, description="why the server chose the method when the request named none, else null"
    )
    capabilities: Capabilities | None = Field(  # type: ignore[valid-type]
        default=None,
        description="what the method does with this stream's options (weighted: read the particles by weight, "
        "their ESS is meaningful); null for a stored method this server does not run",
    )
    operator_domain: OperatorDomain | None = Field(
        default=None,
        description="a stream run by a trained operator: whether its model and prior lie inside the region the "
        "operator was trained on; null without an operator",
    )
    num_particles: int
    state_bytes: int | None = Field(
        default=None,
        description="the bytes of the stream's tensors in the store, fixed for its life (null for a stream created "
        "before servers reported it)",
    )
    state_dim: int
    state_names: list[str] | None = Field(
        default=None,
        description="the names of the state's dimensions: the creation request's state_names, else the model "
        "family's (range_bearing: px, py, vx, vy); null where neither gives them (call them x[0] … x[d-1])",
    )
    seed: int
    ttl_seconds: int
    step: int
    smoothing_lag: int = Field(default=0, description="the steps kept for GET .../smoothed (0: none)")
    summary: Summary
    created_at: str
    updated_at: str

    model_config = ConfigDict(json_schema_extra={"examples": [STREAM_DOCUMENT_EXAMPLE]})


class ObservationResult(StreamDocument):
    duplicate: bool = Field(description="true: the batch was already applied; nothing was applied again")
    per_step: list[StepSummary] = Field(description="one entry per step applied by this request")
    samples: list[list[float]] | None = Field(default=None, description="when return_samples > 0")
    fallback: FallbackName | None = Field(
        default=None,
        description="present when some step of this request fell back to a safe method (per_step says which; "
        "if several steps fell back to different methods, the last one's)",
    )

    model_config = ConfigDict(json_schema_extra={"examples": [OBSERVATION_RESULT_EXAMPLE]})


class StreamListItem(BaseModel):
    stream_id: str
    model: dict[str, Any]
    method: str
    operator: str | None = None
    step: int
    created_at: str | None = None
    updated_at: str


class StreamList(BaseModel):
    streams: list[StreamListItem]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last page")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "streams": [
                        {
                            "stream_id": "sensor-42",
                            "model": {"family": "linear_gaussian", "params": {}},
                            "method": "mpf",
                            "operator": "linear_gaussian-d2-v2",
                            "step": 2,
                            "created_at": "2026-01-01T00:00:00.000Z",
                            "updated_at": "2026-01-01T00:00:01.000Z",
                        }
                    ],
                    "next_cursor": "c2Vuc29yLTQy",
                }
            ]
        }
    )


class SamplesResponse(BaseModel):
    samples: list[list[float]]

    model_config = ConfigDict(json_schema_extra={"examples": [{"samples": [[0.41, -0.2], [1.02, 0.33]]}]})


class Predictive(BaseModel):
    mean: list[float]
    cov: list[list[float]]
    quantiles: Quantiles = Field(description="per-dimension marginal quantiles")
    samples: list[list[float]] | None = Field(default=None, description="draws, when ?samples=n > 0")


class SmoothedStep(BaseModel):
    step: int = Field(description="the step s")
    mean: list[float] = Field(description="the mean of p(x_s | o_1..o_t)")
    cov: list[list[float]] = Field(description="its covariance")


class SmoothedResponse(BaseModel):
    stream_id: str
    step: int = Field(description="t: the stream's step (observations applied)")
    lag: int = Field(description="L: the stream's smoothing_lag")
    steps: list[SmoothedStep] = Field(description="s = t − min(L, t) + 1 … t, oldest first; the last is the filter's")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "stream_id": "sensor-42",
                    "step": 12,
                    "lag": 2,
                    "steps": [
                        {"step": 11, "mean": [0.41, -0.2], "cov": [[0.3, 0.01], [0.01, 0.28]]},
                        {"step": 12, "mean": [0.52, -0.1], "cov": [[0.35, 0.02], [0.02, 0.31]]},
                    ],
                }
            ]
        }
    )


class ForecastStep(BaseModel):
    step: int = Field(description="the step this horizon would be (the stream's step + j)")
    t: float = Field(description="the time ahead of the stream's current state, j·dt")
    state: Predictive = Field(description="p(x_{step+j} | o_1..o_step)")
    observation: Predictive | None = Field(
        description="p(o_{step+j} | o_1..o_step), flattened; null for logistic (its features are the caller's)"
    )


class ForecastResponse(BaseModel):
    stream_id: str
    step: int = Field(description="the stream's step, unchanged by the forecast")
    state_names: list[str] | None = Field(
        default=None, description="the names of the state's dimensions, as in the stream document (null: none)"
    )
    forecast: list[ForecastStep]


class ParticlesResponse(BaseModel):
    particles: list[list[float]]
    log_weights: list[float] = Field(
        description="normalised; uniform unless capabilities.weighted; a particle of zero weight has the most "
        "negative double, -1.7976931348623157e308 (JSON has no -Infinity)"
    )


#: the history of the stream of ``STREAM_DOCUMENT_EXAMPLE`` (its second step posted with its duration)
HISTORY_EXAMPLE: dict[str, Any] = {
    "stream_id": "sensor-42",
    "step": 2,
    "history_steps": 500,
    "steps": [
        {**OBSERVATION_RESULT_EXAMPLE["per_step"][0], "observation": [0.3, -1.2]},
        {**OBSERVATION_RESULT_EXAMPLE["per_step"][1], "observation": [0.1, -0.9], "dt": 0.5},
    ],
}


class HistoryStep(StepSummary):
    observation: Annotated[
        Any, WithJsonSchema({"anyOf": _OBSERVATION_VALUES, "description": "the observation as posted"})
    ] = Field(description="the step's observation as posted (null: none, or left out: observation_omitted)")
    observation_omitted: bool | None = Field(
        default=None, description="true when the observation was too large to keep (over 4096 bytes of JSON)"
    )
    dt: float | None = Field(default=None, description="the step's dt, when the request gave one")
    u: list[float] | None = Field(default=None, description="the step's inputs, when the request gave them")


class HistoryResponse(BaseModel):
    stream_id: str
    step: int = Field(description="the stream's current step")
    history_steps: int = Field(description="the most steps a stream keeps (MPFLOW_HISTORY_STEPS)")
    steps: list[HistoryStep] = Field(description="the latest applied steps, oldest first")

    model_config = ConfigDict(json_schema_extra={"examples": [HISTORY_EXAMPLE]})


class BatchResult(BaseModel):
    stream_id: str
    status: int
    stream: ObservationResult | None = None
    error: ErrorDetail | None = None


class BatchResponse(BaseModel):
    results: list[BatchResult]

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "results": [
                        {"stream_id": "sensor-42", "status": 200, "stream": OBSERVATION_RESULT_EXAMPLE},
                        {
                            "stream_id": "sensor-7",
                            "status": 404,
                            "error": {"code": "stream_not_found", "message": "stream_id: no stream 'sensor-7'"},
                        },
                    ]
                }
            ]
        }
    )


class ParamInfo(BaseModel):
    name: str
    kind: str
    required: bool
    default: str | None = None
    learnable: bool = Field(default=False, description="may be given as a prior (learned by smc2)")


class FamilyInfo(BaseModel):
    family: str
    dynamic: bool
    linear_gaussian: bool
    description: str
    state_dim: dict[str, int | None] = Field(description="fixed, or min/max of the state dimension")
    observation: str = Field(description="the shape of one step's observation")
    parameters: list[ParamInfo]
    methods: list[str] = Field(description="methods that can run this family")


class ModelsResponse(BaseModel):
    families: list[FamilyInfo]
    methods: list[str] = Field(description="every method this server runs")
    capabilities: dict[str, MethodInfo] = Field(  # type: ignore[valid-type]
        description="each method's capabilities (declared by the method) with its default options"
    )


class OperatorInfo(BaseModel):
    name: str
    kind: str
    family: str
    state_dim: int
    obs_dim: int
    version: int
    metrics: dict[str, Any]
    created: str
    content_hash: str
    auto_select: bool = Field(
        description="method mpf picks it for a stream of its family and d that names no operator (the newest such); "
        "false: measured no better than its base flow at equal compute, it serves only a stream that names it"
    )
    auto_select_note: str | None = Field(description="why it is (not) picked automatically, where its config says")


class OperatorsResponse(BaseModel):
    operators: list[OperatorInfo]


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    store: bool
    operators: bool
    degraded_shards: list[str] = Field(
        default=[], description="primaries with fewer replicas in sync than MPFLOW_REDIS_WAIT_REPLICAS needs"
    )


__all__ = [
    "BatchRequest",
    "BatchResponse",
    "CreateStreamRequest",
    "ErrorResponse",
    "ForecastResponse",
    "ModelsResponse",
    "ObservationResult",
    "ObservationsRequest",
    "OperatorsResponse",
    "ParticlesResponse",
    "SamplesResponse",
    "StreamDocument",
    "StreamList",
]
