"""The Python client (service.client) against a real server and a real Redis (``MPFLOW_REDIS_URL``, else
redis://127.0.0.1:6379/0; skipped without one unless ``CI`` is set): the sync client over HTTP to uvicorn in a
thread, the async client in process (ASGI). Faults are injected by wrapping the transport: an answer lost after
the server applied the request (a read timeout), a 503 with ``Retry-After``, a refused connection.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from mpflow.service.client import AsyncClient, Client, MpflowError, Retry
from mpflow.service.settings import Settings

from tests.harness.server import drop_prefix, serve_in_process, serve_in_thread

MODEL = {"family": "lds", "params": {"A": [[0.9, 0.1], [-0.1, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
OBS = [[0.5, -0.2], [0.7, 0.1], [0.2, 0.4], [-0.3, 0.6], [-0.1, 0.2], [0.4, -0.5]]
FAST_RETRY = Retry(attempts=4, base_delay=0.001, max_delay=0.01)


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[str]:
    """One uvicorn server in a thread for the module, on a fresh key prefix (deleted afterwards)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    try:
        with serve_in_thread(Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING")) as url:
            yield url
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def _is_observation(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/observations")


def _fault_503(request: httpx.Request) -> httpx.Response:
    body = {"error": {"code": "store_unavailable", "message": "injected"}}
    return httpx.Response(503, headers={"Retry-After": "0"}, json=body, request=request)


class Flaky(httpx.BaseTransport):
    """Forwards to ``inner``; the n-th observation POST (1-based) gets ``faults[n]``: ``"lost"`` (forwarded and
    applied, then a read timeout instead of the answer), ``"503"`` (not forwarded) or ``"refused"``."""

    def __init__(self, inner: httpx.BaseTransport, faults: dict[int, str]):
        self.inner, self.faults = inner, dict(faults)
        self.posts: list[tuple[int | None, str]] = []  # (seq sent, what happened)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_observation(request):
            return self.inner.handle_request(request)
        fault = self.faults.pop(len(self.posts) + 1, None)
        seq = httpx.Response(200, content=request.content).json().get("seq")
        self.posts.append((seq, fault or "ok"))
        if fault == "503":
            return _fault_503(request)
        if fault == "refused":
            raise httpx.ConnectError("injected: connection refused", request=request)
        response = self.inner.handle_request(request)
        if fault == "lost":
            response.read()
            response.close()
            raise httpx.ReadTimeout("injected: the answer was lost", request=request)
        return response


class AsyncFlaky(httpx.AsyncBaseTransport):
    """The async twin of :class:`Flaky`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, faults: dict[int, str]):
        self.inner, self.faults = inner, dict(faults)
        self.posts: list[tuple[int | None, str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_observation(request):
            return await self.inner.handle_async_request(request)
        fault = self.faults.pop(len(self.posts) + 1, None)
        seq = httpx.Response(200, content=request.content).json().get("seq")
        self.posts.append((seq, fault or "ok"))
        if fault == "503":
            return _fault_503(request)
        response = await self.inner.handle_async_request(request)
        if fault == "lost":
            await response.aread()
            await response.aclose()
            raise httpx.ReadTimeout("injected: the answer was lost", request=request)
        return response


def _new_stream(client: Client, **extra):
    return client.create_stream(model=MODEL, prior=PRIOR, method="smc", num_particles=64, seed=11, **extra)


def test_round_trip(server: str) -> None:
    with Client(server) as client:
        assert "lds" in {f["family"] for f in client.models()["families"]}
        assert isinstance(client.operators(), list)
        stream = _new_stream(client, stream_id=f"rt-{uuid.uuid4().hex[:8]}")
        assert stream.document is not None and stream.document["step"] == 0
        doc = stream.update(OBS[:2], seq=1, return_samples=5)
        assert doc["step"] == 2 and not doc["duplicate"] and [p["step"] for p in doc["per_step"]] == [1, 2]
        assert len(doc["samples"]) == 5
        assert stream.update(OBS[2:3])["step"] == 3  # without seq: appended
        again = client.stream(stream.stream_id).get()
        assert again["step"] == 3 and again["summary"] == stream.document["summary"]
        assert len(stream.samples(7)) == 7
        parts = stream.particles()
        assert len(parts["particles"]) == 64 and len(parts["log_weights"]) == 64
        assert stream.stream_id in {s["stream_id"] for s in client.list_streams()}
        stream.delete()
        with pytest.raises(MpflowError) as err:
            stream.get()
        assert (err.value.status, err.value.code) == (404, "stream_not_found")


def test_filter_numbers_seq_and_survives_faults_without_double_application(server: str) -> None:
    with Client(server) as plain:
        reference = _new_stream(plain)
        expected = [doc["summary"] for doc in reference.filter(OBS)]
    flaky = Flaky(httpx.HTTPTransport(), {2: "lost", 4: "503", 6: "refused"})
    with Client(server, retry=FAST_RETRY, transport=flaky) as client:
        stream = _new_stream(client)
        stream.update(OBS[:1], seq=1)  # the filter continues from the stream's step
        docs = list(stream.filter(OBS[1:]))
        final = stream.get()
    # lost answer of seq 2 → retried, answered as a duplicate; 503 and refused → retried, applied once
    assert flaky.posts == [
        (1, "ok"),
        (2, "lost"),
        (2, "ok"),
        (3, "503"),
        (3, "ok"),
        (4, "refused"),
        (4, "ok"),
        (5, "ok"),
        (6, "ok"),
    ]
    assert [d["step"] for d in docs] == [2, 3, 4, 5, 6]
    assert [d["duplicate"] for d in docs] == [True, False, False, False, False]
    assert docs[0]["per_step"] == [] and docs[1]["per_step"][0]["step"] == 3
    assert final["step"] == len(OBS)  # every observation applied exactly once
    # same seed, same observations: the same posteriors as the stream fed without faults
    assert [d["summary"] for d in docs] == expected[1:]


def test_errors_carry_status_and_code(server: str) -> None:
    with Client(server, retry=FAST_RETRY) as client:
        with pytest.raises(MpflowError) as err:
            client.create_stream(model={"family": "no_such_family"}, prior=PRIOR)
        assert err.value.status == 422 and err.value.code and err.value.message
        stream = _new_stream(client)
        with pytest.raises(MpflowError) as err:
            stream.update(OBS[:1], seq=3)  # a gap
        assert (err.value.status, err.value.code) == (409, "seq_conflict")
        assert "next seq is 1" in err.value.message
    # without seq an update is not safe to repeat: a 503 is raised, not retried
    flaky = Flaky(httpx.HTTPTransport(), {1: "503"})
    with Client(server, retry=FAST_RETRY, transport=flaky) as client:
        with pytest.raises(MpflowError) as err:
            client.stream(stream.stream_id).update(OBS[:1])
        assert (err.value.status, err.value.code) == (503, "store_unavailable")
        assert len(flaky.posts) == 1
    # retries are bounded
    flaky = Flaky(httpx.HTTPTransport(), dict.fromkeys(range(1, 10), "refused"))
    with Client(server, retry=FAST_RETRY, transport=flaky) as client:
        with pytest.raises(MpflowError) as err:  # the client's own error, the transport's as its cause
            client.stream(stream.stream_id).update(OBS[:1], seq=1)
        assert err.value.code == "connection_failed" and isinstance(err.value.__cause__, httpx.ConnectError)
        assert len(flaky.posts) == FAST_RETRY.attempts
        assert client.stream(stream.stream_id).get()["step"] == 0


def test_async_client_filters_an_async_iterable_in_batches(redis_url: str) -> None:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    settings = Settings(redis_url=redis_url, redis_prefix=prefix, log_level="WARNING")

    async def observations() -> AsyncIterator[list[float]]:
        for o in OBS[:5]:
            yield o

    async def main() -> None:
        try:
            async with serve_in_process(settings) as (app, _):
                flaky = AsyncFlaky(httpx.ASGITransport(app=app), {1: "lost", 3: "503"})
                async with AsyncClient("http://mpflow", retry=FAST_RETRY, transport=flaky) as client:
                    stream = await client.create_stream(
                        model=MODEL, prior=PRIOR, method="mpf", num_particles=32, seed=5
                    )
                    docs = [doc async for doc in stream.filter(observations(), batch=2)]
                    assert [d["step"] for d in docs] == [2, 4, 5]
                    assert [d["duplicate"] for d in docs] == [True, False, False]
                    assert flaky.posts == [(1, "lost"), (1, "ok"), (3, "503"), (3, "ok"), (5, "ok")]
                    assert (await stream.get())["step"] == 5
                    assert len(await stream.samples(3)) == 3
                    with pytest.raises(MpflowError) as err:
                        await client.stream("no-such-stream").get()
                    assert err.value.code == "stream_not_found"
                    await stream.delete()
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())
