"""``mpflow serve``'s default worker count: one per usable CPU core, capped; ``MPFLOW_WORKERS`` and ``--workers``
win; a count below 1 is refused with the setting named."""

from __future__ import annotations

import argparse

import pytest

from mpflow.cli import serve


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 2), (6, 6), (64, serve.MAX_DEFAULT_WORKERS)])
def test_default_is_one_worker_per_usable_core_capped(monkeypatch, cores, want):
    monkeypatch.delenv("MPFLOW_WORKERS", raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(serve.Path, "read_text", lambda self: "max 100000\n")  # no cgroup CPU quota
    assert serve.default_workers() == want


def test_a_cgroup_cpu_quota_bounds_the_default(monkeypatch):
    monkeypatch.delenv("MPFLOW_WORKERS", raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(serve.Path, "read_text", lambda self: "250000 100000\n")  # --cpus 2.5
    assert serve.usable_cpus() == 3 and serve.default_workers() == 3


def test_the_environment_and_the_flag_win(monkeypatch):
    monkeypatch.setenv("MPFLOW_WORKERS", "3")
    assert serve.default_workers() == 3
    parser = argparse.ArgumentParser()
    serve._add_arguments(parser)
    assert parser.parse_args(["--workers", "5"]).workers == 5
    assert parser.parse_args([]).workers is None  # decided at start: the default above
    with pytest.raises(SystemExit):
        parser.parse_args(["--workers", "0"])
    monkeypatch.setenv("MPFLOW_WORKERS", "none")
    with pytest.raises(argparse.ArgumentTypeError, match="workers"):
        serve.default_workers()
