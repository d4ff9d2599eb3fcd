"""The Python client of the mpflow REST API (docs/API.md): ``from mpflow.client import Client, AsyncClient``.

It needs httpx, numpy and websockets only — ``pip install "mpflow[client]"`` — and imports nothing of the server
(no torch, FastAPI or Redis): :mod:`mpflow.client.http` holds the sync and async clients and their streams,
:mod:`mpflow.client.websocket` a stream's WebSocket, :mod:`mpflow.client.results` what comes back in numpy's terms,
:mod:`mpflow.client.observations` the checks and encodings of what is sent, :mod:`mpflow.client.errors` the errors.
"""

from mpflow.client.errors import MpflowConnectionError, MpflowError
from mpflow.client.http import AsyncClient, AsyncStream, Client, Retry, Stream
from mpflow.client.results import History, Posterior, StepTable

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Client",
    "History",
    "MpflowConnectionError",
    "MpflowError",
    "Posterior",
    "Retry",
    "StepTable",
    "Stream",
]
