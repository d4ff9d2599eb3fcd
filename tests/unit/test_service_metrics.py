"""service.metrics without multiprocess mode (one worker, tests: a registry per app) and the metrics directory
``mpflow.cli.serve.serve`` makes for several workers (:func:`mpflow.cli.serve.shared_metrics_dir`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from mpflow.service.api.metrics import MULTIPROC_ENV, Metrics
from prometheus_client.parser import text_string_to_metric_families

from mpflow.cli.serve import shared_metrics_dir


def values(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) → value of ``metrics.render()``."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_without_multiproc_dir_render_their_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    a, b = Metrics(), Metrics()
    assert a.multiprocess_dir is None
    a.observe_batch("smc", "linear_gaussian", 3, 0.01)
    a.observe_batch("smc", "linear_gaussian", 2, 0.02)
    a.observe_request("/v1/streams", "POST", 201, 0.005)
    a.streams.set(7)
    b.observe_batch("kalman", "lds", 5, 0.5)
    got, other = values(a), values(b)
    assert got[("mpflow_updates_total", (("family", "linear_gaussian"), ("method", "smc")))] == 5
    assert got[("mpflow_batch_size_sum", ())] == 5 and got[("mpflow_batch_size_count", ())] == 2
    assert got[("mpflow_update_duration_seconds_count", (("method", "smc"),))] == 2
    assert got[("mpflow_http_requests_total", (("method", "POST"), ("route", "/v1/streams"), ("status", "201")))] == 1
    assert got[("mpflow_streams", ())] == 7
    # apps in one process do not share counts
    assert not any(name == "mpflow_updates_total" and dict(labels)["method"] == "kalman" for name, labels in got)
    assert other[("mpflow_updates_total", (("family", "lds"), ("method", "kalman")))] == 5
    assert other[("mpflow_batch_size_sum", ())] == 5 and other[("mpflow_streams", ())] == 0


def test_health_counts_the_rescued_streams_and_the_move_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    m = Metrics()
    ess = torch.tensor([0.5, 0.9, 1.0])
    m.observe_health("mpf", ess, {"rescued": torch.tensor([True, False, True]), "flow_fraction": torch.zeros(3)})
    m.observe_health("mpf", ess, {"rescued": torch.tensor([False, False, False])})
    m.observe_health("mpf", ess[:1], {"acceptance": torch.tensor([0.55])})
    m.observe_health("smc", ess)
    got = values(m)
    assert got[("mpflow_update_rescues_total", (("method", "mpf"),))] == 2
    assert ("mpflow_update_rescues_total", (("method", "smc"),)) not in got
    assert got[("mpflow_update_ess_fraction_count", (("method", "mpf"),))] == 7
    assert got[("mpflow_update_move_acceptance_count", (("method", "mpf"),))] == 1


def test_multiproc_dir_set_after_import_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # prometheus_client was imported without it: this process's samples would never reach the files
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=MULTIPROC_ENV):
        Metrics()


def test_one_worker_uses_no_metrics_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    with shared_metrics_dir(1) as path:
        assert path is None and MULTIPROC_ENV not in os.environ


def test_workers_get_a_private_dir_removed_afterwards(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    with shared_metrics_dir(2) as path:
        assert path is not None and os.environ[MULTIPROC_ENV] == path
        made = Path(path)
        assert made.is_dir() and made.parent == tmp_path and made.name.startswith("mpflow-metrics-")
        (made / "counter_1.db").write_bytes(b"x")  # the workers' files go with it
    assert not made.exists() and MULTIPROC_ENV not in os.environ
    with pytest.raises(KeyError), shared_metrics_dir(3) as path:  # removed when serving fails too
        raise KeyError(path)
    assert not Path(path).exists() and MULTIPROC_ENV not in os.environ


def test_a_users_metrics_dir_is_used_and_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    for workers in (1, 2):
        with shared_metrics_dir(workers) as path:
            assert path == str(tmp_path)
        assert tmp_path.is_dir() and os.environ[MULTIPROC_ENV] == str(tmp_path)
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="not a directory"), shared_metrics_dir(2):
        pass
