"""mpflow: online sequential Bayesian inference — learned Meta Particle Flow operators with classical references.

One import name, four layers and the client (imports point downwards only; import-linter's contracts in
pyproject.toml, run by ``tests/unit/test_import_contract.py``):

* :mod:`mpflow.operators` — the mathematics: model families, priors, updaters, the MPF flow, references.
* :mod:`mpflow.training` — offline work on operators: task distributions, meta-training, evaluation.
* :mod:`mpflow.service` — the HTTP service: FastAPI app, Redis state store, micro-batching engine.
* :mod:`mpflow.cli` — the ``mpflow`` command line, above training and service.
* :mod:`mpflow.client` — the REST client, on httpx, numpy and websockets only (``pip install "mpflow[client]"``).

``from mpflow import Client`` (and ``AsyncClient``, ``MpflowError``, ``Posterior``) is the Python client of the REST API
(``docs/API.md``, :mod:`mpflow.client`); it is imported lazily, so ``import mpflow`` stays cheap and imports
neither the client's dependencies nor torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_CLIENT_NAMES = (
    "Client",
    "AsyncClient",
    "MpflowError",
    "MpflowConnectionError",
    "Posterior",
    "Retry",
    "Stream",
    "AsyncStream",
)
__all__ = ["__version__", *_CLIENT_NAMES]


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        import mpflow.client

        return getattr(mpflow.client, name)
    raise AttributeError(f"module 'mpflow' has no attribute {name!r}")
