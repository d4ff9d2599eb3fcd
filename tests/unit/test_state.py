"""Unit tests of ParticleState: safetensors serialisation (exact, no pickle) and batching.

Every registered updater's state is round-tripped at step 0 and after an update, with its extras and its
generator state; the restored state must continue exactly as the original would.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture, prior_from_spec
from mpflow.operators.rng import generator
from mpflow.operators.state import FORMAT, ParticleState
from mpflow.operators.updaters import UPDATERS, get_updater
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

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
    assert header["rng"]["dtype"] == "I64" and header["rng"]["shape"] == [1, 2]  # (key, counter)


def test_extras_and_log_density_round_trip():
    """Optional fields survive: log_density and arbitrary named extras of any dtype."""
    g = generator(0)
    s = ParticleState(
        particles=torch.randn(1, 5, 3, generator=g),
        log_weights=torch.log_softmax(torch.randn(1, 5, generator=g), -1),
        step=torch.tensor([7]),
        log_evidence=torch.tensor([-12.5], dtype=torch.float64),
        rng=torch.tensor([[123456789, 4]]),
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


# ---------------------------------------------------------------- the on-disk format across implementations
#: a state as the first writer (``safetensors.torch.save(fields, metadata={"format": FORMAT})``) stored it
#: in Redis: particles/log_weights/log_density float32, step int64, log_evidence and extras.cov float64, rng u8
OLD_WRITER_HEX = (
    "f0010000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a226d70666c6f772d73746174652d7631"
    "227d2c2273746570223a7b226474797065223a22493634222c227368617065223a5b315d2c22646174615f6f666673657473"
    "223a5b302c385d7d2c226578747261732e636f76223a7b226474797065223a22463634222c227368617065223a5b312c322c"
    "325d2c22646174615f6f666673657473223a5b382c34305d7d2c226c6f675f65766964656e6365223a7b226474797065223a"
    "22463634222c227368617065223a5b315d2c22646174615f6f666673657473223a5b34302c34385d7d2c226c6f675f64656e"
    "73697479223a7b226474797065223a22463332222c227368617065223a5b312c335d2c22646174615f6f666673657473223a"
    "5b34382c36305d7d2c226c6f675f77656967687473223a7b226474797065223a22463332222c227368617065223a5b312c33"
    "5d2c22646174615f6f666673657473223a5b36302c37325d7d2c227061727469636c6573223a7b226474797065223a224633"
    "32222c227368617065223a5b312c332c325d2c22646174615f6f666673657473223a5b37322c39365d7d2c22726e67223a7b"
    "226474797065223a225538222c227368617065223a5b312c345d2c22646174615f6f666673657473223a5b39362c3130305d"
    "7d7d20200300000000000000000000000000f03f9a9999999999b93f9a9999999999b93f0000000000000040000000000000"
    "1dc00000803e000000bf0000803f000080bf0000c0bf000040bf0000003f0000a0bf000000400000003e000060c000008040"
    "0102feff"
)


def old_writer_state() -> ParticleState:
    """The state OLD_WRITER_HEX holds."""
    return ParticleState(
        particles=torch.tensor([[[0.5, -1.25], [2.0, 0.125], [-3.5, 4.0]]]),
        log_weights=torch.tensor([[-1.0, -1.5, -0.75]]),
        step=torch.tensor([3]),
        log_evidence=torch.tensor([-7.25], dtype=torch.float64),
        rng=torch.tensor([[1, 2, 254, 255]], dtype=torch.uint8),
        log_density=torch.tensor([[0.25, -0.5, 1.0]]),
        extras={"cov": torch.tensor([[[1.0, 0.1], [0.1, 2.0]]], dtype=torch.float64)},
    )


def torch_save(s: ParticleState) -> bytes:
    """What the first writer stored: the library's torch entry point on the state's fields."""
    return st_save({k: v.contiguous() for k, v in s._fields().items()}, metadata={"format": FORMAT})


def rich_state(log_density: bool) -> ParticleState:
    """A state with every optional part: float64/bool/int32/zero-size/transposed extras, log_density or not."""
    g = generator(3)
    return ParticleState(
        particles=torch.randn(1, 7, 2, generator=g),
        log_weights=torch.log_softmax(torch.randn(1, 7, generator=g), -1),
        step=torch.tensor([11]),
        log_evidence=torch.tensor([-3.0625], dtype=torch.float64),
        rng=torch.tensor([[123456789, 4]]),
        log_density=torch.randn(1, 7, generator=g) if log_density else None,
        extras={
            "cov": torch.randn(1, 2, 2, dtype=torch.float64, generator=g),
            "mask": torch.tensor([[True, False, True]]),
            "counts": torch.tensor([[4, -2]], dtype=torch.int32),
            "empty": torch.zeros(1, 0, 2),
            "transposed": torch.randn(1, 3, 4, generator=g).transpose(1, 2),  # not contiguous
        },
    )


def test_old_writer_bytes_still_load():
    """Bytes stored by the first implementation (fixed here, independent of the installed library) load exactly."""
    data = bytes.fromhex(OLD_WRITER_HEX)
    back = ParticleState.from_bytes(data)
    old = old_writer_state()
    # a v1 state's Mersenne Twister bytes become a (key, counter) generator, deterministically
    assert back.rng.dtype == torch.int64 and back.rng.shape == (1, 2) and int(back.rng[0, 1]) == 0
    assert torch.equal(ParticleState.from_bytes(data).rng, back.rng)
    assert_states_equal(back, old.replace(rng=back.rng))
    assert back.log_evidence.dtype == torch.float64 and back.extras["cov"].dtype == torch.float64
    # and the writer lays them out as the first one did, byte for byte
    assert old.to_bytes({"format": "mpflow-state-v1"}) == data


@pytest.mark.parametrize("log_density", [True, False])
def test_rich_state_round_trip_is_exact(log_density):
    s = rich_state(log_density)
    back = ParticleState.from_bytes(s.to_bytes())
    assert_states_equal(back, s)
    assert (back.log_density is None) == (not log_density)
    assert back.extras.keys() == s.extras.keys()
    assert back.log_evidence.dtype == torch.float64 and back.extras["cov"].dtype == torch.float64
    assert all(v.is_contiguous() for v in back._fields().values())
    back.particles += 1.0  # restored tensors are ordinary writable tensors


@pytest.mark.parametrize("log_density", [True, False])
def test_bytes_are_those_of_safetensors_torch(log_density):
    """Both directions with the library's torch entry points: identical bytes, each reads the other's."""
    s = rich_state(log_density)
    new, old = s.to_bytes(), torch_save(s)
    assert new == old
    assert_states_equal(ParticleState._from_fields(st_load(new)), s)
    assert_states_equal(ParticleState.from_bytes(old), s)
    assert parse_safetensors(new)["__metadata__"] == {"format": FORMAT}


@pytest.mark.parametrize("name", sorted(UPDATERS))
def test_every_method_writes_library_bytes(name):
    u, model, state = setup(name)
    for s in (state, u.update(state, obs_for(1, 0), model)[0]):
        assert s.to_bytes() == torch_save(s)
        assert_states_equal(ParticleState._from_fields(st_load(s.to_bytes())), s)


def test_tensors_requiring_grad_and_dtypes_numpy_lacks():
    """A field requiring grad is written as its data; a bfloat16 extra (no numpy twin) goes through the library."""
    s = rich_state(True)
    s = s.replace(
        particles=s.particles.clone().requires_grad_(True),
        extras={**s.extras, "half": torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)},
    )
    data = s.to_bytes()
    assert data == torch_save(s.replace(particles=s.particles.detach()))
    back = ParticleState.from_bytes(data)
    assert back.extras["half"].dtype == torch.bfloat16
    assert_states_equal(back, s.replace(particles=s.particles.detach()))
