"""Register a trained ring correction after ``ienkf`` as an operator that a stream names:
``python -m mpflow.training.ring_export RING_PT --root DIR --name lorenz96-d40-vK [--readme FILE] [--metrics FILE]``.

Reads a ``ring.pt`` of :mod:`mpflow.training.ring_train` trained with ``--arch correction --base ienkf`` and writes the
registry folder ``DIR/NAME/`` (:func:`mpflow.operators.registry.save_operator`): ``config.json`` with
``architecture = {"kind": "ring_correction", <the network's arguments>}``, the base it corrects (``ienkf`` with
``iterations`` and ρ by :func:`mpflow.operators.updaters.ienkf.lorenz96_inflation`), the task distribution as its
``domain`` and ``"auto_select": false`` (an ``mpf`` stream never picks it: :func:`~mpflow.operators.updaters.mpf.
find_operator` skips a ring correction); the weights (safetensors); ``metrics.json`` and ``README.md`` from the
given files (else the training's best validation and a README naming the training command). A stream uses it as
``{"method": "ienkf", "method_options": {"correction": NAME}}``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from mpflow.operators import registry
from mpflow.operators.mpf.ring_correction import ARCHITECTURE_KIND
from mpflow.training import ring_train


def correction_config(payload: dict[str, Any], d: int) -> dict[str, Any]:
    """The registry ``config.json`` of a ``ring.pt`` payload for a ring of d sites (every second one observed at
    training's validation: ``obs_dim`` d / 2, informational — the network is local and serves any d and stride)."""
    if payload.get("arch") != "correction" or payload.get("base", {}).get("method") != "ienkf":
        raise ValueError("ring.pt: not a correction after ienkf (train with --arch correction --base ienkf)")
    training = payload["training"]
    return {
        "family": "lorenz96",
        "state_dim": d,
        "obs_dim": d // 2,
        "architecture": {"kind": ARCHITECTURE_KIND, **payload["config"]},
        "base": payload["base"],
        "auto_select": False,
        "auto_select_note": "a correction after ienkf: a stream names it as method_options.correction",
        "domain": ring_train.task_domain(),
        "training": {k: _json_value(v) for k, v in training.items() if isinstance(v, int | float | str | bool | None)},
    }


def _json_value(v: Any) -> Any:
    """A training option or figure as JSON holds it: a non-finite float (no bar, no θ kept) as None."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def export(ring_pt: str | Path, root: str | Path, name: str, readme: str, metrics: dict[str, Any]):
    """Write ``root/name/`` from ``ring_pt`` → its :class:`~mpflow.operators.registry.OperatorRecord`."""
    payload = torch.load(ring_pt, map_location="cpu", weights_only=True)
    d = int(payload["training"]["dim"])
    state = {k: v.to(torch.float32).contiguous() for k, v in payload["state"].items()}
    return registry.save_operator(root, name, correction_config(payload, d), state, metrics, readme, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ring_pt", help="a ring.pt of mpflow.training.ring_train (--arch correction --base ienkf)")
    p.add_argument("--root", required=True, help="the operator folder to write NAME into")
    p.add_argument("--name", required=True, help="lorenz96-d<d>-v<k>: a version no other operator dir holds")
    p.add_argument("--readme", default=None, help="README.md to ship (default: the training command)")
    p.add_argument("--metrics", default=None, help="metrics.json to ship (default: the best validation)")
    args = p.parse_args(argv)
    payload = torch.load(args.ring_pt, map_location="cpu", weights_only=True)
    training = payload["training"]
    if args.readme:
        readme = Path(args.readme).read_text(encoding="utf-8")
    else:
        readme = f"# {args.name}\n\nTrained by `python -m mpflow.training.ring_train` with {json.dumps(training)}.\n"
    if args.metrics:
        metrics = json.loads(Path(args.metrics).read_text(encoding="utf-8"))
    else:
        metrics = {"best_spantini_val_rmse": training["best_spantini_val_rmse"]}
    record = export(args.ring_pt, args.root, args.name, readme, metrics)
    print(json.dumps({"name": record.name, "path": str(record.path), "content_hash": record.content_hash}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
