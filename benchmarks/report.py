"""Reporting shared by all benchmarks (``python -m benchmarks.<name>``: engine, mpf_latency, reliability, …).

One command line (:func:`parser`: ``--quick`` and ``--out``), markdown tables (:func:`markdown_table`), the
machine's metadata (:func:`machine_meta`), a figure drawn off-screen (:func:`figure`) and the outputs written side
by side (:func:`write_outputs`: ``<stem>.json`` and ``<stem>.png``).

Where results go (:func:`out_stem`): ``--out STEM`` when given; else ``benchmarks/results/<name>``, and with
``--quick`` ``benchmarks/results/<name>-quick`` — git-ignored (``benchmarks/results/*-quick.*``), so a quick run
never overwrites the tracked results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_SUFFIX = "-quick"
DPI = 110


def parser(name: str, doc: str, quick_help: str) -> argparse.ArgumentParser:
    """``python -m benchmarks.<name>``'s parser with the common options ``--quick`` and ``--out``; the first line
    of ``doc`` (the module docstring) is its description."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.strip().split("\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output path without suffix (default benchmarks/results/{name}; "
        f"{name}{QUICK_SUFFIX} with --quick, git-ignored)",
    )
    return p


def out_stem(args: argparse.Namespace, name: str) -> Path:
    """The output path without suffix: ``args.out`` (a ``.json`` or ``.png`` suffix dropped), else
    ``RESULTS/<name>`` or, with ``args.quick``, ``RESULTS/<name>-quick``."""
    if args.out is not None:
        out = Path(args.out)
        return out.with_suffix("") if out.suffix in (".json", ".png") else out
    return RESULTS / (name + (QUICK_SUFFIX if args.quick else ""))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align``: one letter per column, ``l`` (default) or ``r``."""
    align = align or "l" * len(header)
    if len(align) != len(header):
        raise ValueError(f"align: one letter per column ({len(header)}), got {align!r}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_meta(load_before: Sequence[float]) -> dict[str, Any]:
    """What a benchmark's JSON records of the machine: cores, load average before and after, versions."""
    import torch  # only for its version: a load generator itself never needs it

    return {
        "machine_cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


@contextlib.contextmanager
def figure(path: Path, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*args, **kwargs)`` on the off-screen Agg backend: yields (figure, axes); on leaving, saves the
    figure to ``path`` (PNG, :data:`DPI`) and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def write_json(result: Any, path: Path, indent: int = 2) -> Path:
    """``result`` as strict JSON (no NaN or infinity) in ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, allow_nan=False) + "\n")
    return path


def write_outputs(result: Any, stem: Path, plot: Callable[[Path], None] | None = None, indent: int = 2) -> list[Path]:
    """``<stem>.json`` and, when ``plot`` is given, ``<stem>.png`` (``plot(path)`` draws it); says where on stdout."""
    paths = [write_json(result, stem.with_name(stem.name + ".json"), indent)]
    if plot is not None:
        paths.append(stem.with_name(stem.name + ".png"))
        plot(paths[-1])
    print(f"\nwrote {' and '.join(str(p) for p in paths)}")
    return paths
