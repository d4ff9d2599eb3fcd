"""Filter a sequence and score it: the one loop behind ``mpflow filter``, ``mpflow evaluate``
(:mod:`mpflow.training.evaluate`), ``benchmarks.engine`` and ``benchmarks.mpf_latency``.

Given an updater, a model of B streams, a prior, observations o_1..o_T [B, T, *obs_shape] and N particles,
:func:`run_filter` runs

    state_0 = updater.init(prior, model, N, seed),    (state_t, info_t) = updater.update(state_{t−1}, o_t, model),

timing each ``update`` call (wall milliseconds, :func:`time.perf_counter`; nothing else is inside the timed
region), and after every step reads the posterior off the particles x_i with normalised weights
w_i = softmax(log_weights)_i, in float64 (:func:`mpflow.operators.gaussian.moments`):

    m_t = Σ_i w_i x_i,    C_t = Σ_i w_i (x_i − m_t)(x_i − m_t)ᵀ.

With a reference posterior p_t = p(x_t | o_1..t) — its moments μ_t, Σ_t and log p(o_t | o_<t), e.g. the exact
Kalman filter (:meth:`ExactPosterior.kalman`) — each step is scored (each [B], per stream):

* ``mean_error_sd``         sqrt(mean_d ((m_t,d − μ_t,d) / σ_t,d)²), σ_t,d² = Σ_t,dd
  (:func:`mpflow.operators.accuracy.mean_error_sd`);
* ``var_ratio_per_dim``     C_t,dd / Σ_t,dd ([B, d]) and ``var_ratio``, its mean over d;
* ``logz_increment_error``  |log Ẑ_t − log Ẑ_{t−1} − log p(o_t | o_<t)|, log Ẑ_t − log Ẑ_{t−1} the updater's
  estimate of the evidence increment (``info.log_evidence_increment``);

and the run as a whole by its log-evidence error log Ẑ_T − Σ_{t≤T} log p(o_t | o_<t) (signed).

Callers add their own per-step numbers through ``on_step`` (a function of the :class:`FilterStep`, returning
named [B, ...] tensors to record, or None). :class:`FilterRun` is the same loop one step at a time, for callers
that interleave several filters (``benchmarks.mpf_latency`` alternates ``mpf`` and ``smc`` update by update).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from mpflow.operators import accuracy, gaussian
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.priors import Prior
from mpflow.operators.references import kalman_filter
from mpflow.operators.state import ParticleState, StepInfo
from mpflow.operators.updaters.base import Updater

F64 = torch.float64


class PosteriorReference(Protocol):
    """What :func:`run_filter` scores against: the reference posterior of every stream and step (float64)."""

    means: torch.Tensor  # [B, T, d]  μ_t
    covs: torch.Tensor  # [B, T, d, d]  Σ_t
    log_z: torch.Tensor  # [B, T]  log p(o_t | o_<t)


@dataclass
class ExactPosterior:
    """Gaussian filtering posteriors N(μ_t, Σ_t) and log p(o_t | o_<t) (a :class:`PosteriorReference`)."""

    means: torch.Tensor  # [B, T, d]
    covs: torch.Tensor  # [B, T, d, d]
    log_z: torch.Tensor  # [B, T]

    @classmethod
    def kalman(
        cls, mean0: torch.Tensor, cov0: torch.Tensor, model: ModelFamily, observations: torch.Tensor
    ) -> ExactPosterior:
        """The exact posteriors of a linear-Gaussian model from the prior N(mean0 [B, d], cov0 [B, d, d]):
        the float64 Kalman filter (:func:`mpflow.operators.references.kalman_filter`)."""
        return cls(*kalman_filter(mean0, cov0, model, observations))


@dataclass
class FilterStep:
    """One update, as ``on_step`` sees it: step t (1-based), the new state and the updater's report, the update's
    wall time, the particle moments m_t [B, d], C_t [B, d, d] (float64; None when moments are off) and the step's
    scores against the reference (module docstring; empty without a reference)."""

    t: int
    state: ParticleState
    info: StepInfo
    ms: float
    mean: torch.Tensor | None
    cov: torch.Tensor | None
    scores: dict[str, torch.Tensor]


@dataclass
class FilterResult:
    """A filtered sequence. Per-step tensors are stacked step-major, [T, B, ...], over the steps completed.

    ``values`` holds the scores against the reference and whatever ``on_step`` returned; ``log_evidence_error``
    is log Ẑ − Σ_t log p(o_t | o_<t) over the steps completed ([B], signed; None without a reference);
    ``error`` says why the run stopped early (an exception listed in ``catch``), else None."""

    ms: list[float] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    means: torch.Tensor | None = None  # [T, B, d]
    covs: torch.Tensor | None = None  # [T, B, d, d]
    log_evidence_increments: torch.Tensor | None = None  # [T, B]
    ess: torch.Tensor | None = None  # [T, B]
    log_evidence: torch.Tensor | None = None  # [B], log Ẑ after the last step
    log_evidence_error: torch.Tensor | None = None  # [B]
    state: ParticleState | None = None  # the last state (None if init failed)
    states: list[ParticleState] = field(default_factory=list)  # every step's, with keep_states=True
    steps: int = 0
    error: str | None = None


def _stack(rows: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack(rows) if rows else None


class FilterRun:
    """:func:`run_filter` one step at a time: :meth:`start` draws the initial particles (``state``),
    :meth:`step` applies the next observation, :meth:`result` collects the run so far."""

    def __init__(
        self,
        updater: Updater,
        model: ModelFamily,
        prior: Prior,
        observations: torch.Tensor,
        num_particles: int,
        seed: int | Sequence[int] = 0,
        reference: PosteriorReference | None = None,
        *,
        moments: bool = True,
        on_step: Callable[[FilterStep], dict[str, torch.Tensor] | None] | None = None,
        keep_states: bool = False,
    ):
        self.updater, self.model, self.prior = updater, model, prior
        self.observations, self.num_particles, self.seed = observations, num_particles, seed
        self.reference, self.moments, self.on_step, self.keep_states = reference, moments, on_step, keep_states
        self.state: ParticleState | None = None
        self.t = 0  # steps completed
        self._log_z: torch.Tensor | None = None  # log Ẑ after the last completed step
        self.ms: list[float] = []
        self.states: list[ParticleState] = []
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._means: list[torch.Tensor] = []
        self._covs: list[torch.Tensor] = []
        self._increments: list[torch.Tensor] = []
        self._ess: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        """T, the number of observations."""
        return self.observations.shape[1]

    @property
    def done(self) -> bool:
        return self.t >= self.length

    def start(self) -> ParticleState:
        """The initial state (drawn from the prior on the first call)."""
        if self.state is None:
            self.state = self.updater.init(self.prior, self.model, self.num_particles, seed=self.seed)
        return self.state

    def _moments(self, state: ParticleState) -> tuple[torch.Tensor, torch.Tensor]:
        """(m_t, C_t) in float64: the exact Gaussian a state carries where its method keeps one (``kalman``: extras
        ``mean`` and ``cov``, which the service's summaries report too), else the weighted particles' (module
        docstring) — an exact filter is scored on its own moments, not on those of N particles drawn from them."""
        if "mean" in state.extras and "cov" in state.extras:
            return state.extras["mean"].to(F64), state.extras["cov"].to(F64)
        return gaussian.moments(state.particles.to(F64), state.log_weights)

    def step(self) -> FilterStep:
        """Apply observation t = :attr:`t` + 1, score it and record it."""
        state = self.start()
        t = self.t
        t0 = time.perf_counter()
        state, info = self.updater.update(state, self.observations[:, t], self.model)
        ms = 1000 * (time.perf_counter() - t0)
        self.state = state
        self.ms.append(ms)
        mean = cov = None
        scores: dict[str, torch.Tensor] = {}
        if self.moments or self.reference is not None:
            mean, cov = self._moments(state)
        if self.reference is not None:
            ref = self.reference
            mu, sigma = ref.means[:, t], ref.covs[:, t]
            ratio = accuracy.variance_ratio(cov, sigma)
            scores = {
                "mean_error_sd": accuracy.mean_error_sd(mean, mu, sigma),
                "var_ratio": ratio.mean(-1),
                "var_ratio_per_dim": ratio,
                "logz_increment_error": (info.log_evidence_increment.to(F64) - ref.log_z[:, t]).abs(),
            }
        record = FilterStep(t + 1, state, info, ms, mean, cov, scores)
        extra = self.on_step(record) if self.on_step is not None else None
        for k, v in {**scores, **(extra or {})}.items():
            self._rows.setdefault(k, []).append(v)
        if mean is not None:
            self._means.append(mean)
            self._covs.append(cov)
        self._increments.append(info.log_evidence_increment)
        self._ess.append(info.ess)
        if self.keep_states:
            self.states.append(state)
        self._log_z = state.log_evidence
        self.t += 1
        return record

    def result(self, error: str | None = None) -> FilterResult:
        """The run so far (``error``: why it stopped early, if it did)."""
        log_z = self._log_z
        if log_z is None and self.state is not None:
            log_z = self.state.log_evidence  # no step completed: log Ẑ_0 of the initial state
        err = None
        if self.reference is not None and log_z is not None:
            err = log_z - self.reference.log_z[:, : self.t].sum(-1)
        return FilterResult(
            ms=list(self.ms),
            values={k: torch.stack(v) for k, v in self._rows.items()},
            means=_stack(self._means),
            covs=_stack(self._covs),
            log_evidence_increments=_stack(self._increments),
            ess=_stack(self._ess),
            log_evidence=log_z,
            log_evidence_error=err,
            state=self.state,
            states=list(self.states),
            steps=self.t,
            error=error,
        )


def run_filter(
    updater: Updater,
    model: ModelFamily,
    prior: Prior,
    observations: torch.Tensor,
    num_particles: int,
    seed: int | Sequence[int] = 0,
    reference: PosteriorReference | None = None,
    *,
    moments: bool = True,
    on_step: Callable[[FilterStep], dict[str, torch.Tensor] | None] | None = None,
    keep_states: bool = False,
    catch: tuple[type[BaseException], ...] = (),
) -> FilterResult:
    """Filter ``observations`` [B, T, *obs_shape] with ``updater`` from ``prior`` with ``num_particles``
    particles (one stream per row, ``seed`` one int or one per stream) and score every step (module docstring).

    ``reference``: the posterior to score against (a :class:`PosteriorReference`, e.g.
    :meth:`ExactPosterior.kalman`); ``moments``: record m_t, C_t (always computed with a reference);
    ``on_step``: called after every step with its :class:`FilterStep`, may return more [B, ...] values to record;
    ``keep_states``: keep every step's state; ``catch``: exceptions (from ``init``, an update, the scores or
    ``on_step``) that end the run early with ``error`` = "<Exception> at step t: <message>" instead of
    propagating — the steps before it are kept."""
    run = FilterRun(
        updater,
        model,
        prior,
        observations,
        num_particles,
        seed,
        reference,
        moments=moments,
        on_step=on_step,
        keep_states=keep_states,
    )
    try:
        run.start()
        while not run.done:
            run.step()
    except catch as exc:
        return run.result(f"{type(exc).__name__} at step {run.t + 1}: {exc}")
    return run.result()


__all__ = ["ExactPosterior", "FilterResult", "FilterRun", "FilterStep", "PosteriorReference", "run_filter"]
