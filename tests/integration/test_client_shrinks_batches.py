"""``stream.filter`` against a real server whose cost budget is low (``MPFLOW_MAX_REQUEST_FLOPS``; issue 38): a
request of more steps than fit is answered 413 ``limit_exceeded`` naming how many do, and the client sends that
many instead and goes on in requests of that size — the same estimates as one step per request — for a DataFrame
and a plain list, sync and async. One step that does not fit alone is still the 413."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from mpflow.service.client import AsyncClient, Client, MpflowError
from mpflow.service.settings import Settings

from tests.harness.server import drop_prefix, serve_in_thread
from tests.integration.test_client import MODEL

pd = pytest.importorskip("pandas")

PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
#: an smc stream of N = 256, d = 2 fits 9 steps a request under this budget (the 413 says "at most 9"; 3e6 before
#: the price audit, docs/benchmarks.md "What each method costs against its price")
FLOPS = 3e7
STEPS = 40


@pytest.fixture(scope="module")
def small_server(redis_url: str) -> Iterator[str]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    settings = Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING", max_request_flops=FLOPS)
    try:
        with serve_in_thread(settings) as url:
            yield url
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def _observations() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(STEPS, 2))


class Posts:
    """Counts the observation requests and their sizes (an httpx event hook)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/observations"):
            self.sizes.append(len(json.loads(request.content)["observations"]))


def test_filter_splits_a_dataframe_the_server_refuses_as_too_large(small_server):
    frame = pd.DataFrame(_observations(), columns=["a", "b"])
    posts = Posts()
    with Client(small_server, event_hooks={"request": [posts]}) as client:
        stream = client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=256, seed=5)
        estimates = stream.filter(frame)
        assert len(estimates) == STEPS and stream.get().step == STEPS
        # 40 steps refused, then 9 per request (the 413's "at most 9"): the refused one and 5 that were applied
        assert posts.sizes[0] == STEPS and posts.sizes[1:] == [9, 9, 9, 9, 4], posts.sizes
        one_by_one = client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=256, seed=5)
        answers = list(one_by_one.filter(_observations()))
        expected = np.array([a["per_step"][0]["mean"] for a in answers])
        np.testing.assert_allclose(estimates[["mean_x0", "mean_x1"]].to_numpy(), expected, rtol=0, atol=1e-12)


def test_async_filter_splits_too(small_server):
    async def run() -> list[dict]:
        async with AsyncClient(small_server) as client:
            stream = await client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=256, seed=5)
            return [answer async for answer in stream.filter(_observations().tolist(), batch=STEPS)]

    answers = asyncio.run(run())
    assert [a["step"] for a in answers] == [9, 18, 27, 36, 40]


def test_one_step_over_the_budget_is_still_the_413(small_server):
    with Client(small_server) as client:
        stream = client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=256, seed=5)
        with pytest.raises(MpflowError) as caught:
            list(stream.filter(_observations()[:3].tolist(), batch=3, return_samples=100_000))
        assert caught.value.status == 413 and caught.value.code == "limit_exceeded"
        assert stream.get().step == 0
