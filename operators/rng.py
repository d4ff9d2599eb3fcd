"""Per-stream random number generation.

Every random draw in mpflow goes through an explicit :class:`torch.Generator` seeded from the stream's
``seed``, so a stream gives the same answers whether it is updated alone or micro-batched with others:
a batch of B streams draws its noise stream by stream (``randn(gens, shape)`` stacks B draws) and stores
each generator's state back into the stream's :class:`~mpflow.operators.state.ParticleState`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Generators = Sequence[torch.Generator]


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def generators_from_state(states: torch.Tensor) -> list[torch.Generator]:
    """Rebuild B generators from their saved states, a uint8 tensor [B, S]."""
    gens = []
    for row in states:
        g = torch.Generator()
        g.set_state(row.clone())
        gens.append(g)
    return gens


def generators_state(gens: Generators) -> torch.Tensor:
    """The states of B generators as a uint8 tensor [B, S] (storable with the particles)."""
    return torch.stack([g.get_state() for g in gens])


def randn(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws [B, *shape], row b drawn from ``gens[b]``."""
    return torch.stack([torch.randn(tuple(shape), generator=g, dtype=dtype) for g in gens])


def rand(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform [0, 1) draws [B, *shape], row b drawn from ``gens[b]``."""
    return torch.stack([torch.rand(tuple(shape), generator=g, dtype=dtype) for g in gens])


def rademacher(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 draws [B, *shape] (Hutchinson probes)."""
    return rand(gens, shape, dtype).lt(0.5).to(dtype) * 2 - 1


def haar_orthogonal(gens: Generators, d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Haar-random orthogonal matrices [B, d, d]: Q of the QR decomposition of a standard Gaussian matrix,
    with the column signs fixed by diag(R) (Mezzadri 2007), drawn in float64."""
    q, r = torch.linalg.qr(randn(gens, [d, d], torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).to(dtype)
