"""Sequential quasi-Monte Carlo (SQMC) for one-dimensional states: Gerber & Chopin 2015, "Sequential quasi-Monte
Carlo", JRSS B 77(3), Algorithm 2 with d = 1 (where their Hilbert-curve ordering is the order of the real line).

One step takes a weighted cloud {x_i, w_i} of p(x_{m−1} | o_<m) to N uniformly weighted draws of p(x_m | o_<m):

  1. sort the particles, x_(1) ≤ … ≤ x_(N), with their normalised weights, and form the weight CDF
     W_k = Σ_{i≤k} w_(i);
  2. take N randomised quasi-Monte Carlo points u_n = (u_n1, u_n2) ∈ [0, 1)² (Gerber & Chopin sort them by u_n1;
     the pairs below are the same in any order);
  3. resample by inverting the CDF at u_n1: the ancestor of point n is a_n = min{k : W_k > u_n1} (§4.1, eq. 9);
  4. propagate with the point's second coordinate as the transition noise: x'_n = f(x_(a_n)) + √Q Φ⁻¹(u_n2)
     (:meth:`~mpflow.operators.models.base.ModelFamily.transition_from_noise`).

Because the points fill [0, 1)² evenly, the resampling and the noise together fill the joint (ancestor, noise)
space evenly, and the evidence log mean_i p(o | x'_i) has an error of o(N^{−1/2}) (Gerber & Chopin Thm. 7); on
the GBP/USD stochastic-volatility run (docs/benchmarks.md "Anomaly scores", 8 seeds) the total log-evidence's sd
over seeds falls from 0.64 to 0.08 nat at N = 256 and from 0.15 to 0.008 at N = 4096.

The points (:func:`points`): one scrambled Sobol' point set per N (Owen-type scrambling with a fixed seed, made once
and cached — creating a scrambled ``SobolEngine`` costs about 0.6 ms, too much per stream and step), randomised per
stream and step by a random digital shift (an XOR of each coordinate's 30 bits with a uniform 30-bit word drawn from
the stream's own generator, :mod:`mpflow.operators.rng`). A digitally shifted net is still a net, and each shifted
point is uniform on [0, 1)² (Dick & Pillichshammer 2010, *Digital nets and sequences*, Lemma 4.29), so the
estimates stay unbiased, every draw is reproducible per stream and a restored snapshot draws on as the original
would. ``RANDOMISATIONS`` names the alternative, a Cranley–Patterson rotation u ← (u + s) mod 1, which does not keep
the net's stratification: on the same run (``smc``, N = 256, 16 seeds) the total's sd was 0.259 with it against
0.093 with the digital shift.
"""

from __future__ import annotations

import functools

import torch
from mpflow.operators.rng import Generators, rand

#: the bits of a Sobol' coordinate (torch's ``SobolEngine.MAXBIT``)
BITS = 30
#: the seed of the one scrambling of each cached point set (fixed: the per-stream randomisation is the shift)
SCRAMBLE_SEED = 20150401
#: how the cached point set is randomised per stream and step
RANDOMISATIONS = ("digital_shift", "rotation")
#: the largest N whose point set is cached (N × 2 int64: 1 MiB at 65536)
CACHED_POINTS = 1 << 16


@functools.lru_cache(maxsize=16)
def _sobol_integers(n: int) -> torch.Tensor:
    """The first ``n`` points of the scrambled 2-D Sobol' sequence as integers [n, 2] in [0, 2³⁰)."""
    engine = torch.quasirandom.SobolEngine(2, scramble=True, seed=SCRAMBLE_SEED)
    return torch.round(engine.draw(n, dtype=torch.float64) * (1 << BITS)).to(torch.int64)


def sobol_integers(n: int) -> torch.Tensor:
    """:func:`_sobol_integers`, cached for n ≤ :data:`CACHED_POINTS`."""
    return _sobol_integers(n) if n <= CACHED_POINTS else _sobol_integers.__wrapped__(n)


def points(gens: Generators, n: int, per_stream: int = 1, randomisation: str = "digital_shift") -> torch.Tensor:
    """``n`` randomised QMC points for each of ``per_stream`` one-dimensional problems of each stream, [B·k, n, 2]
    float64 in (0, 1) (row b·k + j: problem j of stream b): the cached scrambled Sobol' set shifted by a draw of
    stream b's own generator (module docstring), one uniform pair per row, all of a stream's in one draw."""
    base = sobol_integers(n)
    shift = rand(gens, [per_stream, 2], torch.float64).reshape(-1, 2)  # [B·k, 2]
    scale = float(1 << BITS)
    if randomisation == "digital_shift":
        words = (shift * scale).to(torch.int64).clamp_max((1 << BITS) - 1)
        return (torch.bitwise_xor(base[None], words[:, None]).to(torch.float64) + 0.5) / scale
    if randomisation == "rotation":
        u = torch.remainder((base[None].to(torch.float64) + 0.5) / scale + shift[:, None], 1.0)
        return u.clamp(0.5 / scale, 1 - 0.5 / scale)
    raise ValueError(f"randomisation: one of {RANDOMISATIONS}, got {randomisation!r}")


def replicated_points(gens: Generators, n: int, per_stream: int = 1, replicates: int = 1) -> torch.Tensor:
    """:func:`points` as ``replicates`` independently shifted point sets of ⌈n / r⌉ points each, concatenated and cut
    to ``n`` [B·k, n, 2]: the first n / r points of the set are then independent of the rest (independent replicates
    of randomised QMC, Owen 1997), which an estimate fitted on one block and applied to another needs."""
    if replicates == 1:
        return points(gens, n, per_stream)
    m = -(-n // replicates)
    u = points(gens, m, per_stream * replicates)  # rows (b·k + j)·r + i: replicate i of problem j of stream b
    return u.reshape(-1, replicates * m, 2)[:, :n]


def resample(x: torch.Tensor, log_weights: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    """Steps 1–3 of the module docstring: the ancestor indices [B, M] (into x's own order) of the uniforms
    ``u1`` [B, M] under the weighted one-dimensional cloud x [B, N] with ``log_weights`` [B, N]. Uniforms with one
    point in each cell [j/N, (j+1)/N) (:func:`one_per_cell`) are inverted in O(N) (:func:`_inverse_one_per_cell`),
    any others by binary search."""
    order = torch.argsort(x, dim=-1)
    w = torch.softmax(torch.gather(log_weights.to(torch.float64), 1, order), -1)
    cdf = torch.cumsum(w, -1)
    cdf = cdf / cdf[:, -1:]  # the last entry exactly 1
    cells = one_per_cell(u1, x.shape[1])
    if cells is not None:
        k = _inverse_one_per_cell(cdf, u1, cells)
    else:
        k = torch.searchsorted(cdf, u1.contiguous(), right=True)
    return torch.gather(order, 1, k.clamp_max(x.shape[1] - 1))


def one_per_cell(u1: torch.Tensor, n: int) -> torch.Tensor | None:
    """The cell ⌊n u⌋ of each of the uniforms ``u1`` [B, n] when every row has exactly one point in each of the n
    cells [j/n, (j+1)/n), else None. The first 2^m points of a (scrambled, digitally shifted) Sobol' sequence are a
    (0, m, 1)-net in each coordinate (Dick & Pillichshammer 2010, Def. 4.1), so a power-of-two N has the property;
    so does the lattice (j + v)/N of :func:`sorted_systematic`."""
    if u1.shape[-1] != n:
        return None
    cells = torch.floor(u1 * n).to(torch.int64).clamp(0, n - 1)
    occupied = torch.zeros_like(cells).scatter_add_(1, cells, torch.ones_like(cells))
    return cells if bool((occupied == 1).all()) else None


def _inverse_one_per_cell(cdf: torch.Tensor, u1: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """``searchsorted(cdf, u1, right=True)`` — for each point, #{k : W_k ≤ u} — in O(N) for one point per cell.

    With the points in increasing order u_(0) < … < u_(n−1) (u_(j) the point of cell j), the number of points below
    W_k is c_k = ⌊n W_k⌋ + [u_(⌊n W_k⌋) < W_k] (every cell below ⌊n W_k⌋ lies below W_k, and its own cell's point
    may), and W_k ≤ u_(j) ⟺ c_k ≤ j. So #{k : W_k ≤ u_(j)} = #{k : c_k ≤ j}, a cumulative count of the c_k."""
    b, n = u1.shape
    point_of_cell = torch.empty_like(cells).scatter_(1, cells, torch.arange(n).expand(b, n))
    in_order = torch.gather(u1, 1, point_of_cell)
    c = torch.floor(cdf * n).to(torch.int64).clamp_max(n)
    below = c + ((c < n) & (torch.gather(in_order, 1, c.clamp_max(n - 1)) < cdf)).to(torch.int64)
    counts = torch.zeros(b, n + 1, dtype=torch.int64).scatter_add_(1, below, torch.ones_like(below))
    k_in_order = torch.cumsum(counts, -1)[:, :n]
    return torch.empty_like(cells).scatter_(1, point_of_cell, k_in_order)


def resample_move(
    x: torch.Tensor, log_weights: torch.Tensor, u: torch.Tensor, move
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SQMC step (module docstring) of a one-dimensional cloud x [B, N, 1] with ``log_weights`` [B, N] and the
    points u [B, N, 2]: ``move(x_ancestors [B, N, 1], z [B, N, 1])`` applies the transition to the standard-normal
    noise z. Returns (x' [B, N, 1], ancestor indices [B, N]), moved particle n from point n — the points need not
    be sorted by u_n1 (the inverse CDF pairs each with its ancestor whatever their order), so the moved particles
    keep the point set's order, in which each block of 2^k consecutive Sobol' points is itself a net."""
    ancestors = resample(x[..., 0], log_weights, u[..., 0])
    parents = torch.gather(x, 1, ancestors[..., None])
    z = torch.special.ndtri(u[..., 1:]).to(x.dtype)
    return move(parents, z), ancestors


def sorted_systematic(x: torch.Tensor, log_weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The weighted one-dimensional clouds x [R, N, 1] (``log_weights`` [R, N]) resampled to N uniformly weighted
    particles by systematic resampling of the *sorted* cloud, u_n = (n + v)/N with v [R] uniform: in one dimension
    the copies then follow the weight CDF along the line, one per 1/N of its mass (Gerber & Chopin 2015 §4.1 with
    the points of a one-dimensional lattice). Returns them in increasing order."""
    n = x.shape[1]
    u = (torch.arange(n, dtype=torch.float64)[None] + v.to(torch.float64)[:, None]) / n
    return torch.gather(x, 1, resample(x[..., 0], log_weights, u)[..., None])
