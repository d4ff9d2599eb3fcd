"""Large JSON answers streamed in chunks (service.json_stream): the same bytes as one JSONResponse."""

from __future__ import annotations

import asyncio
import threading

import torch
from fastapi.responses import JSONResponse, StreamingResponse
from mpflow.service.api import json_stream
from mpflow.service.api.json_stream import CHUNK_VALUES, json_answer


def _body(response) -> bytes:
    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    return asyncio.run(collect())


def test_a_large_answer_is_streamed_off_the_loop_with_the_bytes_of_one_response():
    threads: list[str] = []

    async def run(fn, *args):
        threads.append(threading.current_thread().name)
        return await asyncio.to_thread(fn, *args)

    particles = torch.randn(3 * CHUNK_VALUES // 7 + 5, 7)  # rows that do not divide a chunk evenly
    lw = torch.log_softmax(torch.randn(particles.shape[0], dtype=torch.float64), -1)
    doc = {"particles": particles, "log_weights": lw, "note": "x"}
    answer = json_answer(doc, run)
    assert isinstance(answer, StreamingResponse)
    expected = JSONResponse({"particles": particles.tolist(), "log_weights": lw.tolist(), "note": "x"}).body
    assert _body(answer) == expected
    assert len(threads) > 3  # several chunks, each handed to the runner


def test_a_small_answer_is_one_plain_response():
    async def never(*_):
        raise AssertionError("no hop for a small answer")

    answer = json_answer({"samples": torch.ones(4, 2)}, never)
    assert isinstance(answer, JSONResponse) and answer.body == b'{"samples":[[1.0,1.0],[1.0,1.0],[1.0,1.0],[1.0,1.0]]}'


def test_chunks_are_bounded():
    t = torch.zeros(10 * CHUNK_VALUES // 64, 64)
    sizes = []

    async def run(fn, *args):
        sizes.append(args[2] - args[1])
        return fn(*args)

    _body(json_answer({"x": t}, run))
    assert max(sizes) * 64 <= CHUNK_VALUES and sum(sizes) == t.shape[0]
    assert json_stream.encode_rows(torch.tensor([[1.0], [2.0]]), 0, 2) == b"[1.0],[2.0]"
