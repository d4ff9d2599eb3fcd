"""Unit tests of ParticleState: safetensors serialisation (exact, no pickle) and batching.

Every registered updater's state is round-tripped at step 0 and after an update, with its extras and its
generator state; the restored state must continue exactly as the original would.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from operators.models import make_model
from operators.models.priors import GaussianMixture, prior_from_spec
from operators.rng import generator
from operators.state import FORMAT, ParticleState
from operators.updaters import UPDATERS, get_updater

#: options keeping the iterative methods quick on tiny clouds (only keys the method declares are used)
FAST = {"max_iters": 20, "inner_steps": 10}

N, D = 16, 2


def updater(name: str):
    cls = UPDATERS[name]
    return get_updater(name, **{k: v for k, v in FAST.items() if k in cls.defaults})


def setup(name: str, B: int = 1):
    """A linear_gaussian d = 2 model (every method supports it), a Gaussian prior, B streams."""
    model = make_model("linear_gaussian", {"R": [[1.0, 0.2], [0.2, 0.5]]}, D)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.5, -0.5], "cov": [[1.0, 0.3], [0.3, 2.0]]}, D)
    if B > 1:
        prior = GaussianMixture.stack([prior] * B)
        model = type(model).stack([model] * B)
    u = updater(name)
    state = u.init(prior, model, N, seed=list(range(10, 10 + B)))
    return u, model, state


def obs_for(B: int, m: int) -> torch.Tensor:
    return torch.tensor([[0.3 + m, -1.0 + 0.5 * m]] * B) + 0.1 * torch.arange(B, dtype=torch.float32)[:, None]


def assert_states_equal(a: ParticleState, b: ParticleState) -> None:
    fa, fb = a._fields(), b._fields()
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        assert fa[k].shape == fb[k].shape, k
        assert torch.equal(fa[k], fb[k]), k


def parse_safetensors(data: bytes) -> dict:
    """The safetensors layout: u64 little-endian header length n, n bytes of JSON, then raw data."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    body = len(data) - 8 - n
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    assert max(ends) == body  # the header describes every byte that follows: nothing else is stored
    return header


@pytest.mark.parametrize("name", sorted(UPDATERS))
def test_round_trip_is_exact(name):
    u, model, state = setup(name)
    states = [state]
    for m in range(2):
        state, _ = u.update(state, obs_for(1, m), model)
        states.append(state)
    for s in states:
        data = s.to_bytes()
        assert isinstance(data, bytes)
        back = ParticleState.from_bytes(data)
        assert_states_equal(back, s)
        assert back.extras.keys() == s.extras.keys()
        assert (back.log_density is None) == (s.log_density is None)
    # kalman keeps the exact moments in extras; the flow methods the step-0 prior mixture
    if name == "kalman":
        assert {"mean", "cov"} <= set(states[-1].extras)
        assert states[-1].extras["cov"].dtype == torch.float64


@pytest.mark.parametrize("name", sorted(UPDATERS))
def test_restored_state_continues_identically(name):
    """The generator state travels with the particles: a restored stream draws the same noise."""
    u, model, state = setup(name)
    state, _ = u.update(state, obs_for(1, 0), model)
    restored = ParticleState.from_bytes(state.to_bytes())
    a, info_a = u.update(state, obs_for(1, 1), model)
    b, info_b = u.update(restored, obs_for(1, 1), model)
    assert_states_equal(a, b)
    assert torch.equal(info_a.log_evidence_increment, info_b.log_evidence_increment)


@pytest.mark.parametrize("name", sorted(UPDATERS))
def test_bytes_are_safetensors_not_pickle(name):
    u, model, state = setup(name)
    state, _ = u.update(state, obs_for(1, 0), model)
    data = state.to_bytes()
    assert not data.startswith(b"\x80")  # a pickle stream starts with the PROTO opcode
    header = parse_safetensors(data)
    assert header["__metadata__"] == {"format": FORMAT}
    fields = {k for k in header if k != "__metadata__"}
    assert fields == set(state._fields())
    for k, t in state._fields().items():
        assert header[k]["shape"] == list(t.shape)
    assert header["particles"]["dtype"] == "F32"
    assert header["log_evidence"]["dtype"] == "F64"
    assert header["rng"]["dtype"] == "U8"


def test_extras_and_log_density_round_trip():
    """Optional fields survive: log_density and arbitrary named extras of any dtype."""
    g = generator(0)
    s = ParticleState(
        particles=torch.randn(1, 5, 3, generator=g),
        log_weights=torch.log_softmax(torch.randn(1, 5, generator=g), -1),
        step=torch.tensor([7]),
        log_evidence=torch.tensor([-12.5], dtype=torch.float64),
        rng=g.get_state()[None],
        log_density=torch.randn(1, 5, generator=g),
        extras={"a": torch.randn(1, 3, 3, dtype=torch.float64, generator=g), "flag": torch.tensor([True])},
    )
    back = ParticleState.from_bytes(s.to_bytes())
    assert_states_equal(back, s)
    assert back.extras.keys() == {"a", "flag"}


def test_stack_unbind_round_trip():
    u, model, state = setup("smc", B=3)
    state, _ = u.update(state, obs_for(3, 0), model)
    parts = state.unbind()
    assert len(parts) == 3 and all(p.batch_size == 1 for p in parts)
    for b, p in enumerate(parts):
        assert torch.equal(p.particles[0], state.particles[b])
        assert torch.equal(p.rng[0], state.rng[b])
    assert_states_equal(ParticleState.stack(parts), state)
    # single streams serialise; a restored batch equals the original
    restored = ParticleState.stack([ParticleState.from_bytes(p.to_bytes()) for p in parts])
    assert_states_equal(restored, state)


def test_to_bytes_needs_one_stream():
    _, _, state = setup("smc", B=2)
    with pytest.raises(ValueError):
        state.to_bytes()


def test_stack_rejects_different_fields():
    _, _, kal = setup("kalman")
    _, _, smc = setup("smc")
    with pytest.raises(ValueError):
        ParticleState.stack([kal, smc])
