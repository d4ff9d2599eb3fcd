"""``lds``: the linear dynamical system of the MPF paper (§5 LDS), with optional inputs and continuous time

    x_m = A x_{m-1} + C u_m + N(0, Q),    o_m = B x_m + N(0, R),     Q = I, R = I by default.

B is required, and either the discrete transition A (with Q) or the continuous-time drift F and diffusion Qc of
dx = (F x + C u) dt + dW, Cov[dW] = Qc dt (Qc = I by default), discretised exactly over each step's duration Δ
(:func:`mpflow.operators.models.continuous_time.van_loan`: A = e^{FΔ}, Q = ∫₀^Δ e^{Fs} Qc e^{Fᵀs} ds, and the input
enters through Γ C u, Γ = ∫₀^Δ e^{Fs} ds). A discrete transition has no Δ but 1. The optional input matrix C
[d, m] takes each step's inputs u ∈ R^m (0 when a step gives none). Exact filtering: the Kalman filter
(:mod:`mpflow.operators.references.exact_kalman`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mpflow.operators.models.base import ModelFamily, check_dt, span, subfield
from mpflow.operators.models.continuous_time import van_loan
from mpflow.operators.models.linear_observation import LinearObservationFamily
from mpflow.operators.models.spec import FamilySpec, absent, identity, parse_cov, parse_matrix, parse_psd

#: the spectral radius of the demonstration and benchmark transitions A (``example_params``, ``benchmark_params``)
EXAMPLE_A_SCALE = 0.9
#: the step durations whose exact transition a continuous-time model without inputs keeps (:meth:`LDS.at_step`):
#: a regularly sampled stream has one, so its matrix exponentials are computed once, not at every step
STEP_CACHE = 64


class LDS(LinearObservationFamily):
    name = "lds"
    dynamic = True
    obs_matrix_name = "B"
    obs_cov_name = "R"
    spec = FamilySpec(
        description=(
            "x_m = A x_{m-1} + C u_m + N(0, Q) (or continuous time: dx = (F x + C u) dt + dW, Cov dW = Qc dt); "
            "o_m = B x_m + N(0, R)"
        ),
        observation="vector of length k (the rows of B)",
        params=(
            ("A", parse_matrix, absent),
            ("Q", parse_cov, identity()),
            ("F", parse_matrix, absent),
            ("Qc", parse_psd, identity()),
            ("B", parse_matrix, None),
            ("R", parse_cov, identity()),
            ("C", parse_matrix, absent),
        ),
    )
    observer_params = (("Q", "log", True), ("R", "log", True))
    #: the parameter observer's task domain (:meth:`observer_tasks`): A = 1 (a local level) in this share of tasks,
    #: else U(A_RANGE); |B| log-uniform on B_RANGE; log Q uniform on LOG_Q_RANGE and log R − log Q on
    #: LOG_RATIO_RANGE
    OBSERVER_TASKS = {"local_level": 0.3, "A_RANGE": (0.0, 1.0), "B_RANGE": (0.2, 5.0), "LOG_Q_RANGE": (-7.0, 3.0),
                      "LOG_RATIO_RANGE": (-7.0, 7.0)}  # fmt: skip

    #: the parameters of each way to give the transition (docstring); the other way's are refused
    DISCRETE = ("A", "Q")
    CONTINUOUS = ("F", "Qc")

    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """Every singular value of A in ``rho_range``, Q = R = I, and the task prior (B is drawn N(0, 1))."""
        lo, hi = options.get("rho_range", (0.7, 1.0))
        return {
            "A singular values": [float(lo), float(hi)],
            "Q variance": [1.0, 1.0],
            "R variance": [1.0, 1.0],
            **super().task_domain(options),
        }

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        A, _, Q = self.transition_affine()
        p = {"A": A[0].to(torch.float64), "Q": Q[0].to(torch.float64), "R": self.params["R"][0].to(torch.float64)}
        return {
            "A singular values": span(torch.linalg.svdvals(p["A"])),
            "Q variance": span(torch.linalg.eigvalsh(p["Q"])),
            "R variance": span(torch.linalg.eigvalsh(p["R"])),
            **super().domain_measures(prior_mean, prior_cov),
        }

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """A = 0.9 I, B = I."""
        return {"A": (EXAMPLE_A_SCALE * torch.eye(d)).tolist(), "B": torch.eye(d).tolist()}

    @classmethod
    def from_params(cls, params, state_dim: int, dtype: torch.dtype = torch.float32) -> ModelFamily:
        """As for every family, plus: exactly one of the discrete (A, Q) and continuous (F, Qc) transitions."""
        given = set(params or {})
        discrete, continuous = given & set(cls.DISCRETE), given & set(cls.CONTINUOUS)
        if discrete and continuous:
            raise ValueError(
                f"model.params.{sorted(continuous)[0]}: give the discrete transition (A, Q) or the continuous-time "
                f"one (F, Qc), not both (got {sorted(discrete | continuous)})"
            )
        if "A" not in given and "F" not in given:
            raise ValueError("model.params.A: required for the lds family (or F, with Qc, for continuous time)")
        model = super().from_params(params, state_dim, dtype)
        for name in cls.CONTINUOUS if "A" in given else cls.DISCRETE:  # the other way's defaults
            model.params.pop(name, None)
        return model

    def observer_context(self) -> torch.Tensor | None:
        """[A, log B²] of a scalar discrete-time model without inputs (the parameter observer's domain); None
        otherwise."""
        if self.state_dim != 1 or self.observation_size() != 1 or self.continuous or "C" in self.params:
            return None
        A, B = self.params["A"].to(torch.float64), self.params["B"].to(torch.float64)
        return torch.stack([A[:, 0, 0], torch.log(B[:, 0, 0] ** 2)], -1)

    @classmethod
    def observer_tasks(cls, n: int, gen: torch.Generator):
        """:attr:`OBSERVER_TASKS`: x_0 from the stationary law N(0, Q / (1 − A²)), its variance capped at 100 Q."""
        t = cls.OBSERVER_TASKS

        def u(lo, hi):
            return lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)

        A = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < t["local_level"], 1.0, u(*t["A_RANGE"]))
        sign = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        B = sign * torch.exp(u(*(math.log(v) for v in t["B_RANGE"])))
        log_q = u(*t["LOG_Q_RANGE"])
        Q, R = torch.exp(log_q), torch.exp(log_q + u(*t["LOG_RATIO_RANGE"]))
        var0 = torch.minimum(Q / (1 - A * A).clamp_min(1e-12), 100 * Q)
        x0 = (var0.sqrt() * torch.randn(n, generator=gen, dtype=torch.float64))[:, None]
        params = {k: v[:, None, None] for k, v in (("A", A), ("Q", Q), ("B", B), ("R", R))}
        return cls(params, 1), {"Q": Q, "R": R}, x0

    @property
    def continuous(self) -> bool:
        return "F" in self.params

    def check(self) -> None:
        d = self.state_dim
        for name in ("A", "Q", "F", "Qc"):
            if name in self.params and tuple(self.params[name].shape[1:]) != (d, d):
                raise ValueError(
                    f"model.params.{name}: expected {d}x{d} (the prior's dimension), got "
                    f"{list(self.params[name].shape[1:])}"
                )
        if "C" in self.params and self.params["C"].shape[1] != d:
            raise ValueError(
                f"model.params.C: expected {d} rows (the prior's dimension) and one column per input, got "
                f"{list(self.params['C'].shape[1:])}"
            )
        super().check()
        if self.continuous:
            Q = self.transition_affine()[2].to(torch.float64)
            if float(torch.linalg.eigvalsh(Q).min()) <= 1e-12 * float(Q.abs().max().clamp_min(1e-300)):
                raise ValueError(
                    "model.params.Qc: the noise it gives over a step, ∫ e^{Fs} Qc e^{Fᵀs} ds, is singular; let the "
                    "diffusion reach every coordinate (through F)"
                )

    def step_model_flops(self) -> float:
        """Two matrix exponentials of 2d × 2d (scipy's scaling and squaring: about 15 products, 2 (2d)³ each) for
        a continuous-time model (:func:`~mpflow.operators.models.continuous_time.van_loan`); nothing in discrete
        time."""
        return 2 * 15 * 2 * (2 * self.state_dim) ** 3 if self.continuous else 0.0

    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """The step of duration ``dt`` with inputs ``u``: A, Q (and the input offset c = C u, or Γ C u in continuous
        time) of that step; the model itself for dt = 1 without inputs in discrete time."""
        dt = check_dt(dt, field)
        if self.continuous and u is None and "C" not in self.params:  # the step depends on dt alone: kept
            cache = self.__dict__.setdefault("_steps", {})
            if dt not in cache:
                if len(cache) >= STEP_CACHE:
                    cache.pop(next(iter(cache)))  # the oldest duration
                cache[dt] = self._step(dt, None, field)
            return cache[dt]
        return self._step(dt, u, field)

    def _step(self, dt: float, u: torch.Tensor | None, field: str) -> ModelFamily:
        """:meth:`at_step` computed."""
        C = self.params.get("C")
        dt_field, u_field = subfield(field, "dt"), subfield(field, "u")
        if u is not None:
            if C is None:
                raise ValueError(f"{u_field}: this lds model has no input matrix C (model.params.C); omit u")
            if tuple(u.shape) != (C.shape[-1],):
                raise ValueError(
                    f"{u_field}: expected {C.shape[-1]} inputs (the columns of model.params.C), got {list(u.shape)}"
                )
        if not self.continuous:
            if dt != 1.0:
                raise ValueError(
                    f"{dt_field}: a discrete-time lds (A, Q) moves in steps of 1; give the continuous-time F and Qc "
                    f"for steps of other durations, got dt = {dt}"
                )
            if C is None:
                return self
            A, Q, gain = self.params["A"], self.params["Q"], None
        else:
            steps = torch.full((self.batch_size,), dt, dtype=torch.float64)
            A, Q, gain = van_loan(self.params["F"], self.params["Qc"], steps)
        params = {k: v for k, v in self.params.items() if k not in self.CONTINUOUS}
        dtype = self.params["B"].dtype
        params["A"], params["Q"] = A.to(dtype), Q.to(dtype)
        if self.continuous and not (
            bool(torch.isfinite(params["A"]).all()) and bool((torch.linalg.cholesky_ex(params["Q"]).info == 0).all())
        ):
            raise ValueError(
                f"{dt_field}: over dt = {dt:g} this model's transition is not representable (its noise covariance "
                "is no longer positive definite in float32, or it overflows); use a step of another length"
            )
        if C is not None:
            Cu = C.to(torch.float64) @ (u if u is not None else torch.zeros(C.shape[-1])).to(torch.float64)
            params["c"] = (Cu if gain is None else (gain @ Cu[..., None])[..., 0]).to(dtype)
        return type(self)(params, self.state_dim)

    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A, c, Q) of a step of 1 (of this step, for a model made by :meth:`at_step`)."""
        if self.continuous:
            return self.at_step(1.0).transition_affine()
        A = self.params["A"]
        c = self.params.get("c")
        return A, (c if c is not None else torch.zeros(A.shape[:2], dtype=A.dtype)), self.params["Q"]
