"""How far a model family's and a method's names reach: the files that name each, at two commits.

``python -m benchmarks.touch_list [--base REF] [--head REF]`` (defaults: ``main`` and ``HEAD``) prints, for each
built-in family and each registered method, the files that name it as a word (``git grep -w``) at both commits, by
area, and writes ``benchmarks/results/touch_list.json``:

* **package** — the library's own code: ``operators/`` (without ``pretrained/``, the shipped operators' data),
  ``training/``, ``service/``, ``mpflow/``, and the build files ``pyproject.toml``, ``setup.py``;
* **docs** — ``README.md`` and ``docs/``;
* **tests** and **benchmarks** (without ``benchmarks/results/``).

A family's or a method's name in a file means that file knows something about it, so the package count is the
touch list of adding one like it: the files a new one of its kind would edit. The lists are printed, so a count can
be read back to what it counts. A structural measurement from the code at each commit (no timing).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from mpflow.operators.models.plugins import CATALOGUE_ORDER
from mpflow.operators.updaters import UPDATERS

from benchmarks.report import markdown_table, out_stem, parser, write_outputs

ROOT = Path(__file__).resolve().parents[1]
AREAS = {
    "package": ["operators", "training", "service", "mpflow", "pyproject.toml", "setup.py", ":!operators/pretrained"],
    "docs": ["README.md", "docs"],
    "tests": ["tests"],
    "benchmarks": ["benchmarks", ":!benchmarks/results"],
}


def naming(word: str, ref: str, paths: list[str]) -> list[str]:
    """The files under ``paths`` at commit ``ref`` that contain ``word`` as a whole word."""
    cmd = ["git", "grep", "-l", "-w", "-F", word, ref, "--", *paths]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):  # 1: no match
        raise RuntimeError(out.stderr.strip())
    return sorted(line.split(":", 1)[1] for line in out.stdout.splitlines())


def reach(word: str, ref: str) -> dict[str, list[str]]:
    return {area: naming(word, ref, paths) for area, paths in AREAS.items()}


def main() -> None:
    p = parser("touch_list", __doc__, "the same measurement (it is quick)")
    p.add_argument("--base", default="main", help="the commit before (default: main)")
    p.add_argument("--head", default="HEAD", help="the commit after (default: HEAD)")
    args = p.parse_args()
    kinds = {"family": list(CATALOGUE_ORDER), "method": sorted(UPDATERS)}
    result: dict[str, Any] = {"base": args.base, "head": args.head}
    for kind, names in kinds.items():
        rows, found = [], {}
        for name in names:
            before, after = reach(name, args.base), reach(name, args.head)
            found[name] = {"before": before, "after": after}
            rows.append([name, *(f"{len(before[a])} → {len(after[a])}" for a in AREAS)])
        print(f"\nfiles naming each {kind}, {args.base} → {args.head}:\n")
        print(markdown_table([kind, *AREAS], rows))
        for name, lists in found.items():
            print(f"\n{name}, package files at {args.head}: {', '.join(lists['after']['package'])}")
        result[kind] = found
    write_outputs(result, out_stem(args, "touch_list"))


if __name__ == "__main__":
    main()
