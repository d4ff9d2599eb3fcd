"""The built-in families' task distributions (:class:`mpflow.training.task_distribution.TaskDistribution`), one
module per family, each registered where it is defined (``@register_tasks``). Importing this package imports every
module in it, so a new family's distribution is its one new module."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
