"""``ParticleState``: everything a stream's posterior is, as plain tensors.

Batched over streams: particles [B, N, d], log_weights [B, N] (normalised; uniform for unweighted
methods), log_density [B, N] (the tracked log q of each particle, MPF eq. 8; absent for most methods),
step [B] (observations applied), log_evidence [B] (float64, log p(o_1..o_step)), rng [B, S] (each
stream's generator state) and ``extras`` — named method-specific tensors with a leading B dimension
(the Kalman mean/cov, a step-0 prior mixture, …).

``to_bytes``/``from_bytes`` serialise one stream (B = 1) with safetensors: a JSON header of dtypes and
shapes followed by raw little-endian data — no pickle, nothing executable.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "mpflow-state-v1"


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

    def unbind(self) -> list[ParticleState]:
        """Split a batch back into B single-stream states."""
        f = self._fields()
        return [self._from_fields({k: v[b : b + 1] for k, v in f.items()}) for b in range(self.batch_size)]

    # ---------------------------------------------------------------- serialisation
    def to_bytes(self) -> bytes:
        if self.batch_size != 1:
            raise ValueError("to_bytes serialises one stream; unbind() the batch first")
        return st_save({k: v.contiguous() for k, v in self._fields().items()}, metadata={"format": FORMAT})

    @classmethod
    def from_bytes(cls, data: bytes) -> ParticleState:
        return cls._from_fields(st_load(data))


@dataclass
class StepInfo:
    """What one update reports per stream ([B] tensors)."""

    log_evidence_increment: torch.Tensor  # float64, estimate of log p(o_m | o_<m)
    ess: torch.Tensor  # effective sample size after the update (before any resampling)
    iterations: torch.Tensor | None = None  # solver iterations used (iterative methods)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def ess(log_weights: torch.Tensor) -> torch.Tensor:
    """Effective sample size 1 / Σ w_i² of normalised weights, per stream."""
    w = torch.softmax(log_weights, dim=-1)
    return 1.0 / (w * w).sum(-1)
