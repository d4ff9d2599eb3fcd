"""``benchmarks/service_load.py --cluster`` with the server's defaults (:mod:`tests.harness.load`): the load
generator's cluster store starts a real local Redis Cluster, a server started without ``--workers`` (as ``make
serve`` starts it) serves a short cell on it without errors, and the number of workers it started, read off its
log, is the server's default (:func:`mpflow.cli.serve.default_workers`).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mpflow.cli.serve import default_workers
from tests.harness import load as sl
from tests.harness.cluster import cluster_binaries


@pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server >= 7 and redis-cli")
def test_a_cell_on_a_local_cluster_with_the_servers_default_workers(tmp_path) -> None:
    with sl.choose_store("cluster", "") as store:
        assert store.label.startswith("local Redis Cluster, 3 primaries + 3 replicas")
        with sl.server(store, True, tmp_path, workers=None) as url:
            row = asyncio.run(sl.run_cell(url, "mpf", 64, 4, warmup_s=0.2, window_s=0.5))
            # every worker logs its start once it has imported the app; the first one ready may be ahead of others
            log, deadline = sl.server_log(tmp_path, True), time.monotonic() + 60
            while sl.started_workers(log) < default_workers() and time.monotonic() < deadline:
                time.sleep(0.2)
    assert row["errors"] == {}
    assert row["completed"] >= sl.MIN_COMPLETIONS
    assert sl.started_workers(log) == default_workers()
