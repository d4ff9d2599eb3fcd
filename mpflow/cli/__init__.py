"""The ``mpflow`` command line: ``info``, ``filter``, ``train``, ``evaluate``, ``fit-sampler``, ``serve``.

It sits above :mod:`mpflow.training` and :mod:`mpflow.service` and is imported by neither.
"""

from mpflow.cli.main import main

__all__ = ["main"]
