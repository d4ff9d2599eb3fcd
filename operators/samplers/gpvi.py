"""Generative Particle VI (Ratzlaff et al. 2021): a generator trained to sample any log-density.

Generator (eq. 6), z ~ N(0, I_d), k = ``noise_dim`` ≤ d:

    f_θ(z) = g_θ(z[:k]) + λ z,        J_f(z) = [∂g/∂z[:k] | 0] + λ I      (eq. 7)

with g_θ a ReLU MLP (``hidden`` may be empty: then g is affine and q = N(b, (W̃ + λI)(W̃ + λI)ᵀ), W̃ = [W | 0]).

Functional gradient of KL(q ‖ p) in the RKHS of an RBF kernel on the *noise* (Theorem 3.1, eq. 5), with a
fresh batch z′ for the expectation:

    g_i = (1/m′) Σ_j [ −∇log p(f(z′_j)) k(z′_j, z_i) − J_f(z′_j)^{−T} ∇_{z′_j} k(z′_j, z_i) ],
    k(z′, z) = exp(−‖z′ − z‖² / h),    h = median_{j,i} ‖z′_j − z_i‖² / log m     (App. B.2),

pulled back to θ through the generator (eq. 4): minimise Σ_i g_i.detach() · f_θ(z_i) with Adam.

Transpose. The paper prints (J_f)^{−1} in eq. (5), (8), (10); its proof (App. A.1, the trace identity
Tr(J^{−1} ∂φ/∂z) = (J^{−1})_{ji} ∂_j φ^i) gives the i-th component Σ_j (J^{−1})_{ji} ∂_j k, i.e. J^{−T} ∇k,
and its eq. (11) — the vector–Jacobian product hᵀ J_f — is the residual of Jᵀ h = v, not of J h = v. The
reference code (HorizonRobotics/alf) uses J^{−T}. The two agree when J_f is symmetric: for a Gaussian target
N(μ, Σ) and an affine generator f(z) = A z + b, the J^{−T} flow rests where Aᵀ Σ⁻¹ A = I (any A Aᵀ = Σ),
the J^{−1} flow where A Σ⁻¹ A = I, whose positive-definite solution A = Σ^{1/2} is symmetric, so Bayesian
linear regression cannot tell them apart; for general generators only J^{−T} is the gradient of the KL.

J^{−T} ∇k is obtained either
- exactly (``exact_jacobian=True``): J_f by one backward pass per output (small d), then a batched solve;
- by the helper network h_η(z′[:k], v) ≈ J_f(z′)^{−T} v (eq. 9), trained by one Adam step per generator
  step (Algorithm 1) on  L(η) = mean ‖J_f(z′)ᵀ h_η − v‖²  (eq. 10), the product computed as the VJP
  hᵀ J_f = hᵀ ∂g/∂z′[:k] + λ hᵀ by one backward pass (eq. 11).
  Architecture (App. B.1): one ReLU layer on z′[:k] and one on v, concatenated, then a ReLU MLP; plus (our
  addition) a linear skip A v initialised to v/λ. J^{−T} v is linear in v for every z′, so the skip makes the
  affine-generator case exactly representable and makes h exact at initialisation (g's last layer starts
  at zero, so f(z) = λz and J^{−T} = I/λ); the MLP learns the z′-dependence of nonlinear generators.

Every random draw (initial weights, z and z′ batches, samples) comes from an explicit torch.Generator.
Saved as a folder: ``config.json`` (architecture) + ``weights.safetensors`` (state_dict).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from mpflow.operators import rng
from mpflow.operators.validation import positive_int
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

Score = Callable[[torch.Tensor], torch.Tensor]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"


@dataclass
class GPVIConfig:
    dim: int
    noise_dim: int
    hidden: list[int] = field(default_factory=list)
    lam: float = 1.0
    helper_hidden: list[int] = field(default_factory=lambda: [32, 32])
    exact_jacobian: bool = False
    kind: str = "gpvi"
    version: int = 1


@dataclass
class GPVIHistory:
    """Per-step training trace: generator loss Σ g·f, helper loss (eq. 10; NaN when exact), ‖g‖ mean."""

    loss: torch.Tensor
    helper_loss: torch.Tensor
    grad_norm: torch.Tensor


def _linear(n_in: int, n_out: int, generator: torch.Generator, zero: bool = False) -> nn.Linear:
    """nn.Linear with U(−1/√n_in, 1/√n_in) weights and bias drawn from ``generator`` (or all zeros)."""
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out)  # no draw from the global RNG
    with torch.no_grad():
        if zero:
            layer.weight.zero_()
            layer.bias.zero_()
        else:
            bound = 1.0 / math.sqrt(n_in)
            layer.weight.copy_((torch.rand(n_out, n_in, generator=generator) * 2 - 1) * bound)
            layer.bias.copy_((torch.rand(n_out, generator=generator) * 2 - 1) * bound)
    return layer


def _mlp(sizes: Sequence[int], generator: torch.Generator, zero_last: bool) -> nn.Sequential:
    """ReLU MLP sizes[0] → … → sizes[-1], linear output layer (zero-initialised when ``zero_last``)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        last = i == len(sizes) - 2
        layers.append(_linear(sizes[i], sizes[i + 1], generator, zero=zero_last and last))
        if not last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class InverseJacobianHelper(nn.Module):
    """h_η(z′[:k], v) ≈ J_f(z′)^{−T} v (eq. 9; architecture App. B.1 plus a linear skip in v)."""

    def __init__(self, dim: int, noise_dim: int, hidden: Sequence[int], lam: float, generator: torch.Generator):
        super().__init__()
        self.skip = nn.utils.skip_init(nn.Linear, dim, dim, bias=False)
        with torch.no_grad():
            self.skip.weight.copy_(torch.eye(dim) / lam)
        self.branches = bool(hidden)
        if self.branches:
            w = hidden[0]
            self.z_branch = nn.Sequential(_linear(noise_dim, w, generator), nn.ReLU())
            self.v_branch = nn.Sequential(_linear(dim, w, generator), nn.ReLU())
            self.trunk = _mlp([2 * w, *hidden[1:], dim], generator, zero_last=True)

    def forward(self, z_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.skip(v)
        if self.branches:
            out = out + self.trunk(torch.cat([self.z_branch(z_k), self.v_branch(v)], -1))
        return out


def rbf_cross(zp: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k(z′_j, z_i) [m′, m] and ∇_{z′_j} k(z′_j, z_i) = −2 (z′_j − z_i) k / h  [m′, m, d];
    h = median ‖z′_j − z_i‖² / log m (App. B.2)."""
    diff = zp[:, None, :] - z[None, :, :]
    sq = (diff * diff).sum(-1)
    h = sq.median().clamp_min(1e-12) / math.log(z.shape[0])
    K = torch.exp(-sq / h)
    return K, (-2.0 / h) * diff * K[..., None]


class GPVIGenerator(nn.Module):
    """x = f_θ(z) = g_θ(z[:k]) + λ z, z ~ N(0, I_dim), trained by GPVI for any ∇log p (module docstring)."""

    def __init__(
        self,
        dim: int,
        noise_dim: int | None = None,
        hidden: Sequence[int] = (),
        lam: float = 1.0,
        helper_hidden: Sequence[int] = (32, 32),
        exact_jacobian: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        dim = positive_int("dim", dim)
        noise_dim = dim if noise_dim is None else positive_int("noise_dim", noise_dim)
        if noise_dim > dim:
            raise ValueError(f"noise_dim: must be at most dim = {dim} (eq. 6 uses z[:k]), got {noise_dim}")
        hidden = [positive_int("hidden", int(h)) for h in hidden]
        helper_hidden = [positive_int("helper_hidden", int(h)) for h in helper_hidden]
        if not (isinstance(lam, int | float) and math.isfinite(lam) and lam > 0):
            raise ValueError(f"lam: must be a positive number, got {lam!r}")
        self.config = GPVIConfig(dim, noise_dim, hidden, float(lam), helper_hidden, bool(exact_jacobian))
        gen = generator if generator is not None else rng.generator(0)
        # Last layer zero: training starts from f(z) = λz, whose Jacobian λI is well conditioned.
        self.g = _mlp([noise_dim, *hidden, dim], gen, zero_last=True)
        self.helper = InverseJacobianHelper(dim, noise_dim, helper_hidden, float(lam), gen)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def noise_dim(self) -> int:
        return self.config.noise_dim

    @property
    def lam(self) -> float:
        return self.config.lam

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """f(z) for z [n, dim] (eq. 6)."""
        return self.g(z[:, : self.noise_dim]) + self.lam * z

    def jacobian(self, z: torch.Tensor) -> torch.Tensor:
        """J_f(z) [n, dim, dim] (eq. 7), detached from θ."""
        with torch.enable_grad():
            zk = z[:, : self.noise_dim].detach().requires_grad_(True)
            y = self.g(zk)
            # Rows are independent, so ∂(Σ_n g_r(z_n))/∂z_n = ∂g_r/∂z(z_n): one backward pass per output r.
            rows = [
                torch.autograd.grad(y[:, r].sum(), zk, retain_graph=r < self.dim - 1, allow_unused=True)[0]
                for r in range(self.dim)
            ]
        J = self.lam * torch.eye(self.dim, dtype=z.dtype).expand(z.shape[0], -1, -1).clone()
        for r, row in enumerate(rows):
            if row is not None:
                J[:, r, : self.noise_dim] += row.detach()
        return J

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n draws f(z), z ~ N(0, I) from ``generator`` → [n, dim]."""
        n = positive_int("n", n)
        with torch.no_grad():
            return self(torch.randn(n, self.dim, generator=generator))

    # ---- training -----------------------------------------------------------------------------------------

    def _helper_step(self, zp: torch.Tensor, v: torch.Tensor, opt: torch.optim.Optimizer) -> tuple[torch.Tensor, float]:
        """h_η(z′_j, v_ji) for all pairs, then one Adam step on eq. (10) with Jᵀh by VJP (eq. 11)."""
        mp, m, d = v.shape
        zpair = zp[:, None, :].expand(mp, m, d).reshape(mp * m, d).detach().requires_grad_(True)
        vflat = v.reshape(mp * m, d).detach()
        y = self.helper(zpair[:, : self.noise_dim].detach(), vflat)
        (JTy,) = torch.autograd.grad(self(zpair), zpair, grad_outputs=y, create_graph=True)
        loss = ((JTy - vflat) ** 2).sum(-1).mean()
        params = [p for p in self.helper.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params)
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        opt.step()
        return y.detach().reshape(mp, m, d), float(loss.detach())

    def _inverse_jacobian_term(
        self, zp: torch.Tensor, v: torch.Tensor, opt_h: torch.optim.Optimizer | None
    ) -> tuple[torch.Tensor, float]:
        """J_f(z′_j)^{−T} v_ji [m′, m, d] (exact, or by the helper) and the helper loss (NaN if exact)."""
        if opt_h is None:
            JT = self.jacobian(zp).transpose(-1, -2)  # [m′, d, d]
            return torch.linalg.solve(JT, v.transpose(1, 2)).transpose(1, 2), float("nan")
        return self._helper_step(zp, v, opt_h)

    def functional_gradient(
        self, z: torch.Tensor, zp: torch.Tensor, score_fn: Score, opt_h: torch.optim.Optimizer | None = None
    ) -> tuple[torch.Tensor, float]:
        """g_i of eq. (5)/(9) at the batch z [m, d], expectation over z′ [m′, d] → ([m, d], helper loss)."""
        K, gradK = rbf_cross(zp, z)
        inv_term, helper_loss = self._inverse_jacobian_term(zp, gradK, opt_h)
        with torch.no_grad():
            xp = self(zp)
        s = score_fn(xp)
        if not isinstance(s, torch.Tensor) or s.shape != xp.shape:
            got = list(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"score_fn: must return ∇log p of shape {list(xp.shape)}, got {got}")
        s = s.detach().to(xp.dtype)
        if not torch.isfinite(s).all():
            raise ValueError("score_fn: returned NaN or infinite values")
        return (-(K.transpose(0, 1) @ s) - inv_term.sum(0)) / zp.shape[0], helper_loss

    def fit(
        self,
        score_fn: Score,
        steps: int,
        batch: int = 10,
        lr: float = 1e-3,
        *,
        generator: torch.Generator | None = None,
        final_lr: float | None = None,
        helper_lr: float = 1e-3,
        progress: bool = False,
    ) -> GPVIHistory:
        """Algorithm 1 for ``steps`` steps. ``score_fn(x [n, dim]) → ∇log p(x) [n, dim]``.

        Each step draws two batches z, z′ of size ``batch`` from ``generator`` (seed 0 when None), steps the
        helper once (unless ``exact_jacobian``), then the generator once with Adam. The generator's learning
        rate decays geometrically from ``lr`` to ``final_lr`` (constant when None); the helper's stays
        ``helper_lr`` so that it keeps chasing J_f^{−T} while the generator settles.
        """
        steps = positive_int("steps", steps)
        batch = positive_int("batch", batch)
        if batch < 2:
            raise ValueError("batch: at least 2 (the kernel bandwidth needs log m > 0)")
        for name, value in (("lr", lr), ("helper_lr", helper_lr), ("final_lr", final_lr)):
            if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number, got {value!r}")
        gen = generator if generator is not None else rng.generator(0)
        opt_g = torch.optim.Adam(self.g.parameters(), lr=lr)
        opt_h = None if self.config.exact_jacobian else torch.optim.Adam(self.helper.parameters(), lr=helper_lr)
        decay = 1.0 if final_lr is None else (final_lr / lr) ** (1.0 / max(steps - 1, 1))
        hist = torch.empty(3, steps)
        d = self.dim
        for t in tqdm(range(steps), disable=not progress, desc="gpvi", leave=False):
            z = torch.randn(batch, d, generator=gen)
            zp = torch.randn(batch, d, generator=gen)
            grad, helper_loss = self.functional_gradient(z, zp, score_fn, opt_h)
            opt_g.zero_grad(set_to_none=True)
            loss = (grad.detach() * self(z)).sum()  # eq. (4)
            loss.backward()
            opt_g.step()
            for group in opt_g.param_groups:
                group["lr"] *= decay
            hist[:, t] = torch.tensor([float(loss.detach()), helper_loss, float(grad.norm(dim=-1).mean())])
        self.helper.zero_grad(set_to_none=True)
        self.g.zero_grad(set_to_none=True)
        return GPVIHistory(loss=hist[0], helper_loss=hist[1], grad_norm=hist[2])

    # ---- persistence --------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write ``path/config.json`` and ``path/weights.safetensors``; returns the folder."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        state = {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        return folder

    @classmethod
    def load(cls, path: str | Path) -> GPVIGenerator:
        """Rebuild a generator saved by :meth:`save`."""
        folder = Path(path)
        try:
            cfg = json.loads((folder / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"path: cannot read {folder / CONFIG_FILE} ({exc})") from None
        if cfg.get("kind") != "gpvi":
            raise ValueError(f"path: {folder} does not hold a GPVI generator (kind={cfg.get('kind')!r})")
        model = cls(
            cfg["dim"],
            cfg["noise_dim"],
            cfg["hidden"],
            cfg["lam"],
            cfg["helper_hidden"],
            cfg["exact_jacobian"],
        )
        model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
        return model
