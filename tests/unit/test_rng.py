"""The streams' counter-based generators (mpflow.operators.rng)."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import rng
from scipy import stats


def test_state_is_a_key_and_a_counter() -> None:
    gens = rng.StreamRNG.from_seeds([0, 1, 2**63 - 1])
    state = rng.generators_state(gens)
    assert state.dtype == torch.int64 and state.shape == (3, 2)
    assert state.element_size() * state[0].numel() == 16  # bytes per stream
    assert torch.equal(state[:, 1], torch.zeros(3, dtype=torch.int64))
    rng.randn(gens, [4])
    assert torch.equal(rng.generators_state(gens)[:, 1], torch.ones(3, dtype=torch.int64))
    restored = rng.generators_from_state(rng.generators_state(gens))
    assert torch.equal(rng.randn(restored, [5]), rng.randn(gens, [5]))  # the state is all there is


def test_a_stream_draws_the_same_alone_batched_or_as_a_row() -> None:
    batch, alone = rng.StreamRNG.from_seeds([5, 6, 7]), rng.StreamRNG.from_seeds([6])
    assert torch.equal(rng.randn(batch, [10])[1], rng.randn(alone, [10])[0])
    # rows of a batch draw as their streams, and only their counters move
    assert torch.equal(rng.rand([batch[1]], [3])[0], rng.rand(alone, [3])[0])
    assert rng.generators_state(batch)[:, 1].tolist() == [1, 2, 1]


def test_streams_and_draws_differ_and_look_uniform() -> None:
    gens = rng.StreamRNG.from_seeds([1, 2])
    first, second = rng.rand(gens, [50_000], torch.float64), rng.rand(gens, [50_000], torch.float64)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], second[0])
    for u in (first[0], first[1], second[0]):
        assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert abs(float(torch.corrcoef(torch.stack([first[0], first[1]]))[0, 1])) < 0.02
    z = rng.randn(gens, [100_000], torch.float64)
    assert stats.kstest(z[0].numpy(), "norm").pvalue > 1e-3


def test_torch_generators_still_draw_stream_by_stream() -> None:
    a = rng.randn([rng.generator(3), rng.generator(4)], [6])
    assert torch.equal(a[0], torch.randn(6, generator=rng.generator(3)))
    g = rng.generator(9)
    assert rng.torch_generator(g) is g


def test_a_bad_stored_state_is_refused() -> None:
    with pytest.raises(ValueError, match="rng"):
        rng.generators_from_state(torch.zeros(2, 5056, dtype=torch.uint8))


def test_draws_are_made_on_the_cpu_and_placed_on_the_default_device():
    """Meta-training runs under ``torch.device("cuda")``: each stream's draw is still made by its CPU generator
    (the same numbers on every device) and lands on the default device (here "meta", which any machine has)."""
    from mpflow.operators.rng import generator, rand, randn

    expected = randn([generator(3), generator(4)], [5])
    with torch.device("meta"):
        assert randn([generator(3), generator(4)], [5]).device.type == "meta"
        assert rand([generator(3)], [2]).device.type == "meta"
    assert torch.equal(randn([generator(3), generator(4)], [5]), expected)
