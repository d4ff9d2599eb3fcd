"""The command line shared by the trainers of learned observers (``observer_train``, ``param_observer_train``): train
into ``--out``, print the summary, and with ``--register ROOT --name NAME`` write the registry folder of the kept
``observer.pt`` (its README ``--readme``, or one naming the command)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_register_arguments(p: argparse.ArgumentParser, name_help: str) -> None:
    """``--register ROOT``, ``--name NAME`` (``name_help``: its form) and ``--readme``."""
    p.add_argument(
        "--register", default=None, metavar="ROOT", help="write the registry folder ROOT/NAME after training"
    )
    p.add_argument("--name", default=None, help=f"{name_help} (with --register)")
    p.add_argument("--readme", default=None, help="README.md to ship with --register (default: this command)")


def main(
    parser: Callable[[], argparse.ArgumentParser],
    train: Callable[[argparse.Namespace], dict[str, Any]],
    register: Callable[..., Any],
    argv: list[str] | None = None,
) -> int:
    """Parse ``argv``, train, print the summary as JSON and register ``--out``/observer.pt when asked."""
    args = parser().parse_args(argv)
    if (args.register is None) != (args.name is None):
        parser().error("--register and --name go together")
    print(json.dumps(train(args)))
    if args.register:
        readme = Path(args.readme).read_text(encoding="utf-8") if args.readme else None
        record = register(Path(args.out) / "observer.pt", args.register, args.name, readme)
        print(json.dumps({"name": record.name, "path": str(record.path), "content_hash": record.content_hash}))
    return 0
