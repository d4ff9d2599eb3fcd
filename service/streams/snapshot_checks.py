"""What an imported snapshot must satisfy, whoever signed it: every field of its stream description and every
tensor of its state is checked as creation checks a new stream's (docs/API.md "export / import"). A signature
says who wrote a snapshot, not that the writer was honest or that the server that wrote it had today's limits.

Stream description (each refusal is a 422 ``snapshot: stream.<field>: …`` naming the field):

* ``num_particles``, ``state_dim``: positive integers within this server's limits (413, as at creation);
  ``ttl_seconds`` 1 … :data:`~mpflow.service.schemas.MAX_TTL_SECONDS`; ``seed`` 0 … 2⁶³−1;
* ``step``: 0 … :data:`MAX_STEP` = 2⁵³−1 — far from int64's 2⁶³−1 (a step near it overflows to a negative step
  on the next update), and exact in every JSON reader (a JavaScript number); a billion steps a second for 104
  days;
* ``log_evidence``: a finite number (the state's own);
* ``model``: the creation request's schema (:class:`~mpflow.service.schemas.ModelSpec`, strict: no unknown field,
  numbers in the float32 range) and the family's validation;
* ``prior``: as the stream keeps it (:func:`~mpflow.service.streams.creation.stored_prior`): a ``particles`` prior as
  exactly ``{"type", "num_particles", "state_dim"}`` of this stream; any other, the creation request's schema and
  :func:`~mpflow.operators.models.priors.prior_from_spec` (a ``sampler`` by its registered name's form; the
  sampler itself is not needed once the particles are drawn);
* ``method`` one of this server's, ``method_options`` what a client may set on a stream of it;
* ``method_reason``: null or a string of at most :data:`MAX_METHOD_REASON_LENGTH` characters;
* ``operator`` and ``operator_content_hash``: both null, or a registered name's form and 64 hex digits (whether
  this server has that operator is the service's check: 422 ``operator_unavailable``); ``operator_domain``: null
  without an operator, else ``{"inside": bool, "outside": [phrases]}`` with at most :data:`MAX_DOMAIN_PHRASES`
  phrases of at most :data:`MAX_DOMAIN_PHRASE_LENGTH` characters, ``inside`` exactly when there are none;
* ``state_names``: as at creation (:func:`~mpflow.service.streams.creation.check_state_names`);
* ``smoothing_lag``: 0 … 100 (absent: 0); the window's bytes within the cost model, as at creation, and its
  values as its method's smoother reads them (:mod:`.snapshot_tensors`: the clouds of ``smc``'s window, their
  ancestor indices within 0 … N − 1, the RTS window's covariances).
* ``pit_alert``: null (the default level) or a number in (0, 1), as at creation; ``pit`` and ``pit_step``, the
  latest observed step's predictive p-values (:func:`check_pit`): both null, or ``pit_step`` 1 … ``step`` and
  ``pit`` one entry per entry of the family's observation (for a family whose observation has a free size,
  ``logistic``'s M labels, at least one: bounded by the snapshot's body limit, as the step that made it was by its
  request's), each null (not observed) or a probability Σᵢ wᵢ F(o | xᵢ) in [0, 1] — within the normalised weights'
  tolerance :data:`LOG_WEIGHT_TOLERANCE` above 1, as a sum of float weights may land.
* ``anomaly_memory`` and ``anomaly_warmup``: null (the defaults) or integers within the creation bounds;
  ``anomaly_state``: null (a new one) or the detector's stored form (:func:`~mpflow.service.engine.anomaly.check`:
  four sketches of at most :data:`~mpflow.service.engine.anomaly.BINS` bins and three CUSUMs); ``log_tail_lower``,
  ``log_tail_upper``, ``surprise``, ``anomaly_score`` and ``change_score``, the latest observed step's
  (:func:`check_anomaly`): null, or as many log tails as ``pit`` has entries (each null or ≤ 0), a surprise ≥ 0 and
  scores in [0, 1].

State (422 ``snapshot: state.<field>: …``): the core tensors with this stream's shapes and dtypes (particles
[1, N, d] float32, log-weights [1, N] float32, step [1] int64 equal to the description's, log-evidence [1]
float64 equal to the description's); every float tensor finite (:func:`~mpflow.service.engine.numerics.finite_state`);
weights normalised — logsumexp of the log-weights within :data:`LOG_WEIGHT_TOLERANCE` of 0 (they are
non-negative by construction), and the same for a step-0 prior mixture's ``prior_weights``; and no tensor the
method's state does not have: the fields of the state must be among those of the *reference* state, the state
this server's updater makes at step 0 from the same model and prior (a ``particles`` or ``sampler`` prior: the
snapshot's own particles), with the same shapes and dtypes — made small (:func:`reference_fields`: two states of
a few particles tell which dimensions count particles). A state never gains a tensor after step 0 (checked for
every method in tests/unit/test_snapshot_checks.py), so the reference lists every tensor a genuine snapshot
holds. The summary of an imported state must lie in the
float32 range as a new stream's must (:func:`~mpflow.service.engine.numerics.within_float32`). The values of
every other tensor the method keeps — its smoothing window, ``smc2``'s θ-cloud, its extras — are
:mod:`.snapshot_tensors`' to check.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import ParticlePrior, Prior, prior_from_spec
from mpflow.operators.registry import NAME_RE
from mpflow.operators.smoothing import check_lag
from mpflow.operators.state import ParticleState
from mpflow.operators.updaters import UPDATERS
from mpflow.service.engine import anomaly
from mpflow.service.engine.methods import Methods, check_stream_options
from mpflow.service.engine.numerics import finite_state
from mpflow.service.errors import ApiError, invalid
from mpflow.service.schemas import MAX_SEED, MAX_TTL_SECONDS, ModelSpec
from mpflow.service.schemas import Prior as PriorSchema
from mpflow.service.settings import Settings
from mpflow.service.streams.creation import check_limits, check_state_names
from pydantic import TypeAdapter, ValidationError

#: the largest step a snapshot may carry (module docstring)
MAX_STEP = 2**53 - 1
#: the longest ``method_reason`` kept (the server's own are under 1000 characters)
MAX_METHOD_REASON_LENGTH = 4096
#: ``operator_domain.outside``: at most this many phrases (one per domain quantity), each at most this long
MAX_DOMAIN_PHRASES = 64
MAX_DOMAIN_PHRASE_LENGTH = 256
#: |logsumexp(log-weights)| allowed (float32 rounding of normalised weights: ~1e-7 measured)
LOG_WEIGHT_TOLERANCE = 1e-3
#: the dtype of each core field of a state
CORE_DTYPES = {
    "particles": torch.float32,
    "log_weights": torch.float32,
    "step": torch.int64,
    "log_evidence": torch.float64,
    "rng": torch.int64,
    "log_density": torch.float32,
}
_HASH = re.compile(r"^[0-9a-f]{64}$")
#: the creation request's prior schema, on its own
_PRIOR_SCHEMA = TypeAdapter(PriorSchema)


def refuse(why: str) -> ApiError:
    """The 422 of a snapshot that is refused: ``why`` names the field."""
    return invalid(f"snapshot: {why}; nothing was created")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    """An int or a float from JSON (not a bool)."""
    return isinstance(value, float | int) and not isinstance(value, bool)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
    return f"{where + ': ' if where else ''}{err['msg']}"[:300]


def check_numbers(settings: Settings, stream: dict[str, Any]) -> None:
    """The description's sizes, limits, seed, TTL, step, log-evidence and state names (module docstring)."""
    n, d, ttl = stream["num_particles"], stream["state_dim"], stream["ttl_seconds"]
    for name, value in (("num_particles", n), ("state_dim", d), ("ttl_seconds", ttl)):
        if not (_whole(value) and value > 0):
            raise refuse(f"stream.{name}: a positive integer, got {str(value)[:40]!r}")
    check_limits(settings, n, d)
    if ttl > MAX_TTL_SECONDS:
        raise refuse(f"stream.ttl_seconds: at most {MAX_TTL_SECONDS}")
    if not (_whole(stream["seed"]) and 0 <= stream["seed"] <= MAX_SEED):
        raise refuse(f"stream.seed: an integer from 0 to {MAX_SEED}")
    if not (_whole(stream["step"]) and 0 <= stream["step"] <= MAX_STEP):
        raise refuse(f"stream.step: an integer from 0 to {MAX_STEP}")
    evidence = stream["log_evidence"]
    if not (_number(evidence) and math.isfinite(evidence)):
        raise refuse("stream.log_evidence: a finite number")
    try:
        check_state_names(stream["state_names"], d)
        check_lag(stream.get("smoothing_lag") or 0, "smoothing_lag")
    except ValueError as exc:
        raise refuse(f"stream.{exc}") from None


def _probability(value: object) -> bool:
    """A number in [0, 1] (up to e^:data:`LOG_WEIGHT_TOLERANCE` above 1: a weighted sum of CDF values whose
    weights sum to 1 within that tolerance)."""
    return _number(value) and 0.0 <= value <= math.exp(LOG_WEIGHT_TOLERANCE)


def check_pit(stream: dict[str, Any], model: ModelFamily) -> None:
    """``pit_alert``, ``pit`` and ``pit_step`` as a stream of ``model`` at the description's step holds them
    (module docstring)."""
    alert = stream["pit_alert"]
    if alert is not None and not (_number(alert) and 0 < alert < 1):
        raise refuse("stream.pit_alert: null or a number in (0, 1)")
    pit, at = stream["pit"], stream["pit_step"]
    if pit is None and at is None:
        return
    if not (_whole(at) and 1 <= at <= stream["step"]):
        raise refuse("stream.pit_step: null with pit, else an integer from 1 to the stream's step")
    free = any(size < 0 for size in model.obs_shape)
    k = model.observation_size()
    size = "at least 1" if free else f"{k}"
    if not (isinstance(pit, list) and (len(pit) >= 1 if free else len(pit) == k)):
        raise refuse(f"stream.pit: null with pit_step, else a list of {size} entries (one per observed entry)")
    if not all(u is None or _probability(u) for u in pit):
        raise refuse("stream.pit: each entry null (not observed) or a probability in [0, 1]")


def check_anomaly(stream: dict[str, Any]) -> None:
    """The anomaly score's fields (module docstring): the options as at creation, the sketch as
    :func:`mpflow.service.engine.anomaly.check` reads it, the latest step's log tails (as many as ``pit``'s
    entries, each null or a number ≤ 0), surprise (null or a number ≥ 0) and anomaly score (null or in [0, 1])."""
    memory, warmup = stream["anomaly_memory"], stream["anomaly_warmup"]
    if memory is not None and not (_whole(memory) and 0 <= memory <= anomaly.MAX_MEMORY):
        raise refuse(f"stream.anomaly_memory: null or an integer from 0 to {anomaly.MAX_MEMORY}")
    if warmup is not None and not (_whole(warmup) and 0 <= warmup <= anomaly.MAX_WARMUP):
        raise refuse(f"stream.anomaly_warmup: null or an integer from 0 to {anomaly.MAX_WARMUP}")
    if stream["anomaly_state"] is not None:
        try:
            anomaly.check(stream["anomaly_state"])
        except ValueError as exc:
            raise refuse(f"stream.anomaly_state: null or {exc}") from None
    size = len(stream["pit"]) if isinstance(stream["pit"], list) else 0
    for key in ("log_tail_lower", "log_tail_upper"):
        tails = stream[key]
        if tails is not None and not (
            isinstance(tails, list) and len(tails) == size and all(v is None or (_number(v) and v <= 0) for v in tails)
        ):
            raise refuse(f"stream.{key}: null, or a list of as many entries as pit, each null or a number ≤ 0")
    s = stream["surprise"]
    if s is not None and not (_number(s) and s >= 0):
        raise refuse("stream.surprise: null or a number ≥ 0")
    for key in ("anomaly_score", "change_score"):
        score = stream[key]
        if score is not None and not (_number(score) and 0 <= score <= 1):
            raise refuse(f"stream.{key}: null or a number in [0, 1]")


def check_method(stream: dict[str, Any]) -> None:
    """Method, its stream options, the reason it was chosen, the operator's name, hash and domain."""
    method, options = stream["method"], stream["method_options"]
    if method not in UPDATERS:
        raise refuse(f"stream.method: one of {sorted(UPDATERS)}")
    if not isinstance(options, dict | None):
        raise refuse("stream.method_options: an object")
    if options:  # only what a client may set on its own stream
        check_stream_options(method, options)
    reason = stream["method_reason"]
    if not (reason is None or (isinstance(reason, str) and len(reason) <= MAX_METHOD_REASON_LENGTH)):
        raise refuse(f"stream.method_reason: null or a string of at most {MAX_METHOD_REASON_LENGTH} characters")
    operator, content_hash = stream["operator"], stream["operator_content_hash"]
    if operator is None:
        if content_hash is not None or stream["operator_domain"] is not None:
            raise refuse("stream.operator_content_hash: null (and operator_domain null) without an operator")
        return
    if method != "mpf" or not (isinstance(operator, str) and NAME_RE.match(operator)):
        raise refuse("stream.operator: null, or an mpf stream's registered operator name <family>-d<d>-v<k>")
    if not (isinstance(content_hash, str) and _HASH.match(content_hash)):
        raise refuse("stream.operator_content_hash: 64 lower-case hex digits")
    check_domain(stream["operator_domain"])


def check_domain(domain: object) -> None:
    """``{"inside": bool, "outside": [phrases]}``, ``inside`` exactly when no phrase (module docstring)."""
    shape = (
        "an object {inside, outside}: outside a list of at most "
        f"{MAX_DOMAIN_PHRASES} strings of at most {MAX_DOMAIN_PHRASE_LENGTH} characters, inside true exactly when "
        "it is empty"
    )
    if not (isinstance(domain, dict) and set(domain) == {"inside", "outside"}):
        raise refuse(f"stream.operator_domain: {shape}")
    inside, outside = domain["inside"], domain["outside"]
    if not (isinstance(outside, list) and len(outside) <= MAX_DOMAIN_PHRASES):
        raise refuse(f"stream.operator_domain: {shape}")
    if not all(isinstance(p, str) and len(p) <= MAX_DOMAIN_PHRASE_LENGTH for p in outside):
        raise refuse(f"stream.operator_domain: {shape}")
    if inside is not (not outside):
        raise refuse(f"stream.operator_domain: {shape}")


def model_and_prior(methods: Methods, stream: dict[str, Any]) -> tuple[ModelFamily, Prior | None]:
    """The validated model, and the prior as a density (None for a ``particles`` or ``sampler`` prior)."""
    d = stream["state_dim"]
    try:
        spec = ModelSpec.model_validate(stream["model"]).model_dump()
    except ValidationError as exc:
        raise refuse(f"stream.model: {_first_error(exc)}") from None
    try:
        model = methods.model(spec, d)
    except ValueError as exc:
        raise refuse(f"stream.model: {exc}") from None
    prior = stream["prior"]
    if isinstance(prior, dict) and prior.get("type") == "particles":
        if prior != {"type": "particles", "num_particles": stream["num_particles"], "state_dim": d}:
            raise refuse("stream.prior: a particles prior is kept as exactly {type, num_particles, state_dim}")
        return model, None
    try:
        parsed = _PRIOR_SCHEMA.validate_python(prior).model_dump()
    except ValidationError as exc:
        raise refuse(f"stream.prior: {_first_error(exc)}") from None
    if parsed["type"] == "sampler":
        if not NAME_RE.match(parsed["name"]):
            raise refuse("stream.prior.name: a registered sampler name <family>-d<d>-v<k>")
        return model, None
    try:
        return model, prior_from_spec(parsed, d)
    except ValueError as exc:
        raise refuse(f"stream.{exc}") from None


def check_core(stream: dict[str, Any], state: ParticleState) -> None:
    """The state's core tensors: shapes, dtypes, agreement with the description, finite, normalised weights."""
    n, d = stream["num_particles"], stream["state_dim"]
    shapes = {"particles": (1, n, d), "log_weights": (1, n), "step": (1,), "log_evidence": (1,), "log_density": (1, n)}
    for name, t in state.fields().items():
        if name in CORE_DTYPES and t.dtype != CORE_DTYPES[name]:
            raise refuse(f"state.{name}: {t.dtype}, expected {CORE_DTYPES[name]}")
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise refuse(f"state.{name}: shape {list(t.shape)}, expected {list(shapes[name])}")
    if int(state.step[0]) != stream["step"]:
        raise refuse("state.step: differs from the stream description's step")
    if float(state.log_evidence[0]) != stream["log_evidence"]:
        raise refuse("state.log_evidence: differs from the stream description's log_evidence")
    if not finite_state(state):
        raise refuse("state: holds NaN or infinite values")
    if not normalised(state.log_weights):
        raise refuse(f"state.log_weights: the weights must sum to 1 (|logsumexp| ≤ {LOG_WEIGHT_TOLERANCE})")
    weights = state.extras.get("prior_weights")
    if weights is not None and not (weights.is_floating_point() and (weights >= 0).all() and normalised(weights.log())):
        raise refuse("state.extras.prior_weights: non-negative weights that sum to 1")


def normalised(log_weights: torch.Tensor) -> bool:
    """Whether each row's weights sum to 1 within :data:`LOG_WEIGHT_TOLERANCE` (in log space, float64)."""
    total = torch.logsumexp(log_weights.to(torch.float64), dim=-1)
    return bool((total.abs() <= LOG_WEIGHT_TOLERANCE).all())


#: particles of the small reference states (at least this many, and more than d: module docstring)
REFERENCE_PARTICLES = 8
#: what a state's tensors must be: name → (dtype, shape)
Expected = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def reference_fields(init: Callable[[int], ParticleState], n: int, d: int, whole: bool = False) -> Expected:
    """The tensors of the method's step-0 state with ``n`` particles, from ``init(m)`` (the state made with m
    particles) at two small sizes m and m + 1: a dimension that differs between them is a particle count (n),
    one that does not is fixed — so no full-size reference is drawn (measured: 2.2 s at N = 65536, d = 64 for
    smc's; two small ones, ~1 ms). With n itself small, or ``whole`` — a method whose tensors are not all of size n or
    fixed (``smc2``'s θ-particles: a divisor of n) —, the reference is made at n."""
    small = max(REFERENCE_PARTICLES, d + 2)
    if whole or n <= small + 1:
        return {k: (t.dtype, tuple(t.shape)) for k, t in init(n).fields().items()}
    a, b = init(small).fields(), init(small + 1).fields()
    if set(a) != set(b):
        raise refuse(f"stream: the method's state has different tensors at {small} and {small + 1} particles")
    return {
        k: (t.dtype, tuple(n if x != y else x for x, y in zip(t.shape, b[k].shape, strict=True))) for k, t in a.items()
    }


def reference_prior(prior: Prior | None, state: ParticleState, m: int) -> Prior:
    """The prior the reference state with ``m`` particles is made from: the stream's density, else the snapshot's
    own first ``m`` particles."""
    return prior if prior is not None else ParticlePrior(state.particles[:, :m])


def check_fields(state: ParticleState, expected: Expected) -> None:
    """No tensor the method's state does not have, each with the reference state's dtype and shape."""
    for name, t in state.fields().items():
        if name not in expected:
            raise refuse(f"state.{name}: not a tensor of this method's state ({sorted(expected)})")
        dtype, shape = expected[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise refuse(f"state.{name}: {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")


#: the anomaly score's fields of a stream description (:func:`check_anomaly`)
ANOMALY_FIELDS = (
    "log_tail_lower",
    "log_tail_upper",
    "surprise",
    "anomaly_score",
    "change_score",
    "anomaly_memory",
    "anomaly_warmup",
    "anomaly_state",
)


__all__ = [
    "ANOMALY_FIELDS",
    "CORE_DTYPES",
    "LOG_WEIGHT_TOLERANCE",
    "MAX_DOMAIN_PHRASES",
    "MAX_DOMAIN_PHRASE_LENGTH",
    "MAX_METHOD_REASON_LENGTH",
    "MAX_STEP",
    "REFERENCE_PARTICLES",
    "Expected",
    "check_anomaly",
    "check_core",
    "check_domain",
    "check_fields",
    "check_method",
    "check_numbers",
    "check_pit",
    "model_and_prior",
    "normalised",
    "reference_fields",
    "reference_prior",
    "refuse",
]
