"""``logistic``: Bayesian logistic regression on streamed minibatches (MPF paper §5.4)

    w ∈ R^d,   y_j ~ Bernoulli(σ(wᵀ a_j)) for each row a_j of a minibatch,
    log p(o | w) = Σ_j [y_j log σ(wᵀa_j) + (1 − y_j) log σ(−wᵀa_j)],
    ∇w log p(o | w) = Σ_j (y_j − σ(wᵀa_j)) a_j.

One step's observation is ``{"x": [[...], ...], "y": [0, 1, ...]}`` (M rows of d features); internally it
is packed as a tensor [M, d + 1] whose last column is y, so it batches like any other observation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mpflow.operators import validation
from mpflow.operators.models.base import ModelFamily
from mpflow.operators.models.spec import FamilySpec
from mpflow.operators.rng import Generators, rand, randn


class Logistic(ModelFamily):
    name = "logistic"
    dynamic = False
    spec = FamilySpec(
        description="y ~ Bernoulli(sigmoid(w·x)) on streamed minibatches; static",
        observation='a minibatch {"x": [[d features], ...], "y": [0 or 1, ...]}',
        params=(),
    )
    #: −∇² log p(o | w) = Σ_j σ(wᵀa_j)(1 − σ(wᵀa_j)) a_j a_jᵀ ⪰ 0: log-concave, not Gaussian
    posterior_moves = True
    #: minibatch size used by ``simulate``
    simulate_batch = 32

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (-1, self.state_dim + 1)  # M rows of [features, label]; M may vary between steps

    @property
    def batch_size(self) -> int:  # no parameters: the batch is set by the observations
        return self._batch

    def __init__(self, params, state_dim, batch: int = 1):
        super().__init__(params, state_dim)
        self._batch = batch

    @classmethod
    def state_names(cls, d: int) -> list[str]:
        """x is the weight vector w of y ~ Bernoulli(σ(wᵀa)): ``w[i]``."""
        return [f"w[{i}]" for i in range(d)]

    @classmethod
    def stack(cls, models):
        dims = {m.state_dim for m in models}
        if len(dims) != 1:
            raise ValueError("models of different state dimensions cannot be batched")
        return cls({}, dims.pop(), batch=sum(m.batch_size for m in models))

    def select(self, rows: torch.Tensor) -> Logistic:
        """No parameters: the selected streams' model differs only in its batch size."""
        return self if self._batch == 1 else Logistic({}, self.state_dim, batch=len(rows))

    def to(self, dtype):
        return self

    def parse_observation(self, value, field: str = "observation", dtype=torch.float32) -> torch.Tensor:
        if not isinstance(value, dict) or set(value) != {"x", "y"}:
            raise ValueError(f'{field}: expected a minibatch {{"x": [[...], ...], "y": [0, 1, ...]}}')
        feats = validation.matrix(f"{field}.x", value["x"], None, self.state_dim, dtype)
        labels = validation.vector(f"{field}.y", value["y"], feats.shape[0], dtype)
        if feats.shape[0] == 0:
            raise ValueError(f"{field}.x: the minibatch is empty")
        if not bool(((labels == 0) | (labels == 1)).all()):
            raise ValueError(f"{field}.y: labels must be 0 or 1")
        return torch.cat([feats, labels[:, None]], dim=1)

    @staticmethod
    def _split(obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return obs[..., :-1], obs[..., -1]

    def likelihood_flops(self, k: int | None = None) -> float:
        """The logits x·a of M rows of k = M (d + 1) entries and their softplus: about 4 k + 20 M per particle."""
        k = self.observation_size() if k is None else k
        return 4.0 * k + 20.0 * k / (self.state_dim + 1)

    def observation_cdf(self, obs: torch.Tensor, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        """Each label y_j is Bernoulli(p_j), p_j = σ(wᵀa_j): the randomised CDF P(Y < y_j) + v_j P(Y = y_j),
        v_j ~ U(0, 1) (one per label, shared by the particles) → [B, N, M]: v_j (1 − p_j) for y_j = 0 and
        (1 − p_j) + v_j p_j for y_j = 1."""
        a, y = self._split(obs.to(torch.float64))
        p = torch.sigmoid(x.to(torch.float64) @ a.transpose(-1, -2))  # [B, N, M]
        v = rand(gens, [y.shape[-1]], torch.float64)[:, None]  # [B, 1, M]
        return torch.where(y[:, None] > 0.5, (1 - p) + v * p, v * (1 - p))

    def log_likelihood(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, y = self._split(obs)  # [B, M, d], [B, M]
        logits = x @ a.transpose(-1, -2)  # [B, N, M]
        return (y[:, None] * logits - F.softplus(logits)).sum(-1)  # y log σ(l) + (1 − y) log σ(−l)

    def score(self, obs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, y = self._split(obs)
        resid = y[:, None] - torch.sigmoid(x @ a.transpose(-1, -2))  # [B, N, M]
        return resid @ a

    def sample_observation(self, x: torch.Tensor, gens: Generators) -> torch.Tensor:
        feats = randn(gens, [self.simulate_batch, self.state_dim], x.dtype)
        p = torch.sigmoid(torch.einsum("bmd,bd->bm", feats, x))
        labels = (rand(gens, [self.simulate_batch], x.dtype) < p).to(x.dtype)
        return torch.cat([feats, labels[..., None]], dim=-1)
