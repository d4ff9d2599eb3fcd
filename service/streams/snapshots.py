"""Stream snapshots: ``GET /v1/streams/{id}/export`` and ``POST /v1/streams:import`` (docs/API.md).

A snapshot is one safetensors file (Content-Type :data:`MEDIA_TYPE`; no pickle, nothing executable): the stream's
state tensors exactly as the store keeps them (particles, log-weights, step, log-evidence, the generator state,
the method's extras) and, in the header's metadata, ``format`` (:data:`FORMAT`, the version), ``stream`` — the
stream's description as canonical JSON: model, prior, method, its options, the trained operator and that
operator's content hash, N, d, seed, TTL, step, log-evidence, the state's names (``state_names``), the smoothing
window's lag (``smoothing_lag``; the window itself is among the state tensors), the level α at which the stream flags
predictive p-values (``pit_alert``), the latest observed step's p-values (``pit``, ``pit_step``), its log tails,
surprise and anomaly score, and the anomaly score's options and sketch of the stream's surprise history
(``anomaly_memory``, ``anomaly_warmup``, ``anomaly_state``: :mod:`mpflow.service.engine.anomaly`) — a snapshot of
an older server lacks some of these: read as null, a lag as 0, α as the default, the sketch as an empty one —,
``sha256``, the SHA-256 of
``format ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes`` (a truncated or damaged snapshot is recognised), and ``hmac`` and
``key_id``: the same bytes signed under the deployment's snapshot key
(:mod:`mpflow.service.streams.snapshot_signing`), so that a snapshot this deployment did not write — forged, or
altered and its ``sha256`` recomputed — is recognised.

Import refuses, with a 4xx saying why and before anything is written: what is not such a file or is truncated,
a checksum that does not match, another format version; a signature that is missing or does not verify under
this deployment's key (422 ``untrusted_snapshot``) unless the caller asked ``trust=foreign`` — a snapshot of
another deployment, taken on the caller's word; then every field of the description and every tensor of the
state is validated as creation validates a new stream (:mod:`mpflow.service.streams.snapshot_checks`: limits are 413;
the values of every tensor the method keeps — the smoothing window, ``smc2``'s θ-cloud, the extras —
:mod:`mpflow.service.streams.snapshot_tensors`),
an operator this server does not have or has with other content is 422 ``operator_unavailable``, and the state
must take a step of the method (a step without a measurement, computed and thrown away) and have a summary in
the float32 range. The imported stream gets the caller's tenant, the given or a new id, the state bytes of the
original and what its description carries, so it continues, smooths and flags its p-values exactly as the original
would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from typing import Any, Literal

from mpflow.operators.models.base import ModelFamily
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.operators.updaters import Updater
from mpflow.service.engine import summary as summaries
from mpflow.service.engine.anomaly import DEFAULT_WARMUP
from mpflow.service.engine.numerics import within_float32
from mpflow.service.errors import ApiError
from mpflow.service.stream_errors import OperatorUnavailableError
from mpflow.service.streams import costs
from mpflow.service.streams import snapshot_checks as checks
from mpflow.service.streams import snapshot_tensors as tensors
from mpflow.service.streams.creation import check_smoothing, state_size
from mpflow.service.streams.deps import StreamDeps, StreamPart
from mpflow.service.streams.documents import document, now
from mpflow.service.streams.pit import DEFAULT_PIT_ALERT
from mpflow.service.streams.snapshot_checks import ANOMALY_FIELDS
from mpflow.service.streams.snapshot_signing import SnapshotKey, key_id, signature, verifies
from mpflow.service.streams.state_reads import SUMMARY, reading, snapshot_cost

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
    "smoothing_lag",
    "pit_alert",
    "pit",
    "pit_step",
    *ANOMALY_FIELDS,
)
#: fields a snapshot's description may lack (written by an older server): read as null (a smoothing_lag as 0, a
#: pit_alert as the default level, an anomaly_state as an empty one, anomaly_memory and anomaly_warmup as their
#: defaults)
OPTIONAL_STREAM_FIELDS = frozenset({"state_names", "smoothing_lag", "pit_alert", "pit", "pit_step", *ANOMALY_FIELDS})
#: how far an import trusts a snapshot's origin: ``signed`` — signed under this deployment's key (the default);
#: ``foreign`` — any intact snapshot (another deployment's, or written before snapshots were signed)
Trust = Literal["signed", "foreign"]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _signed_bytes(stream: str, state_bytes: bytes) -> bytes:
    """What ``sha256`` and ``hmac`` cover: ``FORMAT ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes``."""
    return FORMAT.encode() + b"\0" + stream.encode() + b"\0" + state_bytes


def checksum(stream: str, state_bytes: bytes) -> str:
    """SHA-256 of ``FORMAT ‖ 0x00 ‖ stream ‖ 0x00 ‖ state bytes`` (hex)."""
    return hashlib.sha256(_signed_bytes(stream, state_bytes)).hexdigest()


def header(stream: str, data: bytes, key: bytes) -> dict[str, str]:
    """A snapshot's header metadata: ``format``, the ``stream`` description, its ``sha256``, and its ``hmac`` and
    ``key_id`` under ``key``."""
    signed = _signed_bytes(stream, data)
    return {
        "format": FORMAT,
        "stream": stream,
        "sha256": hashlib.sha256(signed).hexdigest(),
        "hmac": signature(key, signed),
        "key_id": key_id(key),
    }


def encode(meta: dict[str, Any], data: bytes, key: bytes) -> bytes:
    """The snapshot of a stored stream (``meta`` with the operator's content hash, state bytes ``data``), signed
    under ``key``."""
    stream = _canonical({k: meta.get(k) for k in STREAM_FIELDS})
    return ParticleState.from_bytes(data).to_bytes(header(stream, data, key))


def untrusted(message: str) -> ApiError:
    """422 ``untrusted_snapshot``: a snapshot this deployment did not sign, imported without ``trust=foreign``."""
    return ApiError(422, "untrusted_snapshot", f"{message}; nothing was created")


def decode(body: bytes) -> tuple[dict[str, str], ParticleState, bytes]:
    """(header metadata, state, state bytes as stored) of an intact snapshot; 422 saying why it is refused."""
    try:
        meta = read_metadata(body)
    except ValueError as exc:
        raise checks.refuse(f"not an mpflow snapshot ({exc})") from None
    if meta.get("format") != FORMAT:
        raise checks.refuse(f"format {meta.get('format')!r} is not one this server reads ({FORMAT})")
    if not isinstance(meta.get("stream"), str) or not isinstance(meta.get("sha256"), str):
        raise checks.refuse("the stream description or its checksum is missing")
    try:
        state = ParticleState.from_bytes(body)
        data = state.to_bytes()
    except Exception as exc:  # safetensors refuses truncated or inconsistent data in several ways
        raise checks.refuse(f"the state cannot be read, it is truncated or corrupt ({type(exc).__name__})") from None
    if checksum(meta["stream"], data) != meta["sha256"]:
        raise checks.refuse("its checksum does not match its content: it was truncated or altered")
    return meta, state, data


def check_signature(meta: dict[str, str], data: bytes, key: bytes, trust: str) -> None:
    """Under ``trust="signed"``, the snapshot's ``hmac`` must verify under ``key`` (module docstring)."""
    if trust == "foreign":
        return
    hint = "import a snapshot of another deployment with trust=foreign"
    if "hmac" not in meta:
        raise untrusted(f"hmac: the snapshot is not signed (written by an older server?); {hint}")
    ours = meta.get("key_id") == key_id(key)
    if not verifies(key, _signed_bytes(meta["stream"], data), meta["hmac"]):
        if not ours:
            raise untrusted(f"hmac: the snapshot is signed under another deployment's key; {hint}")
        raise untrusted("hmac: the signature does not match the snapshot: it was altered after export")
    if not ours:  # signed here, so its key_id was ours at export: the header was altered since
        raise untrusted("key_id: the snapshot's key name was altered after export")


def _trusted(body: bytes, key: bytes, trust: str) -> tuple[dict[str, str], ParticleState, bytes]:
    """:func:`decode` and :func:`check_signature` (blocking: hashes up to the body's size)."""
    meta, state, data = decode(body)
    check_signature(meta, data, key, trust)
    return meta, state, data


def description(meta: dict[str, str]) -> dict[str, Any]:
    """The stream description of a snapshot's header, every field present (optional ones as null)."""
    try:
        stream = json.loads(meta["stream"])
    except json.JSONDecodeError:
        raise checks.refuse("stream: the stream description is not JSON") from None
    required = set(STREAM_FIELDS) - OPTIONAL_STREAM_FIELDS
    if not isinstance(stream, dict) or not required <= set(stream) <= set(STREAM_FIELDS):
        raise checks.refuse(
            f"stream: the stream description must have the fields {list(STREAM_FIELDS)} "
            f"({', '.join(sorted(OPTIONAL_STREAM_FIELDS))} optional) and no others"
        )
    return {k: stream.get(k) for k in STREAM_FIELDS}


def _one_step(model: ModelFamily, updater: Updater, lag: int, n: int) -> costs.Cost:
    """The cost of the predict step an import runs on n particles to check the state (and of any later step), with
    its smoothing window of ``lag`` steps."""
    return costs.observations_cost(model, updater, n, [(1.0, None)], 0, lag)


class Snapshots(StreamPart):
    """Exports and imports streams (module docstring)."""

    def __init__(self, deps: StreamDeps) -> None:
        super().__init__(deps)
        self.key = SnapshotKey(deps.settings, deps.store)

    async def export(self, tenant: str, stream_id: str) -> bytes:
        """The snapshot of the caller's stream (404 for an unknown one or another tenant's)."""
        peeked = await self.reads.peek(tenant, stream_id)  # priced before its state is fetched (.state_reads)
        operator = peeked.meta.get("operator")
        extra: dict[str, Any] = {}
        if operator is not None:
            record = self.methods.operators.by_name(operator)
            content_hash = record.content_hash if record is not None else peeked.meta.get("operator_content_hash")
            if content_hash is None:
                raise OperatorUnavailableError(f"operator: {operator!r} is not installed on this server")
            extra["operator_content_hash"] = content_hash
        key = await self.key.get()
        price = reading(peeked.size, snapshot_cost(peeked.size))
        return await self.reads.run(peeked, price, lambda meta, data: encode({**meta, **extra}, data, key))

    async def import_(self, tenant: str, body: bytes, stream_id: str | None, trust: str = "signed") -> dict[str, Any]:
        """Recreate a snapshot's stream for ``tenant`` under ``stream_id`` (a new id when None): its document."""
        key = await self.key.get()
        header, state, data = await self.work.off_loop(_trusted, body, key, trust)
        meta = await self.work.off_loop(self._validated, description(header), state)
        stream_id = stream_id or uuid.uuid4().hex
        summary = await self.work.run(meta, summaries.summary, state)
        if not within_float32(summary):
            raise checks.refuse("state: its summary (mean, covariance, quantiles) lies beyond the float32 range")
        # the summary is kept beside the state: GET /v1/streams/{id} reads it, not the state (.state_reads)
        await self.usage.create(tenant, stream_id, {**meta, SUMMARY: summary}, data)  # 429 over a quota, 409 taken id
        return document(stream_id, meta, summary)

    def _check_operator(self, stream: dict[str, Any]) -> None:
        """The snapshot's operator is installed here with the same content (422 ``operator_unavailable``)."""
        operator = stream["operator"]
        if operator is None:
            return
        record = self.methods.operators.by_name(operator)
        if record is None:
            raise OperatorUnavailableError(f"snapshot: operator {operator!r} is not installed on this server")
        if record.content_hash != stream["operator_content_hash"]:
            raise OperatorUnavailableError(
                f"snapshot: operator {operator!r} here has content hash {record.content_hash[:12]}…, the "
                f"snapshot's is {str(stream['operator_content_hash'])[:12]}…: a different operator"
            )

    def _validated(self, stream: dict[str, Any], state: ParticleState) -> dict[str, Any]:
        """The stored meta of the imported stream, after every check of the module docstring (blocking)."""
        checks.check_numbers(self.settings, stream)
        checks.check_method(stream)
        self._check_operator(stream)
        model, prior = checks.model_and_prior(self.methods, stream)
        checks.check_core(stream, state)
        checks.check_pit(stream, model)
        stream["pit_alert"] = stream["pit_alert"] or DEFAULT_PIT_ALERT
        checks.check_anomaly(stream)
        stream["anomaly_memory"] = stream["anomaly_memory"] or 0
        if stream["anomaly_warmup"] is None:
            stream["anomaly_warmup"] = DEFAULT_WARMUP
        if stream["anomaly_state"] is None:
            del stream["anomaly_state"]
        updater = self.methods.updater(stream["method"], stream["operator"], stream["method_options"] or None)

        lag = stream["smoothing_lag"] = stream.get("smoothing_lag") or 0

        def reference(m: int) -> ParticleState:  # the method's step-0 state with m particles
            return updater.init(checks.reference_prior(prior, state, m), model, m, 0, smoothing_lag=lag)

        try:
            expected = checks.reference_fields(
                reference, stream["num_particles"], stream["state_dim"], whole=updater.unknown_params
            )
        except ValueError as exc:  # the method refuses this model or prior, as at creation
            raise checks.refuse(f"stream: {exc}") from None
        checks.check_fields(state, expected)
        tensors.check_tensors(updater, model, state)  # the window, the θ-cloud, the extras: their values
        try:
            n, d = stream["num_particles"], stream["state_dim"]
            check_smoothing(self.settings, model, updater, n, lag, stream["method"])
            # the check step below (and every later one) within the cost model's budgets, before it runs (413)
            costs.check_substeps(self.settings, model, 1.0, None)
            what = f"importing a {stream['method']} stream (d = {d}) and checking one step of it"
            costs.check(self.settings, "num_particles", n, functools.partial(_one_step, model, updater, lag), what)
            updater.update(state, model.missing_observation()[None], model)  # the method can step this state
        except ApiError:  # an answer already: an operator this server lacks (422), over the budgets (413)
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise checks.refuse(f"state: the method cannot step it on this server ({why})") from None
        created = now()
        return {**stream, "state_bytes": state_size(state), "created_at": created, "updated_at": created}


__all__ = [
    "FORMAT",
    "MEDIA_TYPE",
    "OPTIONAL_STREAM_FIELDS",
    "Snapshots",
    "Trust",
    "check_signature",
    "checksum",
    "decode",
    "description",
    "encode",
    "header",
]
