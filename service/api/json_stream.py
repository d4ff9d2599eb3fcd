"""Large JSON answers (particles, samples) encoded off the event loop, a chunk at a time, and streamed.

``GET .../particles`` at N = 65536, d = 128 is 8.4 million numbers, 169 MB of JSON: encoded in one
``json.dumps`` on the event loop it held the loop — and ``/healthz`` — for 7 s (issue 34; a Kubernetes liveness
probe gives up after 3 s), and on a thread it would hold the GIL as long, since the JSON encoder never releases
it. So an answer with more than :data:`CHUNK_VALUES` numbers is sent as a streaming (chunked) response whose
body is encoded on the auxiliary threads :data:`CHUNK_VALUES` numbers at a time (about 15 ms of GIL each): between
chunks the loop serves other requests, and the whole answer is never in memory at once (neither as Python floats,
~32 bytes each, nor as text). The bytes are those ``JSONResponse`` would send (compact separators, no NaN).

A small answer is a plain ``JSONResponse`` (a thread hop per chunk would cost more than it saves).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from fastapi.responses import JSONResponse, Response, StreamingResponse

#: numbers per encoded chunk (and the most a plain, one-piece answer holds)
CHUNK_VALUES = 1 << 15

#: runs ``fn(*args)`` off the event loop (:meth:`mpflow.service.engine.update_engine.UpdateEngine.run`)
Runner = Callable[..., Awaitable[Any]]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode_rows(t: torch.Tensor, start: int, stop: int) -> bytes:
    """Rows ``start:stop`` of ``t`` as the JSON of their elements, comma-separated, without brackets."""
    return _dumps(t[start:stop].tolist())[1:-1].encode()


async def _array(t: torch.Tensor, run: Runner) -> AsyncIterator[bytes]:
    """The JSON array of ``t``, in chunks encoded by ``run``."""
    rows = max(1, CHUNK_VALUES // max(1, math.prod(t.shape[1:])))
    yield b"["
    for start in range(0, t.shape[0], rows):
        if start:
            yield b","
        yield await run(encode_rows, t, start, min(start + rows, t.shape[0]))
    yield b"]"


async def _document(doc: dict[str, Any], run: Runner) -> AsyncIterator[bytes]:
    yield b"{"
    for i, (name, value) in enumerate(doc.items()):
        yield (b"," if i else b"") + _dumps(name).encode() + b":"
        if isinstance(value, torch.Tensor):
            async for chunk in _array(value, run):
                yield chunk
        else:
            yield _dumps(value).encode()
    yield b"}"


def json_answer(doc: dict[str, Any], run: Runner, status_code: int = 200) -> Response:
    """``doc`` as JSON, its tensor values as (nested) arrays: one piece when it holds at most
    :data:`CHUNK_VALUES` numbers, else streamed in chunks encoded by ``run`` (module docstring)."""
    tensors = [v for v in doc.values() if isinstance(v, torch.Tensor)]
    if sum(t.numel() for t in tensors) <= CHUNK_VALUES:
        plain = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in doc.items()}
        return JSONResponse(plain, status_code=status_code)
    return StreamingResponse(_document(doc, run), status_code=status_code, media_type="application/json")


__all__ = ["CHUNK_VALUES", "encode_rows", "json_answer"]
