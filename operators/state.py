"""``ParticleState``: everything a stream's posterior is, as plain tensors.

Batched over streams: particles [B, N, d], log_weights [B, N] (normalised; uniform for unweighted
methods), log_density [B, N] (the tracked log q of each particle, MPF eq. 8; absent for most methods),
step [B] (observations applied), log_evidence [B] (float64, log p(o_1..o_step)), rng [B, 2] (each stream's
counter-based generator: key, counter) and ``extras`` — named method-specific tensors with a leading B
dimension (the Kalman mean/cov, a step-0 prior mixture, …).

``to_bytes``/``from_bytes`` serialise one stream (B = 1) with safetensors: a JSON header of dtypes and
shapes followed by raw little-endian data — no pickle, nothing executable. They go through safetensors'
numpy entry points (``safetensors.numpy.save``, ``safetensors.deserialize``) rather than its torch ones: the
bytes are exactly those of ``safetensors.torch.save`` (which reads them, and whose bytes we read), without
the torch wrapper's per-tensor Python work (ctypes views, the shared-storage scan), several times the cost of
the serialisation itself for a small state.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from safetensors import deserialize
from safetensors.numpy import save as np_save
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

#: v2: ``rng`` is the stream's counter-based generator, (key, counter) int64 [B, 2] (:mod:`mpflow.operators.rng`);
#: v1 held torch's Mersenne Twister state, uint8 [B, 5056], and is read by re-keying (:func:`_upgrade_rng`)
FORMAT = "mpflow-state-v2"

#: safetensors' dtype code → numpy dtype, for every dtype numpy shares with torch; states holding any other
#: (bfloat16, float8, …) go through ``safetensors.torch`` itself
_NUMPY: dict[str, type] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "C64": np.complex64,
}
#: the same dtypes on the torch side
_NUMPY_TORCH = frozenset(torch.from_numpy(np.zeros(0, dtype=d)).dtype for d in _NUMPY.values())

#: the data are little-endian; a big-endian host reads through ``safetensors.torch.load``, which swaps them
_LITTLE = sys.byteorder == "little"


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``safetensors.torch.save(tensors, metadata)``, byte for byte: each tensor as a contiguous CPU numpy view."""
    if any(t.dtype not in _NUMPY_TORCH for t in tensors.values()):
        return st_save({k: t.contiguous() for k, t in tensors.items()}, metadata=metadata)
    return np_save({k: t.detach().cpu().contiguous().numpy() for k, t in tensors.items()}, metadata=metadata)


def _load(data: bytes) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load(data)``: each tensor a writable CPU tensor over its own copy of the bytes."""
    if not _LITTLE:
        return st_load(data)
    entries = deserialize(data)
    if any(e["dtype"] not in _NUMPY for _, e in entries):
        return st_load(data)
    return {
        k: torch.from_numpy(np.frombuffer(e["data"], dtype=_NUMPY[e["dtype"]]).reshape(e["shape"])) for k, e in entries
    }


@dataclass
class ParticleState:
    particles: torch.Tensor
    log_weights: torch.Tensor
    step: torch.Tensor
    log_evidence: torch.Tensor
    rng: torch.Tensor
    log_density: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.particles.shape[0]

    @property
    def num_particles(self) -> int:
        return self.particles.shape[1]

    @property
    def dim(self) -> int:
        return self.particles.shape[2]

    def replace(self, **changes) -> ParticleState:
        return replace(self, **changes)

    # ---------------------------------------------------------------- batching
    def _fields(self) -> dict[str, torch.Tensor]:
        out = {
            "particles": self.particles,
            "log_weights": self.log_weights,
            "step": self.step,
            "log_evidence": self.log_evidence,
            "rng": self.rng,
        }
        if self.log_density is not None:
            out["log_density"] = self.log_density
        out.update({f"extras.{k}": v for k, v in self.extras.items()})
        return out

    @classmethod
    def _from_fields(cls, f: dict[str, torch.Tensor]) -> ParticleState:
        extras = {k[len("extras.") :]: v for k, v in f.items() if k.startswith("extras.")}
        return cls(
            particles=f["particles"],
            log_weights=f["log_weights"],
            step=f["step"],
            log_evidence=f["log_evidence"],
            rng=f["rng"],
            log_density=f.get("log_density"),
            extras=extras,
        )

    @classmethod
    def stack(cls, states: list[ParticleState]) -> ParticleState:
        """Concatenate streams into one batch (all must have the same fields and N, d)."""
        keys = [set(s._fields()) for s in states]
        if any(k != keys[0] for k in keys):
            raise ValueError("states with different fields cannot be batched")
        return cls._from_fields({k: torch.cat([s._fields()[k] for s in states]) for k in keys[0]})

    def select(self, rows: torch.Tensor) -> ParticleState:
        """The streams ``rows`` (indices [R]) of a batch, as a batch of R."""
        return self._from_fields({k: v[rows] for k, v in self._fields().items()})

    @classmethod
    def scatter(cls, parts: list[tuple[torch.Tensor, ParticleState]], batch: int) -> ParticleState:
        """The inverse of :meth:`select`: a batch of ``batch`` streams whose rows ``rows`` come from each
        (rows, state) of ``parts`` (the rows of the parts together cover 0..batch−1 once). The parts must have the
        same fields and shapes, as the results of one batch's streams do."""
        fields = [s._fields() for _, s in parts]
        if any(set(f) != set(fields[0]) for f in fields):
            raise ValueError("states with different fields cannot be batched")
        out = {}
        for k, first in fields[0].items():
            t = torch.zeros((batch, *first.shape[1:]), dtype=first.dtype)
            for (rows, _), f in zip(parts, fields, strict=True):
                t = t.index_copy(0, rows, f[k])
            out[k] = t
        return cls._from_fields(out)

    def unbind(self) -> list[ParticleState]:
        """Split a batch back into B single-stream states."""
        f = self._fields()
        return [self._from_fields({k: v[b : b + 1] for k, v in f.items()}) for b in range(self.batch_size)]

    # ---------------------------------------------------------------- serialisation
    def to_bytes(self, metadata: dict[str, str] | None = None) -> bytes:
        """One stream's state as safetensors bytes (metadata ``{"format": FORMAT}``, or ``metadata``: strings, e.g.
        a snapshot's description); B must be 1."""
        if self.batch_size != 1:
            raise ValueError("to_bytes serialises one stream; unbind() the batch first")
        return _save(self._fields(), metadata if metadata is not None else {"format": FORMAT})

    def fields(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by its serialised name (``particles``, ..., ``extras.<name>``)."""
        return dict(self._fields())

    @classmethod
    def from_bytes(cls, data: bytes) -> ParticleState:
        """The state ``to_bytes`` wrote (any safetensors file with the state's field names); a v1 state's
        generator is re-keyed (:func:`_upgrade_rng`)."""
        fields = _load(data)
        if fields["rng"].dtype == torch.uint8:
            fields["rng"] = _upgrade_rng(fields["rng"])
        return cls._from_fields(fields)


def _upgrade_rng(mersenne: torch.Tensor) -> torch.Tensor:
    """A v1 state's Mersenne Twister states [B, S] uint8 → (key, counter) rows [B, 2] int64: the key is the first
    8 bytes of the SHA-256 of the old state (deterministic, so a stored v1 stream continues reproducibly, with
    a new random sequence), the counter 0."""
    keys = [
        int.from_bytes(hashlib.sha256(row.numpy().tobytes()).digest()[:8], "little", signed=True) for row in mersenne
    ]
    return torch.tensor([[k, 0] for k in keys], dtype=torch.int64)


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (the 8-byte little-endian header length, then the JSON header);
    ValueError when the bytes do not start with a safetensors header."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("the header runs past the end of the data (truncated)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the header is not JSON ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("no string metadata in the header")
    return meta


@dataclass
class StepInfo:
    """What one update reports per stream ([B] tensors)."""

    log_evidence_increment: torch.Tensor  # float64, estimate of log p(o_m | o_<m)
    ess: torch.Tensor  # effective sample size after the update (before any resampling)
    iterations: torch.Tensor | None = None  # solver iterations used (iterative methods)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    #: [B, N] int64: the index before the step of each particle's parent (resampling methods; None: i for i)
    ancestors: torch.Tensor | None = None


def scatter_info(parts: list[tuple[torch.Tensor, StepInfo]], batch: int) -> StepInfo:
    """One batch's :class:`StepInfo` from the infos of its parts (rows, info), as :meth:`ParticleState.scatter`
    joins their states. A per-stream value one part lacks (a predict-only step runs no solver: ``iterations``,
    solver ``extras``) is 0 (False) on that part's rows."""

    def join(values: list[torch.Tensor | None]) -> torch.Tensor | None:
        given = [v for v in values if v is not None]
        if not given:
            return None
        like = given[0]
        out = torch.zeros((batch, *like.shape[1:]), dtype=like.dtype)
        for (rows, _), v in zip(parts, values, strict=True):
            if v is not None:
                out = out.index_copy(0, rows, v.to(like.dtype))
        return out

    infos = [i for _, i in parts]
    keys = {k for i in infos for k, v in i.extras.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    ancestors = None
    if any(i.ancestors is not None for _, i in parts):  # a part without ancestry keeps its particles' indices
        n = next(i.ancestors for _, i in parts if i.ancestors is not None).shape[1]
        own = [i.ancestors if i.ancestors is not None else torch.arange(n).expand(len(r), n) for r, i in parts]
        ancestors = join(own)
    return StepInfo(
        join([i.log_evidence_increment for i in infos]),
        join([i.ess for i in infos]),
        join([i.iterations for i in infos]),
        {k: join([i.extras.get(k) for i in infos]) for k in sorted(keys)},
        ancestors,
    )


def ess(log_weights: torch.Tensor) -> torch.Tensor:
    """Effective sample size 1 / Σ w_i² of normalised weights, per stream."""
    w = torch.softmax(log_weights, dim=-1)
    return 1.0 / (w * w).sum(-1)


def systematic_resample(log_weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices [B, N] by systematic resampling: points (u_b + i)/N, i = 0..N−1, through the weights' CDF.
    ``u`` [B] uniform in [0, 1)."""
    B, N = log_weights.shape
    cdf = torch.cumsum(torch.softmax(log_weights.to(torch.float64), -1), -1)
    cdf[:, -1] = 1.0
    points = (u.to(torch.float64)[:, None] + torch.arange(N, dtype=torch.float64)) / N
    return torch.searchsorted(cdf, points).clamp_max(N - 1)
