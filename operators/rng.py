"""Per-stream random number generation, keyed by (stream key, draw counter).

Every random draw of a stream comes from a generator determined by the stream's key (from its ``seed``) and a
counter of the draws it has made — a counter-based scheme (Salmon, Moraes, Dror & Shaw 2011, "Parallel random
numbers: as easy as 1, 2, 3", SC'11): draw c of stream b uses torch's generator seeded with
mix(key_b ⊕ mix(c)), mix the SplitMix64 finaliser (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
generators", OOPSLA), a bijection of 64-bit words with full avalanche. So

* a stream's state is 16 bytes (key, counter), where a Mersenne Twister's is 5 KB — stored with every update;
* stream b's numbers depend on (key_b, c_b) only: the same answers whether it is updated alone or micro-batched
  with others, and whichever rows of a batch draw (``rng[b]`` is stream b's generator; a list of rows of one
  :class:`StreamRNG` draws together);
* the numbers themselves are torch's (its Mersenne Twister and normal sampler, seeded per draw): a batched
  integer hash in torch was measured at twice the cost of torch's own sampler for [64, 1280] normals.

Lists of :class:`torch.Generator` (meta-training, tests) are still accepted by every function here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """The SplitMix64 finaliser of a 64-bit word (an integer in [0, 2⁶⁴))."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def key_from_seed(seed: int) -> int:
    """A stream's key from its seed (0 … 2⁶³ − 1), as a signed 64-bit integer (storable in int64)."""
    key = mix(int(seed) * _GOLDEN)
    return key - (1 << 64) if key >= 1 << 63 else key


class StreamRNG:
    """The generators of B streams: ``keys`` and ``counters``, int64 [B] (module docstring)."""

    def __init__(self, keys: torch.Tensor, counters: torch.Tensor):
        self.keys = [int(k) for k in keys.to(torch.int64)]
        self.counters = [int(c) for c in counters.to(torch.int64)]

    @classmethod
    def from_seeds(cls, seeds: Sequence[int]) -> StreamRNG:
        return cls(torch.tensor([key_from_seed(s) for s in seeds], dtype=torch.int64), torch.zeros(len(seeds)))

    def state(self) -> torch.Tensor:
        """[B, 2] int64: (key, counter) per stream, stored with the particles."""
        return torch.tensor([self.keys, self.counters], dtype=torch.int64).T.contiguous()

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, b: int) -> StreamRNG.Row:
        if not -len(self) <= b < len(self):
            raise IndexError(f"stream {b} of {len(self)}")
        return StreamRNG.Row(self, b % len(self))

    def __iter__(self):
        return (StreamRNG.Row(self, b) for b in range(len(self)))

    def next_generator(self, b: int) -> torch.Generator:
        """Stream b's generator for its next draw (advances its counter)."""
        c = self.counters[b]
        self.counters[b] = c + 1
        return generator(mix((self.keys[b] & _MASK64) ^ mix(c * _GOLDEN + 1)))

    class Row:
        """Stream ``index`` of a :class:`StreamRNG` (what ``rng[b]`` gives): it draws as that stream."""

        __slots__ = ("index", "parent")

        def __init__(self, parent: StreamRNG, index: int):
            self.parent, self.index = parent, index


Generators = StreamRNG | Sequence[StreamRNG.Row] | Sequence[torch.Generator]


def torch_generator(g: StreamRNG.Row | torch.Generator) -> torch.Generator:
    """The torch generator of one stream's next draw (advancing its counter), for code that draws from a
    :class:`torch.Generator` itself (a cached sampler); a torch generator is returned as it is."""
    return g.parent.next_generator(g.index) if isinstance(g, StreamRNG.Row) else g


def _draw_generators(gens: Generators) -> list[torch.Generator]:
    """One torch generator per stream for the next draw (advancing each stream's counter)."""
    return [torch_generator(g) for g in (iter(gens) if isinstance(gens, StreamRNG) else gens)]


def generator(seed: int) -> torch.Generator:
    """A torch generator seeded with ``seed`` (meta-training, single-stream reference draws)."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def generators_from_state(states: torch.Tensor) -> StreamRNG:
    """The B streams' generators from their stored states [B, 2] int64 (:meth:`StreamRNG.state`)."""
    if states.dtype != torch.int64 or states.dim() != 2 or states.shape[1] != 2:
        raise ValueError(f"rng: expected (key, counter) rows [B, 2] int64, got {states.dtype} {list(states.shape)}")
    return StreamRNG(states[:, 0], states[:, 1])


def generators_state(gens: StreamRNG) -> torch.Tensor:
    """The states of B streams' generators, [B, 2] int64 (storable with the particles)."""
    return gens.state()


def copied(gens: Generators) -> StreamRNG | list[torch.Generator]:
    """An independent copy of ``gens`` at their current counters: it draws what ``gens`` would draw next, and
    drawing from it leaves ``gens`` as they are (torch generators are cloned)."""
    rows = list(iter(gens)) if isinstance(gens, StreamRNG) else list(gens)
    if all(isinstance(g, StreamRNG.Row) for g in rows):
        keys = torch.tensor([g.parent.keys[g.index] for g in rows], dtype=torch.int64)
        return StreamRNG(keys, torch.tensor([g.parent.counters[g.index] for g in rows], dtype=torch.int64))
    out = []
    for g in rows:
        clone = torch.Generator()
        clone.set_state(g.get_state())
        out.append(clone)
    return out


def side_streams(gens: Generators, tag: int) -> list[torch.Generator]:
    """One torch generator per stream for a draw *beside* the stream's own sequence (an estimate the step reports,
    not one its particles depend on): seeded with mix(key ⊕ mix(tag)) and the stream's current counter, so it is
    reproducible per stream, independent of its batch, and leaves the stream's counter — hence every later draw of
    the step and of the stream — as it was. A :class:`torch.Generator` (tests, training) is cloned."""
    rows = list(iter(gens)) if isinstance(gens, StreamRNG) else list(gens)
    out = []
    for g in rows:
        if isinstance(g, StreamRNG.Row):
            key, counter = g.parent.keys[g.index], g.parent.counters[g.index]
            out.append(generator(mix((key & _MASK64) ^ mix(tag * _GOLDEN)) ^ mix(counter * _GOLDEN + 1)))
        else:
            out += copied([g])
    return out


def randn(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws [B, *shape], row b drawn from stream b's generator (:func:`_draw`)."""
    return _draw(torch.randn, gens, shape, dtype)


def rand(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform [0, 1) draws [B, *shape], row b drawn from stream b's generator (:func:`_draw`)."""
    return _draw(torch.rand, gens, shape, dtype)


def _draw(
    sample: Callable[..., torch.Tensor], gens: Generators, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Each stream's draw made on its generator's device (the CPU), then placed on the default device — CUDA
    inside meta-training's ``torch.device("cuda")`` — so a stream draws the same numbers on every device."""
    rows = [sample(tuple(shape), generator=g, dtype=dtype, device=g.device) for g in _draw_generators(gens)]
    return torch.stack(rows).to(torch.get_default_device())


def rademacher(gens: Generators, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 draws [B, *shape] (Hutchinson probes)."""
    return rand(gens, shape, dtype).lt(0.5).to(dtype) * 2 - 1


def haar_orthogonal(gens: Generators, d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Haar-random orthogonal matrices [B, d, d]: Q of the QR decomposition of a standard Gaussian matrix,
    with the column signs fixed by diag(R) (Mezzadri 2007), drawn in float64."""
    q, r = torch.linalg.qr(randn(gens, [d, d], torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).to(dtype)
