"""``lorenz96``: the Lorenz-96 model (Lorenz 1996; Lorenz & Emanuel 1998), the data-assimilation community's test bed.

d variables on a ring (indices mod d) with forcing F:

    dx_i/dt = (x_{i+1} − x_{i−2}) x_{i−1} − x_i + F.

Between two observations, Δ (``delta``) time units apart, the ODE is integrated by classical RK4 in n = ⌈Δ / h⌉ equal
steps of at most h (``rk4_step``), and an optional additive model noise N(0, Q I) is added (``Q``, a variance per
observation interval; 0 by default: a perfect model). So x_m = f(x_{m-1}) + N(0, Q I) with a nonlinear f
(:meth:`Lorenz96.transition_mean`): the transition is not affine, and only the methods that move particles through
it (``smc``, ``enkf``, ``ukf``) run this family. The variables 0, k, 2k, … are observed (k = ``obs_every``), each
o_j = x_{jk} + N(0, R) — or o_j = arctan(x_{jk}) + N(0, R) with ``arctan`` (a bounded, nonlinear sensor).
Independent entries, so a partial observation conditions on its observed entries alone
(:mod:`mpflow.operators.models.diagonal_observation`). Defaults: DAPPER's ``Lorenz96/sakov2008`` (F = 8,
Δ = h = 0.05, every variable observed with R = 1; d = 40 there, any d ≥ 4 here). Covariance localisation reads the
distance around the ring (:meth:`Lorenz96.localisation_distances`).
"""

from __future__ import annotations

from typing import Any

import torch
from mpflow.operators import validation
from mpflow.operators.models.base import DEFAULT_SCALE_RANGE, ModelFamily, scaled_step, span
from mpflow.operators.models.diagonal_observation import DiagonalGaussianObservation
from mpflow.operators.models.spec import POSITIVE, REAL, FamilySpec, kind, parse_positive


def _number(value: float):
    return lambda d, dtype: torch.tensor(value, dtype=dtype)


@kind("number", REAL)
def parse_number(name: str, value, d: int, dtype) -> torch.Tensor:
    return validation.scalar(name, value, dtype)


@kind("non-negative number", POSITIVE)
def parse_variance(name: str, value, d: int, dtype) -> torch.Tensor:
    """A non-negative number (0: no noise)."""
    t = validation.scalar(name, value, dtype)
    if not float(t) >= 0:
        raise ValueError(f"{name}: must be a non-negative number, got {value!r}")
    return t


@kind("positive integer ≤ d")
def parse_count(name: str, value, d: int, dtype) -> torch.Tensor:
    """A positive integer, at most d."""
    k = validation.positive_int(name, value, d)
    return torch.tensor(float(k), dtype=dtype)


@kind("true or false (1 or 0)")
def parse_flag(name: str, value, d: int, dtype) -> torch.Tensor:
    """true or false, or 1 or 0 (the REST API's model parameters are numbers)."""
    if isinstance(value, bool) or (isinstance(value, int | float) and value in (0, 1)):
        return torch.tensor(float(value), dtype=dtype)
    raise ValueError(f"{name}: must be true or false (1 or 0), got {value!r}")


def tendency(x: torch.Tensor, forcing: torch.Tensor) -> torch.Tensor:
    """dx/dt = (x_{i+1} − x_{i−2}) x_{i−1} − x_i + F for x [..., d] (ring indices), forcing broadcast against x."""
    return (torch.roll(x, -1, -1) - torch.roll(x, 2, -1)) * torch.roll(x, 1, -1) - x + forcing


def substep_counts(delta: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """n = ⌈Δ / h⌉ (at least 1) per stream: the RK4 sub-steps of a step of Δ time units in steps of at most h (a
    slack of 1e-6 keeps Δ = h at one step despite rounding); inf where Δ / h overflows."""
    return torch.ceil(delta / h - 1e-6).clamp_min(1)


def rk4(x: torch.Tensor, forcing: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One classical Runge–Kutta step of size h."""
    k1 = tendency(x, forcing)
    k2 = tendency(x + 0.5 * h * k1, forcing)
    k3 = tendency(x + 0.5 * h * k2, forcing)
    k4 = tendency(x + h * k3, forcing)
    return x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


#: meta-training tasks: observation noise variances R, and the noise-free steps that carry an initial state onto
#: the attractor (10 time units at Δ = 0.05)
TASK_R_RANGE = (0.5, 2.0)
TASK_SPIN_UP = 200
#: the attractor's range at F = 8 (measured over 64 spun-up states, d = 10 and 40: −7.5 … 13.0), widened by 3 sd of
#: the prior's offset ξ ~ N(0, I)
ATTRACTOR_RANGE = (-11.0, 16.0)


class Lorenz96(DiagonalGaussianObservation):
    name = "lorenz96"
    dynamic = True
    affine_transition = False
    min_state_dim = 4
    spec = FamilySpec(
        description=(
            "Lorenz-96 ring dx_i/dt = (x_{i+1} − x_{i−2}) x_{i−1} − x_i + F, RK4 over Δ = delta in steps ≤ rk4_step, "
            "model noise N(0, Q I); o = x_{0, k, 2k, …} (or arctan of them) + N(0, R I), k = obs_every"
        ),
        observation="vector of length ⌈d / obs_every⌉ (variables 0, k, 2k, …); null for an entry not observed",
        params=(
            ("F", parse_number, _number(8.0)),
            ("delta", parse_positive, _number(0.05)),
            ("rk4_step", parse_positive, _number(0.05)),
            ("Q", parse_variance, _number(0.0)),
            ("obs_every", parse_count, _number(1.0)),
            ("R", parse_positive, _number(1.0)),
            ("arctan", parse_flag, _number(0.0)),
        ),
    )

    substep_params = ("delta", "rk4_step")
    #: the most RK4 sub-steps :meth:`Lorenz96.transition_mean` runs in one call, whoever asks (ValueError beyond):
    #: its loop is bounded by construction. The service refuses far fewer up front (MPFLOW_MAX_INTEGRATION_SUBSTEPS)
    MAX_SUBSTEPS = 1_000_000
    #: floating-point operations of one RK4 sub-step per particle and state variable: 4 tendencies of about 6
    #: operations each (3 rolls, a product, two sums) and the stage combinations (about 14)
    RK4_FLOPS_PER_VARIABLE = 38
    #: an RK4 sub-step is about 40 small tensor operations: measured, 999 sub-steps of N = 1024, d = 40 take as long
    #: as 6e9 operations of a step beyond their arithmetic (15 observations of them: 51 s on 2 loaded cores)
    substep_overhead_flops = 6e6

    @classmethod
    def from_params(cls, params, state_dim: int, dtype: torch.dtype = torch.float32) -> ModelFamily:
        """As for every family, plus the observed indices 0, k, 2k, … (``obs_index``, from ``obs_every``)."""
        model = super().from_params(params, state_dim, dtype)
        k = int(model.params["obs_every"][0])
        model.params["obs_index"] = torch.arange(0, state_dim, k, dtype=dtype)[None]
        return model

    # ----------------------------------------------------------------- dynamics
    def at_step(self, dt: float = 1.0, u: torch.Tensor | None = None, field: str = "observation") -> ModelFamily:
        """A step lasting ``dt`` observation intervals: Δ·dt time units."""
        return scaled_step(self, "delta", dt, u, field)

    def transition_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise TypeError("the lorenz96 family's transition is nonlinear: it has no (F, c, Q) form")

    def integration_substeps(self, dt: float = 1.0) -> float:
        """n = ⌈Δ·dt / h⌉, the RK4 sub-steps of a step of ``dt`` observation intervals (the largest over the batch),
        in float64: Δ = 1e38 gives an honest 2e39 (2e77 with dt = 1e38), not an overflow."""
        delta, h = (self.params[k].to(torch.float64) for k in ("delta", "rk4_step"))
        return float(substep_counts(delta * float(dt), h).max())

    def transition_flops(self) -> float:
        return float(self.RK4_FLOPS_PER_VARIABLE * self.state_dim)

    def transition_mean(self, x: torch.Tensor) -> torch.Tensor:
        """f(x): RK4 over Δ in n_b = ⌈Δ_b / h_b⌉ equal steps per stream b; a stream whose n_b is reached stops while
        the others go on, so each stream's result is the one it gets alone. ValueError beyond ``MAX_SUBSTEPS``."""
        p = self.expanded(x.shape[0])
        delta, h, forcing = (p[k].to(x.dtype)[:, None, None] for k in ("delta", "rk4_step", "F"))
        steps = substep_counts(delta, h)
        most = float(steps.max())
        if not most <= self.MAX_SUBSTEPS:
            raise ValueError(
                f"model.params.delta, model.params.rk4_step: a step of Δ = {float(delta.max()):.4g} in RK4 steps of "
                f"h = {float(h.min()):.4g} needs {most:.4g} sub-steps, more than the {self.MAX_SUBSTEPS} the "
                "lorenz96 family runs; lengthen rk4_step or shorten the step"
            )
        size = delta / steps
        for i in range(int(most)):
            x = torch.where(steps > i, rk4(x, forcing, size), x)
        return x

    def transition_noise(self) -> torch.Tensor:
        return self.params["Q"][:, None, None] * torch.eye(self.state_dim, dtype=self.params["Q"].dtype)

    def noise_added(self, fx: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """fx + √Q z, defined at Q = 0 (z drawn even there, so a stream's draws do not depend on its batch)."""
        sd = torch.sqrt(self.expanded(fx.shape[0])["Q"]).to(fx.dtype)[:, None, None]
        return fx + sd * z

    # ----------------------------------------------------------------- observation
    def observed_mean(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.params["obs_index"].long()
        idx = idx.expand(x.shape[0], -1)[:, None].expand(-1, x.shape[1], -1)
        seen = torch.gather(x, -1, idx)
        arctan = self.params["arctan"].to(x.dtype)[:, None, None] > 0
        return torch.where(arctan, torch.atan(seen), seen)

    def observation_sd(self) -> torch.Tensor:
        R, idx = self.params["R"], self.params["obs_index"]
        return torch.sqrt(R)[:, None].expand(R.shape[0], idx.shape[-1]).to(R.dtype)

    def linear_observation(self) -> bool:
        """o = H x + N(0, R I) unless some stream observes through ``arctan``."""
        return not bool((self.params["arctan"] > 0).any())

    def observation_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(H [B, k, d], R [B, k, k]) of the linear observation: H picks the observed variables 0, k, 2k, … (its
        rows zero at a partial observation's gaps, where R is 1:
        :mod:`~mpflow.operators.models.diagonal_observation`)."""
        if not self.linear_observation():
            raise TypeError("the lorenz96 family observes through arctan here: its observation is not linear")
        s = self.observation_sd()
        B, k = s.shape
        idx = self.params["obs_index"].long().expand(B, k)
        H = torch.zeros(B, k, self.state_dim, dtype=s.dtype).scatter_(-1, idx[..., None], 1.0)
        return H * self._seen(s)[..., None], self.observation_noise()

    def on_sites(self, obs: torch.Tensor) -> torch.Tensor:
        """Observations [B, k] (linear: the observed variables' values) placed on the ring of d sites → [B, d] float64,
        NaN at a site not observed (or whose entry is NaN)."""
        B = obs.shape[0]
        idx = self.params["obs_index"].long().expand(B, -1)
        ring = torch.full((B, self.state_dim), torch.nan, dtype=torch.float64)
        return ring.scatter(1, idx, obs.to(torch.float64))

    def localisation_distances(self) -> torch.Tensor:
        """[B, d, k]: min(|i − j|, d − |i − j|) between variable i and the observed variable j."""
        d = self.state_dim
        idx = self.params["obs_index"].to(torch.float64)
        i = torch.arange(d, dtype=torch.float64)[None, :, None]
        gap = (i - idx[:, None, :]).abs()
        return torch.minimum(gap, d - gap)

    # ----------------------------------------------------------------- a trained operator's domain
    @classmethod
    def task_domain(cls, options: dict[str, Any]) -> dict[str, list[float]]:
        """F = 8 and Δ = 0.05 as trained, every variable observed (obs_every 1), ``arctan`` as trained, R in
        ``R_range``, a prior mean within the attractor's range (``ATTRACTOR_RANGE``, widened by the offset ξ), its
        variances in ``scale_range``."""
        lo, hi = options.get("scale_range", DEFAULT_SCALE_RANGE)
        arctan = float(options.get("arctan", 0))
        return {
            "F": [8.0, 8.0],
            "delta": [0.05, 0.05],
            "obs_every": [1.0, 1.0],
            "arctan": [arctan, arctan],
            "R": [float(r) for r in options.get("R_range", TASK_R_RANGE)],
            "prior mean": list(ATTRACTOR_RANGE),
            "prior variance": [float(lo), float(hi)],
        }

    def domain_measures(self, prior_mean: torch.Tensor, prior_cov: torch.Tensor) -> dict[str, tuple[float, float]]:
        return {
            **{k: span(self.params[k][0].to(torch.float64)) for k in ("F", "delta", "obs_every", "arctan", "R")},
            "prior mean": span(prior_mean),
            "prior variance": span(torch.linalg.eigvalsh(prior_cov.to(torch.float64))),
        }

    @classmethod
    def example_state_dim(cls) -> int:
        """d = 10: the smallest d ``benchmarks.lorenz96`` measured (and the shipped ``lorenz96-d10-v1``'s)."""
        return 10

    @classmethod
    def example_params(cls, d: int) -> dict[str, Any]:
        """The defaults (DAPPER sakov2008)."""
        return {}
