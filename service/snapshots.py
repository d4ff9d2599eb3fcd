"""Stream snapshots: ``GET /v1/streams/{id}/export`` and ``POST /v1/streams:import`` (docs/API.md).

A snapshot is one safetensors file (Content-Type :data:`MEDIA_TYPE`; no pickle, nothing executable): the stream's
state tensors exactly as the store keeps them (particles, log-weights, step, log-evidence, the generator state,
the method's extras) and, in the header's metadata, ``format`` (:data:`FORMAT`, the version), ``stream`` — the
stream's description as canonical JSON: model, prior, method, its options, the trained operator and that
operator's content hash, N, d, seed, TTL, step, log-evidence, the state's names (``state_names``; a snapshot of
an older server lacks them: read as null) — and ``sha256``, the SHA-256 of
``format ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes``, so a truncated or altered snapshot is recognised.

Import refuses, with a 4xx saying why and before anything is written: what is not such a file or is truncated,
a checksum that does not match, another format version, a snapshot over this server's limits (413), an operator
this server does not have or has with other content (422 ``operator_unavailable``), a model, method or state
that does not validate — the state's tensors must have the shapes and dtypes of the stream they describe, be
finite, and take a step of the method (a step without a measurement, computed and thrown away). The imported
stream gets the caller's tenant, the given or a new id, and the state bytes of the original, so it continues
exactly as the original would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.operators.updaters import UPDATERS, Updater
from mpflow.service import costs, views
from mpflow.service import summary as summaries
from mpflow.service.creation import check_limits, check_state_names
from mpflow.service.documents import document, now
from mpflow.service.errors import ApiError, invalid
from mpflow.service.methods import Methods, check_stream_options
from mpflow.service.numerics import finite_json, finite_state
from mpflow.service.schemas import MAX_SEED, MAX_TTL_SECONDS
from mpflow.service.settings import Settings
from mpflow.service.store import StreamStore
from mpflow.service.stream_errors import OperatorUnavailableError, StreamExistsError
from mpflow.service.tensor_work import TensorWork

FORMAT = "mpflow-snapshot-v1"
MEDIA_TYPE = "application/octet-stream"
#: the stream's description a snapshot carries (its ``stream`` metadata)
STREAM_FIELDS = (
    "model",
    "prior",
    "method",
    "operator",
    "operator_content_hash",
    "method_options",
    "method_reason",
    "operator_domain",
    "num_particles",
    "state_dim",
    "seed",
    "ttl_seconds",
    "step",
    "log_evidence",
    "state_names",
)
#: fields a snapshot's description may lack (written by an older server): read as null
OPTIONAL_STREAM_FIELDS = frozenset({"state_names"})
#: the dtype of each core field of a state (extras are the method's, checked by a dry step)
CORE_DTYPES = {
    "particles": torch.float32,
    "log_weights": torch.float32,
    "step": torch.int64,
    "log_evidence": torch.float64,
    "rng": torch.int64,
    "log_density": torch.float32,
}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def checksum(stream: str, state_bytes: bytes) -> str:
    """SHA-256 of ``FORMAT ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes`` (hex)."""
    return hashlib.sha256(FORMAT.encode() + b"\0" + stream.encode() + b"\0" + state_bytes).hexdigest()


def encode(meta: dict[str, Any], data: bytes) -> bytes:
    """The snapshot of a stored stream (``meta`` with the operator's content hash, state bytes ``data``)."""
    stream = _canonical({k: meta.get(k) for k in STREAM_FIELDS})
    state = ParticleState.from_bytes(data)
    return state.to_bytes({"format": FORMAT, "stream": stream, "sha256": checksum(stream, data)})


def _refuse(why: str) -> Exception:
    return invalid(f"snapshot: {why}; nothing was created")


def decode(body: bytes) -> tuple[dict[str, Any], ParticleState, bytes]:
    """(stream description, state, state bytes as stored) of a snapshot; 422 saying why it is refused."""
    try:
        meta = read_metadata(body)
    except ValueError as exc:
        raise _refuse(f"not an mpflow snapshot ({exc})") from None
    if meta.get("format") != FORMAT:
        raise _refuse(f"format {meta.get('format')!r} is not one this server reads ({FORMAT})")
    if not isinstance(meta.get("stream"), str) or not isinstance(meta.get("sha256"), str):
        raise _refuse("the stream description or its checksum is missing")
    try:
        state = ParticleState.from_bytes(body)
        data = state.to_bytes()
    except Exception as exc:  # safetensors refuses truncated or inconsistent data in several ways
        raise _refuse(f"the state cannot be read, it is truncated or corrupt ({type(exc).__name__})") from None
    if checksum(meta["stream"], data) != meta["sha256"]:
        raise _refuse("its checksum does not match its content: it was truncated or altered")
    try:
        stream = json.loads(meta["stream"])
    except json.JSONDecodeError:
        raise _refuse("the stream description is not JSON") from None
    required = set(STREAM_FIELDS) - OPTIONAL_STREAM_FIELDS
    if not isinstance(stream, dict) or not required <= set(stream) <= set(STREAM_FIELDS):
        raise _refuse(
            f"the stream description must have the fields {list(STREAM_FIELDS)} "
            f"({', '.join(sorted(OPTIONAL_STREAM_FIELDS))} optional) and no others"
        )
    return {k: stream.get(k) for k in STREAM_FIELDS}, state, data


def _check_state(stream: dict[str, Any], state: ParticleState) -> None:
    """The state's core tensors have the shapes and dtypes of the stream they belong to."""
    n, d = stream["num_particles"], stream["state_dim"]
    shapes = {"particles": (1, n, d), "log_weights": (1, n), "step": (1,), "log_evidence": (1,), "log_density": (1, n)}
    for name, t in state.fields().items():
        if name in CORE_DTYPES and t.dtype != CORE_DTYPES[name]:
            raise _refuse(f"state field {name} is {t.dtype}, expected {CORE_DTYPES[name]}")
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise _refuse(f"state field {name} has shape {list(t.shape)}, expected {list(shapes[name])}")
        if name.startswith("extras.") and (t.dim() == 0 or t.shape[0] != 1):
            raise _refuse(f"state field {name} is not one stream's")
    if int(state.step[0]) != stream["step"] or float(state.log_evidence[0]) != stream["log_evidence"]:
        raise _refuse("the state's step or log-evidence differs from the stream description's")
    if not finite_state(state):
        raise _refuse("the state holds NaN or infinite values")


def _one_step(model: ModelFamily, updater: Updater, n: int) -> costs.Cost:
    """The cost of the predict step an import runs on n particles to check the state (and of any later step)."""
    return costs.observations_cost(model, updater, n, [(1.0, None)], 0)


class Snapshots:
    """Exports and imports streams (module docstring)."""

    def __init__(self, settings: Settings, store: StreamStore, methods: Methods, work: TensorWork) -> None:
        self.settings = settings
        self.store = store
        self.methods = methods
        self.work = work

    async def export(self, tenant: str, stream_id: str) -> bytes:
        """The snapshot of the caller's stream (404 for an unknown one or another tenant's)."""
        meta, data = await views.read(self.store, tenant, stream_id)
        operator = meta.get("operator")
        if operator is not None:
            record = self.methods.operators.by_name(operator)
            content_hash = record.content_hash if record is not None else meta.get("operator_content_hash")
            if content_hash is None:
                raise OperatorUnavailableError(f"operator: {operator!r} is not installed on this server")
            meta = {**meta, "operator_content_hash": content_hash}
        return await self.work.run(meta, encode, meta, data)

    async def import_(self, tenant: str, body: bytes, stream_id: str | None) -> dict[str, Any]:
        """Recreate a snapshot's stream for ``tenant`` under ``stream_id`` (a new id when None): its document."""
        stream, state, data = await self.work.off_loop(decode, body)
        meta = await self.work.off_loop(self._validated, stream, state)
        stream_id = stream_id or uuid.uuid4().hex
        summary = await self.work.run(meta, summaries.summary, state)
        if not finite_json(summary):
            raise _refuse("the state's summary is not finite")
        if not await self.store.create(tenant, stream_id, meta, data, meta["ttl_seconds"]):
            raise StreamExistsError(f"stream_id: a stream {stream_id!r} already exists; choose another id")
        return document(stream_id, meta, summary)

    def _validated(self, stream: dict[str, Any], state: ParticleState) -> dict[str, Any]:
        """The stored meta of the imported stream, after every check of the module docstring (blocking)."""
        n, d = stream["num_particles"], stream["state_dim"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, d, stream["ttl_seconds"])):
            raise _refuse("num_particles, state_dim and ttl_seconds must be positive integers")
        if not (isinstance(stream["step"], int) and stream["step"] >= 0):
            raise _refuse("step must be a non-negative integer")
        if not (isinstance(stream["seed"], int) and 0 <= stream["seed"] <= MAX_SEED):
            raise _refuse(f"seed must be an integer from 0 to {MAX_SEED}")
        if stream["ttl_seconds"] > MAX_TTL_SECONDS:
            raise _refuse(f"ttl_seconds must be at most {MAX_TTL_SECONDS}")
        if stream["method"] not in UPDATERS or not isinstance(stream["method_options"], dict | None):
            raise _refuse(f"method must be one of {sorted(UPDATERS)} and method_options an object")
        if stream["method_options"]:  # only what a client may set on its own stream
            check_stream_options(stream["method"], stream["method_options"])
        if not isinstance(stream["log_evidence"], float | int) or not isinstance(stream["model"], dict):
            raise _refuse("log_evidence must be a number and model an object")
        check_limits(self.settings, n, d)
        try:
            check_state_names(stream["state_names"], d)
        except ValueError as exc:
            raise _refuse(str(exc)) from None
        operator = stream["operator"]
        if operator is not None:
            record = self.methods.operators.by_name(operator)
            if record is None:
                raise OperatorUnavailableError(f"snapshot: operator {operator!r} is not installed on this server")
            if record.content_hash != stream["operator_content_hash"]:
                raise OperatorUnavailableError(
                    f"snapshot: operator {operator!r} here has content hash {record.content_hash[:12]}…, the "
                    f"snapshot's is {str(stream['operator_content_hash'])[:12]}…: a different operator"
                )
        _check_state(stream, state)
        try:
            model = self.methods.model(stream["model"], d)
            updater = self.methods.updater(stream["method"], operator, stream["method_options"] or None)
            # the check step below (and every later one) within the cost model's budgets, before it runs (413)
            costs.check_substeps(self.settings, model, 1.0, None)
            what = f"importing a {stream['method']} stream (d = {d}) and checking one step of it"
            costs.check(self.settings, "num_particles", n, functools.partial(_one_step, model, updater), what)
            updater.update(state, model.missing_observation()[None], model)  # the method can step this state
        except ApiError:  # an answer already: an operator this server lacks (422), over the budgets (413)
            raise
        except Exception as exc:
            raise _refuse(f"the stream does not validate on this server ({type(exc).__name__}: {exc})") from None
        created = now()
        return {**stream, "created_at": created, "updated_at": created}


__all__ = ["FORMAT", "MEDIA_TYPE", "OPTIONAL_STREAM_FIELDS", "Snapshots", "checksum", "decode", "encode"]
