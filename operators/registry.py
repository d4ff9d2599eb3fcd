"""Trained operators and samplers on disk: save, load, list, resolve (docs/DESIGN.md "Trained operators on disk").

A trained object is a folder named ``<family>-d<d>-v<k>`` (e.g. ``lds-d2-v1``) holding

- ``config.json``        architecture, family, state_dim, obs_dim, training task distribution, solver
                         settings and ``created`` (ISO 8601, UTC);
- ``weights.safetensors`` the state_dict (safetensors: no pickle anywhere);
- ``metrics.json``       held-out accuracy against exact posteriors and baselines;
- ``README.md``          how it was trained: the exact command.

Operators live directly in a root folder (the package's ``operators/pretrained/`` and every folder of
``MPFLOW_OPERATOR_DIRS``); samplers (e.g. GPVI generators for non-Gaussian priors) live under that root's
``samplers/`` subfolder in the same format. The kind ("operator" or "sampler") is given by that location.

Samplers written by :meth:`mpflow.operators.samplers.gpvi.GPVIGenerator.save` hold only ``config.json`` +
``weights.safetensors`` with the keys ``kind``/``dim``; they are read with this mapping (explicit keys win):
``family ← config["kind"]`` (``"gpvi"``), ``state_dim ← config["dim"]``, ``obs_dim ← 0`` (a sampler sees no
observations), ``architecture ← config["kind"]``; ``metrics.json`` and ``README.md`` are optional for samplers
(missing metrics read as ``{}``). For operators all four files and keys are required.

Content hash (stable across machines; reproducible from the files alone)::

    content_hash = sha256( canonical_json(config \\ {"created"}) ‖ 0x00 ‖ bytes(weights.safetensors) ).hex()
    canonical_json(c) = json.dumps(c, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False).encode("utf-8")

``created`` is left out so that identical content saved twice (e.g. a deterministic retraining with the
README's command) has the same hash; every other byte of the config or the weights changes it. The 0x00
separator cannot occur inside JSON text, so (config, weights) pairs cannot collide by shifting bytes.

Problems found while listing (corrupt folders, wrong names, shadowed duplicates) are *reported* with
``warnings.warn(..., RegistryWarning)`` and skipped; :func:`list_operators` never raises on folder contents.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

Kind = Literal["operator", "sampler"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
METRICS_FILE = "metrics.json"
README_FILE = "README.md"
SAMPLERS_DIR = "samplers"
ENV_DIRS = "MPFLOW_OPERATOR_DIRS"
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
#: a family name: lower-case letters, digits and '_', starting with a letter or '_' (``lorenz96``)
FAMILY_RE = r"[a-z_][a-z0-9_]*"
NAME_RE = re.compile(rf"^(?P<family>{FAMILY_RE})-d(?P<d>[0-9]+)-v(?P<v>[0-9]+)$")
REQUIRED_CONFIG = ("family", "state_dim", "obs_dim", "architecture")
_HASH_EXCLUDED = ("created",)
_CHUNK = 1 << 20


class RegistryWarning(UserWarning):
    """A folder skipped (or shadowed) while listing operators."""


@dataclass(frozen=True)
class OperatorRecord:
    """One trained operator or sampler folder, as read from disk (weights are loaded on demand)."""

    name: str
    kind: Kind
    family: str
    state_dim: int
    obs_dim: int
    version: int
    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    created: str
    content_hash: str

    def __hash__(self) -> int:  # config/metrics are dicts: hash the identity of the content instead
        return hash((self.kind, self.name, self.content_hash, str(self.path)))

    @property
    def auto_select(self) -> bool:
        """Whether ``mpf`` picks this operator for a stream of its family and d that names none (the newest such
        one); False — ``"auto_select": false`` in its config.json — for one measured no better than its base flow
        at equal compute, which serves only a stream that names it."""
        return self.config.get("auto_select", True) is not False

    @property
    def auto_select_note(self) -> str | None:
        """Why it is (not) picked automatically, in words: the config's ``auto_select_note`` (None if it has none)."""
        return self.config.get("auto_select_note")

    def to_json(self) -> dict[str, Any]:
        """The catalogue entry (docs/API.md ``GET /v1/operators``): no filesystem path, no full config."""
        return {
            "name": self.name,
            "kind": self.kind,
            "family": self.family,
            "state_dim": self.state_dim,
            "obs_dim": self.obs_dim,
            "version": self.version,
            "metrics": json.loads(json.dumps(self.metrics)),
            "created": self.created,
            "content_hash": self.content_hash,
            "auto_select": self.auto_select,
            "auto_select_note": self.auto_select_note,
        }


# ---- helpers ---------------------------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN/inf: the same bytes on every machine."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def content_hash(config: dict[str, Any], weights_path: Path) -> str:
    """sha256(canonical_json(config without "created") ‖ 0x00 ‖ weights bytes), hex (module docstring)."""
    h = hashlib.sha256(canonical_json({k: v for k, v in config.items() if k not in _HASH_EXCLUDED}))
    h.update(b"\x00")
    with open(weights_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_config(config: Any, where: str = "config") -> None:
    """Required keys and types of an operator config; ValueError naming the key."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(config).__name__}")
    missing = [k for k in REQUIRED_CONFIG if k not in config]
    if missing:
        raise ValueError(f"{where}.{missing[0]}: required key missing (required: {list(REQUIRED_CONFIG)})")
    if not (isinstance(config["family"], str) and re.fullmatch(FAMILY_RE, config["family"])):
        raise ValueError(
            f"{where}.family: must be lower-case letters, digits and '_', not starting with a digit, "
            f"got {config['family']!r}"
        )
    if not _is_int(config["state_dim"], 1):
        raise ValueError(f"{where}.state_dim: must be a positive integer, got {config['state_dim']!r}")
    if not _is_int(config["obs_dim"], 0):
        raise ValueError(f"{where}.obs_dim: must be a non-negative integer, got {config['obs_dim']!r}")
    arch = config["architecture"]
    if not (isinstance(arch, str | dict) and arch):
        raise ValueError(f"{where}.architecture: must be a non-empty string or object, got {arch!r}")
    if "created" in config:
        _check_created(config["created"], f"{where}.created")


def _check_created(value: Any, field: str) -> str:
    try:
        datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: must be an ISO 8601 date string, got {value!r}") from None
    return value


def _check_json(name: str, obj: Any) -> None:
    try:
        canonical_json(obj)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be JSON-serialisable without NaN/inf ({exc})") from None


def _parse_name(name: Any, field: str = "name") -> tuple[str, int, int]:
    """``<family>-d<d>-v<k>`` → (family, d, k)."""
    m = NAME_RE.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"{field}: must match {NAME_RE.pattern} (e.g. 'lds-d2-v1'), got {name!r}")
    return m["family"], int(m["d"]), int(m["v"])


def _check_safetensors(path: Path) -> None:
    """Header of a safetensors file parses and its byte ranges fit the file (catches truncation)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header length {n} exceeds the file size {size}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if max(ends, default=0) != size - 8 - n:
        raise ValueError(f"data section is {size - 8 - n} bytes, the header describes {max(ends, default=0)}")


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"path: {path} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"path: {path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _sampler_view(config: dict[str, Any]) -> dict[str, Any]:
    """Config keys of a sampler with the GPVI mapping filled in (module docstring); explicit keys win."""
    kind = config.get("kind")
    view = dict(config)
    view.setdefault("family", kind)
    view.setdefault("state_dim", config.get("dim"))
    view.setdefault("obs_dim", 0)
    view.setdefault("architecture", kind)
    return view


# ---- loading ---------------------------------------------------------------------------------------------


def load_record(path: str | Path, kind: Kind | None = None) -> OperatorRecord:
    """Read an operator folder. ``kind`` defaults to "sampler" when the folder's parent is ``samplers/``.

    Checks that the files exist, the JSON parses, the config has the required keys, the folder name
    matches ``<family>-d<d>-v<k>`` with the config's family and state_dim, and the weights file is a whole
    safetensors file. Raises ValueError starting with ``path:`` naming the folder and what is wrong.
    """
    folder = Path(path)
    if kind is None:
        kind = "sampler" if folder.parent.name == SAMPLERS_DIR else "operator"
    if kind not in ("operator", "sampler"):
        raise ValueError(f"kind: must be 'operator' or 'sampler', got {kind!r}")
    if not folder.is_dir():
        raise ValueError(f"path: {folder} is not a folder")
    required = [CONFIG_FILE, WEIGHTS_FILE] + ([METRICS_FILE, README_FILE] if kind == "operator" else [])
    missing = [f for f in required if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"path: {folder} is missing {missing}")
    try:
        config = _read_json_object(folder / CONFIG_FILE)
        metrics_path = folder / METRICS_FILE
        metrics = _read_json_object(metrics_path) if metrics_path.is_file() else {}
        view = _sampler_view(config) if kind == "sampler" else config
        _check_config(view, CONFIG_FILE)
        family, d, version = _parse_name(folder.name, "name")
        if (family, d) != (view["family"], view["state_dim"]):
            raise ValueError(
                f"name: folder {folder.name!r} disagrees with config (family {view['family']!r}, "
                f"state_dim {view['state_dim']})"
            )
        try:
            _check_safetensors(folder / WEIGHTS_FILE)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"{WEIGHTS_FILE}: corrupt ({exc})") from None
        created = config.get("created")
        if created is None:  # e.g. a GPVI sampler folder: fall back to the config file's time
            mtime = (folder / CONFIG_FILE).stat().st_mtime
            created = datetime.fromtimestamp(mtime, UTC).isoformat(timespec="seconds")
        else:
            _check_created(created, f"{CONFIG_FILE}.created")
        digest = content_hash(config, folder / WEIGHTS_FILE)
    except (OSError, ValueError) as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith("path:") else f"path: {folder}: {msg}") from None
    return OperatorRecord(
        name=folder.name,
        kind=kind,
        family=view["family"],
        state_dim=view["state_dim"],
        obs_dim=view["obs_dim"],
        version=version,
        path=folder,
        config=config,
        metrics=metrics,
        created=created,
        content_hash=digest,
    )


def load_weights(record: OperatorRecord) -> dict[str, torch.Tensor]:
    """The state_dict of ``record`` (``safetensors.torch.load_file``, on CPU)."""
    path = record.path / WEIGHTS_FILE
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"path: cannot load {path} ({exc})") from None


def _candidates(root: Path) -> list[Path]:
    """Sub-folders of ``root`` that may be operator folders (hidden/underscore ones are temp or caches)."""

    def wanted(p: Path) -> bool:
        return p.is_dir() and not p.name.startswith((".", "_")) and p.name != SAMPLERS_DIR

    return sorted(filter(wanted, root.iterdir()))


def list_operators(dirs: Iterable[str | Path]) -> list[OperatorRecord]:
    """Every operator in each of ``dirs`` and every sampler in each ``<dir>/samplers/``, sorted by name.

    A name found twice is kept from the first dir (within a dir, operators before samplers); a later copy
    with a different content hash is reported as shadowed. Folders that fail :func:`load_record` and
    ``dirs`` that do not exist are skipped and reported with ``warnings.warn(..., RegistryWarning)``.
    Hidden (``.*``, e.g. an interrupted save's temp dir) and ``_*`` folders are ignored silently.
    """
    found: dict[str, OperatorRecord] = {}
    for root in map(Path, dirs):
        if not root.is_dir():
            warnings.warn(f"operator dir {root} does not exist; skipped", RegistryWarning, stacklevel=2)
            continue
        scans: list[tuple[Path, Kind]] = [(root, "operator")]
        if (root / SAMPLERS_DIR).is_dir():
            scans.append((root / SAMPLERS_DIR, "sampler"))
        for base, kind in scans:
            for folder in _candidates(base):
                try:
                    rec = load_record(folder, kind)
                except (OSError, ValueError) as exc:
                    warnings.warn(f"skipped {folder}: {exc}", RegistryWarning, stacklevel=2)
                    continue
                first = found.setdefault(rec.name, rec)
                if first is not rec and first.content_hash != rec.content_hash:
                    warnings.warn(
                        f"{folder} is shadowed by {first.path} (same name {rec.name!r}, other content)",
                        RegistryWarning,
                        stacklevel=2,
                    )
    return sorted(found.values(), key=lambda r: r.name)


def default_dirs() -> list[Path]:
    """`operators/pretrained/`, then each existing folder in `$MPFLOW_OPERATOR_DIRS` (os.pathsep-joined)."""
    extra = [Path(p).expanduser() for p in os.environ.get(ENV_DIRS, "").split(os.pathsep) if p.strip()]
    out: list[Path] = []
    for d in [PRETRAINED_DIR, *extra]:
        if d.is_dir() and d.resolve() not in {o.resolve() for o in out}:
            out.append(d)
    return out


def resolve(
    name_or_dir: str | Path, dirs: Iterable[str | Path] | None = None, kind: Kind | None = None
) -> OperatorRecord:
    """A registered name (searched in ``dirs``, default :func:`default_dirs`) or a path to a folder.

    A :class:`~pathlib.Path`, or a string holding a path separator, is read as a folder; any other string is
    looked up by name first and read as a folder only if no operator has that name. ``kind`` ("operator" or
    "sampler") restricts the names searched to that kind and is the kind a folder is read as (None: any kind
    by name; a folder's kind from its location, see :func:`load_record`). Errors start with the kind's name.
    """
    label = kind or "operator"
    if not isinstance(name_or_dir, str | Path):
        raise ValueError(f"{label}: must be a name or a folder path, got {type(name_or_dir).__name__}")
    if isinstance(name_or_dir, Path) or os.sep in name_or_dir or (os.altsep and os.altsep in name_or_dir):
        return load_record(name_or_dir, kind)
    records = _registered(dirs, kind)
    for rec in records:
        if rec.name == name_or_dir:
            return rec
    if Path(name_or_dir).is_dir():
        return load_record(name_or_dir, kind)
    raise ValueError(f"{label}: unknown {label} {name_or_dir!r}; available: {[r.name for r in records]}")


def _registered(dirs: Iterable[str | Path] | None, kind: Kind | None) -> list[OperatorRecord]:
    return [r for r in list_operators(default_dirs() if dirs is None else dirs) if kind in (None, r.kind)]


def resolve_name(name: object, dirs: Iterable[str | Path] | None = None, kind: Kind | None = None) -> OperatorRecord:
    """A registered name only — what a request to the service may give (:func:`resolve` also reads folders,
    for the CLI and training on the operator's own machine).

    Only a name of the registry's form ``<family>-d<d>-v<k>`` (:data:`NAME_RE`) is looked up, among the folders
    listed in ``dirs``; nothing is built from it, so no path is ever touched. Anything else — a path, ``..``, a
    name with ``/`` or ``\\``, ``~`` or a leading ``.`` — is refused with one fixed message that does not repeat
    it, so the answer is the same whether or not such a path exists. Errors start with the kind's name.
    """
    label = kind or "operator"
    if not (isinstance(name, str) and NAME_RE.match(name)):
        raise ValueError(
            f"{label}: expected a registered {label} name <family>-d<d>-v<k> (e.g. gpvi-d2-v1); paths and other "
            "names are not accepted"
        )
    records = _registered(dirs, kind)
    for rec in records:
        if rec.name == name:
            return rec
    raise ValueError(f"{label}: unknown {label} {name!r}; available: {[r.name for r in records]}")


# ---- saving ----------------------------------------------------------------------------------------------


def _next_name(root: Path, family: str, d: int) -> str:
    """``<family>-d<d>-v<k+1>`` for the largest existing k (0 when none): versions are never reused."""
    prefix = f"{family}-d{d}-v"
    names = [p.name for p in root.iterdir()] if root.is_dir() else []
    versions = [_parse_name(n)[2] for n in names if n.startswith(prefix) and NAME_RE.match(n)]
    return f"{prefix}{max(versions, default=0) + 1}"


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (folders: best effort, not every OS allows opening them)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file of contiguous, detached CPU copies (safetensors refuses shared/strided storage)."""
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}, str(path))


def save_operator(
    folder_root: str | Path,
    name: str | None,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    metrics: dict[str, Any],
    readme: str,
    *,
    overwrite: bool = False,
) -> OperatorRecord:
    """Write ``folder_root/<name>/`` atomically and return its record (as :func:`load_record` reads it).

    ``name=None`` picks the next version ``<family>-d<state_dim>-v<k>``. ``config`` needs family, state_dim,
    obs_dim, architecture; ``created`` (UTC now) is added when absent; the caller's dict is not changed.
    The folder is built in a hidden temp dir inside ``folder_root`` and renamed into place, so a crash
    leaves either no folder or a whole one. An existing folder raises FileExistsError unless
    ``overwrite``; then the old folder is moved aside, the new one renamed in, and the old one removed.
    Save samplers with ``folder_root = <root>/samplers``.
    """
    _check_config(config)
    _check_json("config", config)
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics: must be a dict, got {type(metrics).__name__}")
    _check_json("metrics", metrics)
    if not (isinstance(readme, str) and readme.strip()):
        raise ValueError("readme: must describe how it was trained (the exact command)")
    if not (isinstance(state_dict, dict) and state_dict):
        raise ValueError("state_dict: must be a non-empty dict of tensors")
    for key, value in state_dict.items():
        if not (isinstance(key, str) and isinstance(value, torch.Tensor)):
            raise ValueError(f"state_dict: entry {key!r} must map a string to a tensor")
    root = Path(folder_root)
    family, d = config["family"], config["state_dim"]
    if name is None:
        name = _next_name(root, family, d)
    elif _parse_name(name)[:2] != (family, d):
        raise ValueError(f"name: {name!r} disagrees with config (family {family!r}, state_dim {d})")
    config = dict(config)
    config.setdefault("created", datetime.now(UTC).isoformat(timespec="seconds"))
    final = root / name
    if final.exists() and not overwrite:
        raise FileExistsError(f"name: {final} already exists; pass overwrite=True to replace it")

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    old: Path | None = None
    try:
        for file, obj in ((CONFIG_FILE, config), (METRICS_FILE, metrics)):
            (tmp / file).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / README_FILE).write_text(readme if readme.endswith("\n") else readme + "\n", encoding="utf-8")
        _write_weights(state_dict, tmp / WEIGHTS_FILE)
        for f in tmp.iterdir():
            f.chmod(0o644)  # mkstemp-style 0600/0700 would hide the folder from a service running as another user
            _fsync(f)
        tmp.chmod(0o755)
        _fsync(tmp)
        if final.exists():
            if not overwrite:  # appeared while we were writing
                raise FileExistsError(f"name: {final} already exists; pass overwrite=True to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
            os.replace(final, old / name)
        os.rename(tmp, final)  # atomic on one filesystem; fails if another writer created `final` meanwhile
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / name).exists() and not final.exists():
            os.replace(old / name, final)  # put the previous version back
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return load_record(final, "sampler" if root.name == SAMPLERS_DIR else "operator")


def save_sampler(
    root: str | Path,
    name: str | None,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    metrics: dict[str, Any],
    readme: str,
    *,
    overwrite: bool = False,
) -> OperatorRecord:
    """Write a sampler to ``root/samplers/<name>/``: :func:`save_operator` with ``folder_root = root/samplers``.

    ``root`` is a registry root (e.g. a folder of ``MPFLOW_OPERATOR_DIRS``). The config's family, state_dim,
    obs_dim and architecture default to the sampler mapping of the module docstring (``family ← kind``,
    ``state_dim ← dim``, ``obs_dim ← 0``, ``architecture ← kind``) and are written out explicitly, so a GPVI
    config from :class:`~mpflow.operators.samplers.gpvi.GPVIConfig` can be passed as it is. Returns the sampler's
    record.
    """
    if not isinstance(config, dict):
        raise ValueError(f"config: must be a JSON object, got {type(config).__name__}")
    view = _sampler_view(config)
    return save_operator(Path(root) / SAMPLERS_DIR, name, view, state_dict, metrics, readme, overwrite=overwrite)


__all__ = [
    "OperatorRecord",
    "RegistryWarning",
    "content_hash",
    "default_dirs",
    "list_operators",
    "load_record",
    "load_weights",
    "resolve",
    "save_operator",
    "save_sampler",
]
