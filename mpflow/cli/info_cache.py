"""``mpflow info``'s catalogue (families, methods, trained operators), cached so that the command need not import
torch each time it runs.

The catalogue is what :mod:`mpflow.service.engine.catalogue` lists for the service (``GET /v1/models``,
``GET /v1/operators``), built by importing the model families, the updaters and the operator registry — torch
among them, seconds of start-up. It depends only on files, so it is kept as JSON under ``$XDG_CACHE_HOME/mpflow``
(``~/.cache/mpflow``), named by a key over everything it is read from:

* mpflow's version and, for every ``.py`` file of ``mpflow.operators`` (the families, the updaters, the registry),
  its path, size and modification time;
* the family plugins installed (the ``mpflow.families`` entry points: name, target and distribution version);
* every file of the operator folders (``operators/pretrained`` and ``MPFLOW_OPERATOR_DIRS``, and the service's
  ``MPFLOW_OPERATOR_DIRS`` setting): path, size and modification time;
* ``max_state_dim`` (the families' largest d), and the settings module's path, size and modification time.

Without any ``MPFLOW_*`` variable in the environment (:func:`service_env`) the settings are the defaults, kept in the
catalogue too (``"settings"``), so a cached ``mpflow info`` imports neither torch nor pydantic: 0.66 → 0.2 s here.

A change to any of them gives another key, so another file: a stale catalogue is never read. The first run after
a change builds it (importing torch) and writes it; a cache that cannot be written is only not kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

#: the entry-point group of family plugins (:mod:`mpflow.operators.models.plugins`)
PLUGIN_GROUP = "mpflow.families"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpflow"


def _files(folders: Iterable[Path], pattern: str) -> list[str]:
    """``path size mtime_ns`` of every file matching ``pattern`` under ``folders``, sorted."""
    out = []
    for folder in folders:
        if folder.is_dir():
            for f in folder.rglob(pattern):
                if f.is_file() and "__pycache__" not in f.parts:
                    st = f.stat()
                    out.append(f"{f} {st.st_size} {st.st_mtime_ns}")
    return sorted(out)


def operator_folders(extra_dirs: list[str]) -> list[Path]:
    """The folders the catalogue lists operators from: the shipped ``operators/pretrained``, then
    ``MPFLOW_OPERATOR_DIRS`` and the service's own setting (as
    :class:`~mpflow.service.engine.catalogue.OperatorCatalogue`
    does)."""
    spec = importlib.util.find_spec("mpflow.operators")  # finds the package without importing it (nor torch)
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    env = [p for p in os.environ.get("MPFLOW_OPERATOR_DIRS", "").split(os.pathsep) if p.strip()]
    return [*(r / "pretrained" for r in roots), *(Path(p).expanduser() for p in [*env, *extra_dirs])]


def service_env() -> bool:
    """Whether some service setting is given in the environment (``MPFLOW_*``, any case, as the settings read it)."""
    return any(name.upper().startswith("MPFLOW_") for name in os.environ)


def cache_key(extra_dirs: list[str], max_state_dim: int | None) -> str:
    """The key of the module docstring (``max_state_dim`` None: the settings' default)."""
    import mpflow

    spec = importlib.util.find_spec("mpflow.operators")
    code = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    settings = importlib.util.find_spec("mpflow.service.settings")
    code_files = [settings.origin] if settings is not None and settings.origin else []
    plugins = sorted(
        f"{ep.name}={ep.value}@{ep.dist.version if ep.dist else ''}" for ep in entry_points(group=PLUGIN_GROUP)
    )
    parts = [
        mpflow.__version__,
        str(max_state_dim),
        *_files(code, "*.py"),
        *(f"{f} {os.stat(f).st_size} {os.stat(f).st_mtime_ns}" for f in code_files),
        *plugins,
        *_files(operator_folders(extra_dirs), "*"),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def cached_catalogue(
    extra_dirs: list[str], max_state_dim: int | None, build: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The catalogue from the cache when its key matches, else ``build()`` (written to the cache for next time)."""
    kind = "info-default" if max_state_dim is None else "info-env"  # one file of each kind kept: without, with MPFLOW_*
    path = cache_dir() / f"{kind}-{cache_key(extra_dirs, max_state_dim)}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    catalogue = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{kind}-*.json"):  # one catalogue of a kind kept: the others are stale
            old.unlink(missing_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(catalogue), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass
    return catalogue


__all__ = ["cache_dir", "cache_key", "cached_catalogue", "operator_folders", "service_env"]
