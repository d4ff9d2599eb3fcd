"""``python -m mpflow.training.param_observer_train``: a short run trains, logs, plots and registers an observer that
the ``mh`` kernel can load by name; the training windows are what the family simulates."""

from __future__ import annotations

import json

import torch
from mpflow.operators import registry
from mpflow.operators.param_observer import N_FEATURES, observer_from_record
from mpflow.training import param_observer_train


def test_a_short_run_trains_and_registers_an_observer(tmp_path):
    out, root = tmp_path / "out", tmp_path / "reg"
    argv = ["--family", "linear_gaussian", "--out", str(out), "--iterations", "30", "--pool", "512", "--val", "256",
            "--val-every", "10", "--hidden", "16", "--quiet", "--register", str(root), "--name",
            "linear_gaussian-d1-v7"]  # fmt: skip
    assert param_observer_train.main(argv) == 0
    rows = [json.loads(line) for line in (out / "observer_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 10, 20, 30]
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    assert (out / "observer_curve.png").stat().st_size > 1000
    record = registry.load_record(root / "linear_gaussian-d1-v7")
    assert record.config["architecture"]["kind"] == "param_observer" and not record.auto_select
    net = observer_from_record(record)
    mean, L = net(torch.zeros(3, N_FEATURES), torch.zeros(3, 1), torch.zeros(3))
    assert mean.shape == (3, 1) and L.shape == (3, 1, 1) and bool((L > 0).all())


def test_the_windows_are_simulated_from_the_family():
    data = param_observer_train.simulate_windows("lds", 256, torch.Generator().manual_seed(0))
    assert data["features"].shape == (256, N_FEATURES) and data["v"].shape == (256, 2)
    assert bool(torch.isfinite(data["features"]).all())
    # the window's variance carries the scale: log σ̂² tracks log(Q + R) across tasks
    corr = torch.corrcoef(torch.stack([data["log_var"], torch.logsumexp(data["v"], -1)]))[0, 1]
    assert corr > 0.6
