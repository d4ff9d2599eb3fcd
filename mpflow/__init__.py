"""mpflow: online sequential Bayesian inference — learned Meta Particle Flow operators with classical references.

One import name, four layers (imports point downwards only; ``tests/unit/test_import_contract.py`` checks it):

* :mod:`mpflow.operators` — the mathematics: model families, priors, updaters, the MPF flow, references.
* :mod:`mpflow.training` — offline work on operators: task distributions, meta-training, evaluation.
* :mod:`mpflow.service` — the HTTP service: FastAPI app, Redis state store, micro-batching engine, client.
* :mod:`mpflow.cli` — the ``mpflow`` command line, above training and service.

``from mpflow import Client`` (and ``AsyncClient``, ``MpflowError``, ``Posterior``) is the Python client of the REST API
(``docs/API.md``); it is imported lazily, so ``import mpflow`` stays cheap.
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
