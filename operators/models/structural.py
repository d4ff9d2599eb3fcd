"""``structural``: structural time series (local level, local linear trend, trigonometric seasonals) in continuous time

The state stacks the components of Harvey (1989, *Forecasting, Structural Time Series Models and the Kalman Filter*,
§2.3; ch. 9 for continuous time) and Durbin & Koopman (2012, *Time Series Analysis by State Space Methods*, 2nd
ed., §3.2), each a linear SDE; the model is an :class:`~mpflow.operators.models.lds.LDS` in continuous time whose
drift F, diffusion Qc, observation row B and noise R are built from the components (:meth:`Structural.from_params`):

* the level μ (always): dμ = σ_l dW_l (``level_sd``), or, with a trend (``trend_sd`` given), the local linear trend
  dμ = ν dt + σ_l dW_l, dν = σ_s dW_s: the block F = [[0, 1], [0, 0]], Qc = diag(σ_l², σ_s²);
* each seasonal component j (``seasonal[j]``: period P_j, harmonics K_j, sd σ_j) adds, for k = 1 … K_j, a pair
  (γ, γ*) rotating at the angular frequency ω = 2πk / P_j: F = [[0, ω], [−ω, 0]], Qc = σ_j² I₂ — the trigonometric
  seasonal of D&K §3.2 in continuous time, whose exact step over Δ is the rotation by ωΔ plus N(0, σ_j² Δ I₂);
* the observation o = μ + Σ γ + N(0, R): B = [1, (0), 1, 0, 1, 0, …] picks the level and the first coordinate of
  every pair; the observation is one number (or a list of one number).

State order: μ, (ν), then the pairs (γ, γ*) of the components in the order given, harmonics k = 1 … K_j in each:
d = 1 (+1 with a trend) + 2 Σ_j K_j, and the stream's prior must have that dimension. Time is continuous: each
step's ``dt`` is its duration, in the unit the periods are given in (seconds, hours, days: the user's), and the
step is the exact discretisation of the SDE over it (Van Loan,
:func:`mpflow.operators.models.continuous_time.van_loan`: A = e^{FΔ}, Q = ∫₀^Δ e^{Fs} Qc e^{Fᵀs} ds) — irregular
timestamps are steps of their own dt, and ``kalman`` filters exactly (it is this family's default method). A
harmonic above the sampling's Nyquist frequency (k ≥ P / (2 Δ) for a typical step Δ) cannot be told apart from a
slower one by the observations; the family does not refuse it (the steps' durations are not known in advance), but
it only adds states.

The level's and the seasons' sds (all in the observation's unit per √(time unit)) are each at least :data:`SD_FLOOR` ×
the largest of them (an sd of 0 — an unchanging seasonal pattern — is taken as that): the noise of a step must be
positive definite. The slope's sd is in other units (per time unit^{3/2}), so no such floor applies to it: a given
``trend_sd`` must be positive (a slope that never changes: a small positive sd). Limits: at most
:data:`MAX_HARMONICS` harmonics a component and a state of at most :data:`MAX_STATE_DIM` dimensions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators import validation
from mpflow.operators.models.base import ModelFamily, check_dt, subfield
from mpflow.operators.models.lds import LDS
from mpflow.operators.models.linear_observation import LinearObservationFamily
from mpflow.operators.models.spec import POSITIVE, FamilySpec, absent, kind, read_params

#: the most harmonics one seasonal component may have
MAX_HARMONICS = 12
#: the largest state dimension a structural model may have (1 + 1 + 2 Σ K)
MAX_STATE_DIM = 64
#: the level's and each season's sd is at least this share of the largest of them (module docstring)
SD_FLOOR = 1e-4
#: the keys of one seasonal component
SEASONAL_KEYS = ("period", "harmonics", "sd")
#: the periods of the demonstration model's seasonal components (``example_params``): a day and a week in hours
EXAMPLE_PERIODS = (24.0, 168.0)


@kind("non-negative number")
def parse_sd(name: str, value, d: int, dtype) -> torch.Tensor:
    """A diffusion standard deviation (per unit of time): a number ≥ 0."""
    t = validation.as_tensor(name, value, torch.float64)
    if t.dim() != 0:
        raise ValueError(f"{name}: expected a single number, got shape {list(t.shape)}")
    if float(t) < 0:
        raise ValueError(f"{name}: must be non-negative (a standard deviation per unit of time), got {float(t)}")
    return t


@kind("list of seasonal components {period > 0, harmonics 1-12, sd ≥ 0}")
def parse_seasonal(name: str, value, d: int, dtype) -> torch.Tensor:
    """The seasonal components → a float64 tensor [n, 3] of (period, harmonics, sd) rows."""
    if not isinstance(value, list):
        raise ValueError(
            f'{name}: expected a list of components such as {{"period": 24, "harmonics": 2, "sd": 0.1}}, got '
            f"{type(value).__name__}"
        )
    rows = []
    for i, comp in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(comp, dict):
            raise ValueError(f"{where}: expected an object with period, harmonics and sd, got {type(comp).__name__}")
        validation.unknown_keys(where, comp, SEASONAL_KEYS)
        if "period" not in comp:
            raise ValueError(f"{where}.period: required (the period, in the unit of the steps' dt)")
        period = validation.positive(f"{where}.period", comp["period"], torch.float64)
        harmonics = validation.positive_int(f"{where}.harmonics", comp.get("harmonics", 1), MAX_HARMONICS)
        sd = parse_sd(f"{where}.sd", comp.get("sd", 0.0), d, dtype)
        rows.append([float(period), float(harmonics), float(sd)])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 3)


@kind("positive number")
def parse_positive_sd(name: str, value, d: int, dtype) -> torch.Tensor:
    """A diffusion standard deviation that must be positive (the slope's: module docstring)."""
    t = validation.as_tensor(name, value, torch.float64)
    if t.dim() != 0:
        raise ValueError(f"{name}: expected a single number, got shape {list(t.shape)}")
    if float(t) <= 0:
        raise ValueError(
            f"{name}: must be positive (the slope's sd per time unit^(3/2); omit trend_sd for a model without a "
            f"slope, or give a small positive sd for a slope that barely changes), got {float(t)}"
        )
    return t


@kind("positive number (the observation noise variance)", POSITIVE)
def parse_variance(name: str, value, d: int, dtype) -> torch.Tensor:
    """A positive number, or a 1×1 matrix [[r]]."""
    t = validation.as_tensor(name, value, torch.float64)
    if t.numel() != 1 or t.dim() > 2:
        raise ValueError(f"{name}: expected a single number (the observation is one number), got shape {list(t.shape)}")
    return validation.positive(name, t.reshape(()), dtype)


def _number(value: float) -> Any:
    return lambda d, dtype: torch.tensor(value, dtype=dtype)


class Structural(LDS):
    name = "structural"
    spec = FamilySpec(
        description=(
            "continuous-time structural time series: level (dμ = ν dt + σ_l dW), optional slope (dν = σ_s dW), "
            "trigonometric seasonals with periods in dt's unit; o = μ + Σ γ + N(0, R); exact per step of any dt"
        ),
        observation="a number (or a list of one number)",
        params=(
            ("level_sd", parse_sd, _number(1.0)),
            ("trend_sd", parse_positive_sd, absent),
            ("seasonal", parse_seasonal, absent),
            ("R", parse_variance, _number(1.0)),
        ),
    )
    #: no learned parameter observer (``lds``'s is for a scalar discrete-time model)
    observer_params = ()

    @staticmethod
    def dimension(trend: bool, seasonal: torch.Tensor | None) -> int:
        """1 (+1 with a trend) + 2 Σ K."""
        harmonics = 0 if seasonal is None else int(seasonal[:, 1].sum())
        return 1 + int(trend) + 2 * harmonics

    @staticmethod
    def level_and_season_sds(parsed: dict[str, torch.Tensor]) -> list[float]:
        """The sds in the observation's unit per √(time unit): the level's and each season's."""
        seasonal = parsed.get("seasonal")
        return [float(parsed["level_sd"])] + ([] if seasonal is None else [float(s) for s in seasonal[:, 2]])

    @classmethod
    def matrices(cls, parsed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(F, Qc, B [1, d]) in float64 of the read parameters (module docstring)."""
        trend = "trend_sd" in parsed
        seasonal = parsed.get("seasonal")
        d = cls.dimension(trend, seasonal)
        floor = SD_FLOOR * max(cls.level_and_season_sds(parsed))
        F = torch.zeros(d, d, dtype=torch.float64)
        Qc = torch.zeros(d, d, dtype=torch.float64)
        B = torch.zeros(1, d, dtype=torch.float64)
        B[0, 0] = 1.0
        Qc[0, 0] = max(float(parsed["level_sd"]), floor) ** 2
        i = 1
        if trend:
            F[0, 1] = 1.0
            Qc[1, 1] = float(parsed["trend_sd"]) ** 2
            i = 2
        for period, harmonics, sd in [] if seasonal is None else seasonal.tolist():
            for k in range(1, int(harmonics) + 1):
                omega = 2 * math.pi * k / period
                F[i, i + 1], F[i + 1, i] = omega, -omega
                Qc[i, i] = Qc[i + 1, i + 1] = max(sd, floor) ** 2
                B[0, i] = 1.0
                i += 2
        return F, Qc, B

    @classmethod
    def from_params(cls, params, state_dim: int, dtype: torch.dtype = torch.float32) -> ModelFamily:
        """The components (module docstring) → the continuous-time LDS of F, Qc, B, R; ValueError naming the field
        for a bad one, or naming the prior when its dimension is not the components' d."""
        params = dict(params or {})
        validation.positive_int("state_dim", state_dim)
        parsed, unknown = read_params(cls, params, state_dim, dtype)
        trend, seasonal = "trend_sd" in parsed, parsed.get("seasonal")
        d = cls.dimension(trend, seasonal)
        if d > MAX_STATE_DIM:
            raise ValueError(
                f"model.params.seasonal: the components give a {d}-dimensional state, more than the structural "
                f"family's limit of {MAX_STATE_DIM} (1 for the level, 1 for a trend, 2 per harmonic); use fewer "
                "harmonics"
            )
        if max(cls.level_and_season_sds(parsed)) <= 0:
            raise ValueError("model.params.level_sd: the level's sd or some season's must be positive")
        if state_dim != d:
            harmonics = 0 if seasonal is None else int(seasonal[:, 1].sum())
            raise ValueError(
                f"prior: the structural model of model.params has a {d}-dimensional state (1 for the level"
                f"{', 1 for the trend' if trend else ''}, 2 for each of {harmonics} seasonal harmonics: state order "
                f"level{', slope' if trend else ''}, then (γ, γ*) per harmonic), so the prior's mean must have {d} "
                f"entries; got {state_dim}"
            )
        F, Qc, B = cls.matrices(parsed)
        R = parsed["R"].reshape(1, 1)
        model = cls({"F": F[None].to(dtype), "Qc": Qc[None].to(dtype), "B": B[None].to(dtype), "R": R[None]}, d)
        model.check()
        return model._learning(unknown)

    def check(self) -> None:
        """The observation's shapes (B, R). Not ``lds``'s test of a step's noise against its largest entry: Q is
        block diagonal — the level (and slope) block, σ²Δ I₂ per harmonic — and each block is positive definite for
        positive sds (the level–slope block's determinant is σ_l² σ_s² Δ⁴ + σ_s⁴ Δ⁴ / 12), however far apart the
        blocks' scales are (a slope's variance per second is many orders below a level's); each step's float32
        Cholesky is still checked (:meth:`LDS.at_step`)."""
        LinearObservationFamily.check(self)

    @classmethod
    def param_unit(cls, name: str, params: dict, state_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """R, the one learnable parameter, is a 1×1 variance."""
        return torch.ones((), dtype=dtype)

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """The task prior's region (its transition is not ``lds``'s ρ·U)."""
        return super(LDS, cls).task_domain(options)

    @classmethod
    def example_state_dim(cls) -> int:
        """Level, slope and one daily harmonic pair (hourly steps): d = 4."""
        return 4

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """A model of dimension d: the level (sd 1), a slope (sd 0.05) when d is even, and (d − 1 − trend) / 2
        harmonics of sd 0.1 over seasonal components with the periods of :data:`EXAMPLE_PERIODS` (a day, a week, in
        hours; the later ones longer), up to :data:`MAX_HARMONICS` each; R = 1."""
        trend = d % 2 == 0
        params: dict[str, Any] = {"level_sd": 1.0, **({"trend_sd": 0.05} if trend else {})}
        left = (d - 1 - int(trend)) // 2
        seasonal, j = [], 0
        while left > 0:
            period = EXAMPLE_PERIODS[j] if j < len(EXAMPLE_PERIODS) else EXAMPLE_PERIODS[-1] * 7 ** (j - 1)
            k = min(left, MAX_HARMONICS)
            seasonal.append({"period": period, "harmonics": k, "sd": 0.1})
            left, j = left - k, j + 1
        if seasonal:
            params["seasonal"] = seasonal
        return params

    @classmethod
    def state_names(cls, d: int) -> list[str] | None:
        """level, slope (d even: a trend), then harmonic[j] and harmonic[j]* for the j-th seasonal harmonic pair (in
        the order of the components and their harmonics)."""
        trend = d % 2 == 0
        names = ["level", "slope"] if trend else ["level"]
        for j in range((d - len(names)) // 2):
            names += [f"harmonic[{j}]", f"harmonic[{j}]*"]
        return names

    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """The exact step of duration ``dt`` (``lds``'s continuous-time step); the family takes no inputs."""
        check_dt(dt, field)
        if u is not None:
            raise ValueError(f"{subfield(field, 'u')}: the structural family takes no inputs; omit u")
        return super().at_step(dt, None, field)


__all__ = ["MAX_HARMONICS", "MAX_STATE_DIM", "SD_FLOOR", "Structural"]
