"""operators.registry: on-disk format of trained operators and samplers (docs/DESIGN.md "Trained operators")."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from mpflow.operators import registry
from mpflow.operators.registry import (
    PRETRAINED_DIR,
    RegistryWarning,
    default_dirs,
    list_operators,
    load_record,
    load_weights,
    resolve,
    save_operator,
)
from mpflow.operators.samplers.gpvi import GPVIGenerator

README = "Trained by: `mpflow train --family lds --state-dim 2 --seed 0`\n"


def _config(family: str = "lds", d: int = 2, **extra) -> dict:
    return {
        "family": family,
        "state_dim": d,
        "obs_dim": 1,
        "architecture": {"type": "mlp", "hidden": [8, 8]},
        "tasks": {"prior_std": [0.5, 2.0], "steps": 10},
        "solver": {"method": "rk4", "T": 1.0},
        **extra,
    }


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "net.0.weight": torch.randn(8, 3, generator=g),
        "net.0.bias": torch.randn(8, generator=g, dtype=torch.float64),
        "net.2.weight": torch.randn(3, 8, generator=g).T,  # non-contiguous on purpose
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _save(root: Path, name: str | None = "lds-d2-v1", seed: int = 0, **cfg) -> registry.OperatorRecord:
    metrics = {"w2_heldout": 0.01 * (seed + 1)}
    return save_operator(root, name, _config(**cfg), _weights(seed), metrics, README)


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_round_trip_is_exact(tmp_path):
    cfg, w = _config(), _weights()
    rec = save_operator(tmp_path, "lds-d2-v1", cfg, w, {"w2_heldout": 0.0123, "n_tasks": 64}, README)
    assert "created" not in cfg  # caller's dict untouched
    again = load_record(tmp_path / "lds-d2-v1")
    assert again == rec
    got = (rec.name, rec.kind, rec.family, rec.state_dim, rec.obs_dim, rec.version)
    assert got == ("lds-d2-v1", "operator", "lds", 2, 1, 1)
    assert {k: v for k, v in rec.config.items() if k != "created"} == cfg
    assert rec.created == rec.config["created"]
    assert rec.metrics == {"w2_heldout": 0.0123, "n_tasks": 64}
    assert (rec.path / "README.md").read_text() == README
    loaded = load_weights(rec)
    assert set(loaded) == set(w)
    for k, v in w.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    summary = rec.to_json()
    assert json.loads(json.dumps(summary)) == summary
    assert {"name", "family", "state_dim", "obs_dim", "metrics", "created", "content_hash"} <= set(summary)
    assert "path" not in summary


def test_content_hash_is_the_documented_sha256_and_stable(tmp_path):
    created = {"created": "2025-01-01T00:00:00+00:00"}
    a = _save(tmp_path / "a", **created)
    cfg = {k: v for k, v in a.config.items() if k != "created"}
    body = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    expect = hashlib.sha256(body + b"\x00" + (a.path / "weights.safetensors").read_bytes()).hexdigest()
    assert a.content_hash == expect
    # same content, another folder and another date → same hash
    b = _save(tmp_path / "b", created="2030-06-01T12:00:00+00:00")
    assert b.content_hash == a.content_hash
    # one weight moved by one ulp → different hash
    w = _weights()
    w["net.0.weight"][0, 0] = torch.nextafter(w["net.0.weight"][0, 0], torch.tensor(1e9))
    c = save_operator(tmp_path / "c", "lds-d2-v1", _config(**created), w, {}, README)
    assert c.content_hash != a.content_hash
    # any config value changed → different hash
    d = _save(tmp_path / "d", solver={"method": "rk4", "T": 1.0000001}, **created)
    assert d.content_hash != a.content_hash
    # a byte flipped in the weights file on disk → different hash (same length, header intact)
    data = bytearray((a.path / "weights.safetensors").read_bytes())
    data[-1] ^= 0x01
    (a.path / "weights.safetensors").write_bytes(bytes(data))
    assert load_record(a.path).content_hash != b.content_hash


def test_auto_versioning_and_name_checks(tmp_path):
    assert _save(tmp_path, None).name == "lds-d2-v1"
    assert _save(tmp_path, None).name == "lds-d2-v2"
    assert _save(tmp_path, None, d=3).name == "lds-d3-v1"
    _save(tmp_path, "lds-d2-v7")
    assert _save(tmp_path, None).version == 8  # versions are never reused
    with pytest.raises(ValueError, match=r"^name: .*must match"):
        _save(tmp_path, "LDS-2")
    # a family name may hold digits (lorenz96), not start with one
    assert _save(tmp_path, None, family="lorenz96", d=10).name == "lorenz96-d10-v1"
    assert registry.load_record(tmp_path / "lorenz96-d10-v1").family == "lorenz96"
    with pytest.raises(ValueError, match=r"^config.family: .*digits"):
        _save(tmp_path, None, family="96lorenz")
    with pytest.raises(ValueError, match=r"^name: .*disagrees"):
        _save(tmp_path, "gmm-d2-v1")
    with pytest.raises(ValueError, match=r"^config.architecture: required"):
        save_operator(tmp_path, None, {"family": "lds", "state_dim": 2, "obs_dim": 1}, _weights(), {}, README)
    with pytest.raises(ValueError, match=r"^config.state_dim"):
        _save(tmp_path, None, d=0)
    with pytest.raises(ValueError, match=r"^metrics: .*JSON"):
        save_operator(tmp_path, None, _config(), _weights(), {"err": float("nan")}, README)
    with pytest.raises(ValueError, match=r"^readme"):
        save_operator(tmp_path, None, _config(), _weights(), {}, "  ")


def test_overwrite_refused_unless_asked(tmp_path):
    first = _save(tmp_path, seed=0)
    with pytest.raises(FileExistsError, match=r"^name: "):
        _save(tmp_path, seed=1)
    assert load_record(first.path).content_hash == first.content_hash
    second = save_operator(tmp_path, "lds-d2-v1", _config(), _weights(1), {}, README, overwrite=True)
    assert second.content_hash != first.content_hash
    assert load_record(tmp_path / "lds-d2-v1").content_hash == second.content_hash
    assert _listing(tmp_path) == ["lds-d2-v1"]  # no temp or old folder left


def _failing_writer(state_dict, path):
    path.write_bytes(b"\x08\x00\x00")  # half a file, then the crash
    raise OSError("disk full (simulated)")


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_write_weights", _failing_writer)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path / "root")
    assert _listing(tmp_path / "root") == []
    monkeypatch.undo()
    # a failed overwrite keeps the previous version
    old = _save(tmp_path / "root")
    monkeypatch.setattr(registry, "_write_weights", _failing_writer)
    with pytest.raises(OSError, match="simulated"):
        save_operator(tmp_path / "root", "lds-d2-v1", _config(), _weights(1), {}, README, overwrite=True)
    assert _listing(tmp_path / "root") == ["lds-d2-v1"]
    assert load_record(old.path).content_hash == old.content_hash
    monkeypatch.undo()
    # a crash after the old version was moved aside, before the new one is renamed in: old one put back

    def failing_rename(src, dst):
        raise OSError("crash during rename (simulated)")

    monkeypatch.setattr(registry.os, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        save_operator(tmp_path / "root", "lds-d2-v1", _config(), _weights(1), {}, README, overwrite=True)
    monkeypatch.undo()
    assert _listing(tmp_path / "root") == ["lds-d2-v1"]
    assert load_record(old.path).content_hash == old.content_hash


def test_load_record_reports_path_and_problem(tmp_path):
    rec = _save(tmp_path)
    (rec.path / "metrics.json").unlink()
    with pytest.raises(ValueError, match=rf"^path: {re.escape(str(rec.path))} is missing \['metrics.json'\]"):
        load_record(rec.path)
    rec = _save(tmp_path, "lds-d2-v2")
    (rec.path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"^path: {re.escape(str(rec.path))}.*not valid JSON"):
        load_record(rec.path)
    rec = _save(tmp_path, "lds-d2-v3")
    data = (rec.path / "weights.safetensors").read_bytes()
    (rec.path / "weights.safetensors").write_bytes(data[:-4])  # truncated
    with pytest.raises(ValueError, match=rf"^path: {re.escape(str(rec.path))}: weights.safetensors: corrupt"):
        load_record(rec.path)


def test_list_operators_skips_corrupt_and_first_dir_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    lds_a = _save(a, seed=0)
    bad = _save(a, "lds-d2-v2")
    (bad.path / "weights.safetensors").write_bytes(b"garbage")
    (a / "notes").mkdir()  # not an operator name
    (a / ".tmp-lds-d2-v9-x").mkdir()  # an interrupted save: ignored silently
    lds_b = _save(b, seed=1)
    gmm_b = _save(b, "gmm-d2-v1", family="gmm")
    with pytest.warns(RegistryWarning) as caught:
        recs = list_operators([a, b, tmp_path / "missing"])
    assert [r.name for r in recs] == ["gmm-d2-v1", "lds-d2-v1"]
    assert recs[1].path == lds_a.path and recs[1].content_hash != lds_b.content_hash
    assert recs[0].content_hash == gmm_b.content_hash
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4, messages
    assert any(str(bad.path) in m and "corrupt" in m for m in messages)
    assert any(str(a / "notes") in m for m in messages)
    assert any("shadowed" in m and str(lds_b.path) in m for m in messages)
    assert any("missing" in m and "does not exist" in m for m in messages)


def test_default_dirs_and_resolve(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, "lds-d2-v901")
    _save(b, "gmm-d2-v901", family="gmm")  # versions no shipped operator has
    monkeypatch.setenv("MPFLOW_OPERATOR_DIRS", os.pathsep.join([str(a), str(tmp_path / "nope"), "", str(b)]))
    assert default_dirs() == [PRETRAINED_DIR, a, b]
    monkeypatch.delenv("MPFLOW_OPERATOR_DIRS")
    assert default_dirs() == [PRETRAINED_DIR]
    monkeypatch.setenv("MPFLOW_OPERATOR_DIRS", f"{a}{os.pathsep}{b}")
    assert resolve("gmm-d2-v901").path == b / "gmm-d2-v901"  # default dirs
    assert resolve("lds-d2-v901", dirs=[a]).family == "lds"
    assert resolve(b / "gmm-d2-v901").name == "gmm-d2-v901"  # a path
    assert resolve(str(a / "lds-d2-v901")).name == "lds-d2-v901"
    with pytest.raises(ValueError, match=r"^operator: unknown operator 'x'; available: \['lds-d2-v901'\]"):
        resolve("x", dirs=[a])
    with pytest.raises(ValueError, match=r"^path: "):
        resolve(tmp_path / "nope")


def test_gpvi_generator_is_listed_as_sampler(tmp_path):
    gen = GPVIGenerator(2, hidden=[4], helper_hidden=[4], generator=torch.Generator().manual_seed(3))
    gen.save(tmp_path / "samplers" / "gpvi-d2-v1")
    gen.save(tmp_path / "samplers" / "my-prior")  # not <family>-d<d>-v<k>: skipped and reported
    _save(tmp_path)
    with pytest.warns(RegistryWarning, match="my-prior"):
        recs = list_operators([tmp_path])
    assert [(r.name, r.kind) for r in recs] == [("gpvi-d2-v1", "sampler"), ("lds-d2-v1", "operator")]
    s = recs[0]
    assert (s.family, s.state_dim, s.obs_dim, s.version, s.metrics) == ("gpvi", 2, 0, 1, {})
    assert s.config["kind"] == "gpvi" and "family" not in s.config  # mapping, the file is not rewritten
    weights = load_weights(s)
    assert all(torch.equal(weights[k], v) for k, v in gen.state_dict().items())
    z = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(GPVIGenerator.load(s.path)(z), gen(z))
    # samplers written through the registry land under samplers/ with kind "sampler"
    cfg = {"family": "gpvi", "state_dim": 2, "obs_dim": 0, "architecture": "gpvi"}
    rec = save_operator(tmp_path / "other" / "samplers", None, cfg, gen.state_dict(), {}, README)
    assert (rec.name, rec.kind) == ("gpvi-d2-v1", "sampler")


def test_packaged_pretrained_folders_load_and_fit_the_size_limit():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegistryWarning)
        recs = list_operators([PRETRAINED_DIR])
    for rec in recs:
        size = sum(f.stat().st_size for f in rec.path.rglob("*") if f.is_file())
        assert size <= 5 * 1024 * 1024, (rec.name, size)
