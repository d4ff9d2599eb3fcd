"""Exactly-once observations under concurrency, against a real Redis.

Writers are split over TWO apps (two "replicas": own engines, locks and connection pools) sharing one key prefix,
so they race through the store's compare-and-set, not only through one process's per-stream lock. The stream
runs the exact ``kalman`` method, so the final posterior and log-evidence tell whether any observation was
lost, applied twice or applied out of order: they must equal a float64 Kalman filter over the observations in
seq order.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import torch
from mpflow.operators.models import make_model
from mpflow.operators.references import kalman_filter

from tests.harness.server import drop_prefix, serve_in_process
from tests.integration.test_api_streams import settings

PARAMS = {"A": [[0.95, 0.1], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]], "R": [[0.5, 0.0], [0.0, 0.5]]}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def exact(observations: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, float]:
    model = make_model("lds", PARAMS, 2, dtype=torch.float64)
    means, covs, logz = kalman_filter(
        torch.tensor([PRIOR["mean"]], dtype=torch.float64),
        torch.tensor([PRIOR["cov"]], dtype=torch.float64),
        model,
        torch.tensor([observations], dtype=torch.float64),
    )
    return means[0, -1], covs[0, -1], float(logz[0].sum())


def check_final(doc: dict, observations: list[list[float]]) -> None:
    mean, cov, logz = exact(observations)
    s = doc["summary"]
    assert doc["step"] == len(observations)
    assert torch.allclose(torch.tensor(s["mean"], dtype=torch.float64), mean, atol=1e-6, rtol=0)
    assert torch.allclose(torch.tensor(s["cov"], dtype=torch.float64), cov, atol=1e-6, rtol=0)
    assert abs(s["log_evidence"] - logz) < 1e-6


def two_replicas(url: str, body) -> None:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    s = settings(url, prefix)

    async def main():
        try:
            async with serve_in_process(s) as (_, a), serve_in_process(s) as (_, b):
                await body(a, b)
        finally:
            await drop_prefix(url, prefix)

    asyncio.run(main())


def test_50_writers_with_seq_apply_every_batch_exactly_once(redis_url):
    batches = 25
    rng = random.Random(0)
    observations = [[round(rng.uniform(-2, 2), 3), round(rng.uniform(-2, 2), 3)] for _ in range(batches)]
    outcomes: list[str] = []

    async def writer(client: httpx.AsyncClient, seq: int) -> None:
        url = "/v1/streams/race/observations"
        for _ in range(2000):
            r = await client.post(url, json={"seq": seq, "observations": [observations[seq - 1]]})
            if r.status_code == 200:
                outcomes.append("duplicate" if r.json()["duplicate"] else "applied")
                return
            assert r.status_code == 409, r.text  # a gap (an earlier batch not yet in) or a lost race
            await asyncio.sleep(0.002)
        raise AssertionError(f"seq {seq} never got through")

    async def body(a: httpx.AsyncClient, b: httpx.AsyncClient) -> None:
        spec = {"stream_id": "race", "model": {"family": "lds", "params": PARAMS}, "prior": PRIOR}
        r = await a.post("/v1/streams", json={**spec, "method": "kalman", "num_particles": 8, "seed": 1})
        assert r.status_code == 201
        jobs = [(a if w % 2 else b, w % batches + 1) for w in range(50)]  # every batch sent twice, once per app
        rng.shuffle(jobs)
        await asyncio.gather(*(writer(c, seq) for c, seq in jobs))
        assert outcomes.count("applied") == batches and outcomes.count("duplicate") == 50 - batches
        check_final((await b.get("/v1/streams/race")).json(), observations)

    two_replicas(redis_url, body)


def test_concurrent_appends_without_seq_are_all_applied(redis_url):
    # identical observations: the order of appends cannot matter, the count must
    o = [0.5, -0.25]
    n = 20

    async def body(a: httpx.AsyncClient, b: httpx.AsyncClient) -> None:
        spec = {"stream_id": "append", "model": {"family": "lds", "params": PARAMS}, "prior": PRIOR}
        await a.post("/v1/streams", json={**spec, "method": "kalman", "num_particles": 8})
        rs = await asyncio.gather(
            *((a if i % 2 else b).post("/v1/streams/append/observations", json={"observations": [o]}) for i in range(n))
        )
        assert [r.status_code for r in rs] == [200] * n
        assert sorted(r.json()["step"] for r in rs) == list(range(1, n + 1))  # each append saw its own step
        check_final((await a.get("/v1/streams/append")).json(), [o] * n)

    two_replicas(redis_url, body)


def test_micro_batching_across_streams_keeps_answers(redis_url):
    """Concurrent updates of many streams are stacked into batched operator calls (mpflow_batch_size > 1) and
    each stream's answer is the same as when it is updated alone (same seed: same particles)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    obs = [[0.5, -0.25], [1.0, 0.5]]
    spec = {"model": {"family": "linear_gaussian"}, "prior": PRIOR, "method": "smc", "num_particles": 64, "seed": 3}

    async def main():
        try:
            s = settings(redis_url, prefix, batch_max_wait_ms=20.0)
            async with serve_in_process(s) as (app, c):
                for i in range(12):
                    await c.post("/v1/streams", json={**spec, "stream_id": f"b{i}"})
                # one observation per request: a request of several runs its steps as one job of its own (a run,
                # service/engine/update_engine.py), and only a request's last step joins the cross-stream batches
                for o in obs:
                    rs = await asyncio.gather(
                        *(c.post(f"/v1/streams/b{i}/observations", json={"observations": [o]}) for i in range(12))
                    )
                batched = [r.json() for r in rs]
                sizes = app.state.metrics.batch_size.collect()[0].samples
                count = next(x.value for x in sizes if x.name.endswith("_count"))
                total = next(x.value for x in sizes if x.name.endswith("_sum"))
                assert total == 24 and count < 24  # 24 stream-steps in fewer operator calls
            s_off = settings(redis_url, prefix + "-off", batching=False)
            async with serve_in_process(s_off) as (app, c):
                await c.post("/v1/streams", json={**spec, "stream_id": "alone"})
                alone = (await c.post("/v1/streams/alone/observations", json={"observations": obs})).json()
                sizes = app.state.metrics.batch_size.collect()[0].samples
                assert next(x.value for x in sizes if x.name.endswith("_count")) == 2
            for doc in batched:
                for key in ("mean", "std"):
                    assert torch.allclose(
                        torch.tensor(doc["summary"][key]), torch.tensor(alone["summary"][key]), atol=1e-5
                    )
                assert abs(doc["summary"]["log_evidence"] - alone["summary"]["log_evidence"]) < 1e-5
        finally:
            await drop_prefix(redis_url, prefix)
            await drop_prefix(redis_url, prefix + "-off")

    asyncio.run(main())
