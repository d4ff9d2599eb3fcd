"""The package's structure in numbers: lines per package, and the modules an observation POST runs code in.

``python -m benchmarks.structure`` prints two tables and writes ``benchmarks/results/structure.json``:

* per package (``mpflow.client``, ``mpflow.cli``, ``mpflow.operators``, ``mpflow.training``, ``mpflow.service``):
  modules and lines of source, and the same per part of the service (``api``, ``streams``, ``engine``, ``store``,
  ``dashboard``, the shared modules at its top);
* one ``POST /v1/streams/{id}/observations`` (one ``lds`` step, ``smc``, N = 64) against the app in this process and
  a real Redis (``MPFLOW_REDIS_URL``, else 127.0.0.1:6379; keys under a fresh prefix, dropped afterwards): the mpflow
  modules whose functions ran while it was answered (``sys.setprofile`` on the event loop's thread and on the
  engine's worker threads), by package, and the number of module-to-module transitions (a call whose caller is in
  another mpflow module), counted on the second request (the first loads the caches).

* the touch lists of :data:`TOUCH_LISTS`: the service files a change touches in the layout before the service was
  grouped by concern (commit 55d44a1, a flat ``service/``) and now — counted from the code of a real change
  (``GET .../smoothed``, commit 105e622) and checked here to name files that exist now.

A structural measurement, not a timing: it depends on the code only (docs/DESIGN.md "Package layout").
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from mpflow.service.settings import Settings

from benchmarks.report import markdown_table, out_stem, parser, write_outputs
from tests.harness.server import drop_prefix, serve_in_process

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "mpflow.client": "mpflow/client",
    "mpflow.cli": "mpflow/cli",
    "mpflow.operators": "operators",
    "mpflow.training": "training",
    "mpflow.service": "service",
}
#: the service files a change touches, in the flat layout of commit 55d44a1 ("before") and now ("after"); docs/API.md
#: and a test are touched as well in both. The endpoint is GET .../smoothed as commit 105e622 added it (its route,
#: the StreamService wiring and forwarding method, the module of the work, its response model and its price).
TOUCH_LISTS = {
    "a read endpoint of an existing resource (GET .../smoothed)": {
        "before": [
            "service/routes.py",
            "service/streams.py",
            "service/smoothed.py",
            "service/schemas.py",
            "service/costs.py",
        ],
        "after": [
            "service/api/reads.py",
            "service/streams/service.py",
            "service/streams/smoothed.py",
            "service/schemas.py",
            "service/streams/costs.py",
        ],
    },
    "a new resource (its own router)": {
        "before": ["service/routes.py"],
        "after": ["service/api/<resource>.py (new)", "service/api/__init__.py"],
    },
    "a dependency the stream service's parts share": {
        "before": [
            "service/streams.py",
            "service/observations.py",
            "service/forecasts.py",
            "service/smoothed.py",
            "service/snapshots.py",
        ],
        "after": ["service/streams/deps.py", "service/streams/service.py"],
    },
    "an app object a handler needs (it reads app.state before, names a dependency after)": {
        "before": ["service/app.py", "service/routes.py"],
        "after": ["service/app.py", "service/api/deps.py", "service/api/<resource>.py"],
    },
}
MODEL = {"family": "lds", "params": {"A": [[0.9, 0.1], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}


def line_counts() -> dict[str, dict[str, int]]:
    out = {}
    for package, folder in PACKAGES.items():
        files = sorted((ROOT / folder).rglob("*.py"))
        out[package] = {"modules": len(files), "lines": sum(len(f.read_text().splitlines()) for f in files)}
    return out


def service_parts() -> dict[str, dict[str, int]]:
    """Modules and lines per part of ``service/``: each sub-folder, and the modules at its top."""
    out: dict[str, dict[str, int]] = {}
    for f in sorted((ROOT / "service").rglob("*.py")):
        parts = f.relative_to(ROOT / "service").parts
        part = "mpflow.service." + parts[0] if len(parts) > 1 else "mpflow.service (top)"
        entry = out.setdefault(part, {"modules": 0, "lines": 0})
        entry["modules"] += 1
        entry["lines"] += len(f.read_text().splitlines())
    return out


def touch_lists() -> dict[str, dict[str, list[str]]]:
    """:data:`TOUCH_LISTS`, each "after" file checked to exist (a new file stands for itself)."""
    for lists in TOUCH_LISTS.values():
        for name in lists["after"]:
            assert "<" in name or (ROOT / name).is_file(), f"{name}: the touch list names a file that is gone"
    return TOUCH_LISTS


class Crossings:
    """The mpflow modules whose code runs, and the calls from one mpflow module into another."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.transitions = 0
        self.pairs: Counter[tuple[str, str]] = Counter()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("mpflow."):
            return
        self.modules.add(module)
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith("mpflow."):
            caller = caller.f_back  # through the event loop, FastAPI, torch: the nearest mpflow caller
        source = caller.f_globals["__name__"] if caller is not None else None
        if source is not None and source != module:
            self.transitions += 1
            self.pairs[(source, module)] += 1

    def __enter__(self) -> Crossings:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


async def observation_post(redis_url: str) -> Crossings:
    prefix = f"mpflowbench-{uuid.uuid4().hex}"
    settings = Settings(redis_url=redis_url, redis_prefix=prefix)
    try:
        async with serve_in_process(settings) as (_, client):
            create = {"stream_id": "s", "model": MODEL, "prior": PRIOR, "method": "smc", "num_particles": 64}
            assert (await client.post("/v1/streams", json=create)).status_code == 201
            body = {"seq": 1, "observations": [[0.3, -0.2]]}
            assert (await client.post("/v1/streams/s/observations", json=body)).status_code == 200
            with Crossings() as crossed:
                body = {"seq": 2, "observations": [[0.1, 0.4]]}
                assert (await client.post("/v1/streams/s/observations", json=body)).status_code == 200
            return crossed
    finally:
        await drop_prefix(redis_url, prefix)


def main() -> None:
    args = parser("structure", __doc__, "the same measurement (it is quick)").parse_args()
    lines = line_counts()
    print(markdown_table(["package", "modules", "lines"], [[p, c["modules"], c["lines"]] for p, c in lines.items()]))
    parts = service_parts()
    print()
    print(
        markdown_table(["service part", "modules", "lines"], [[p, c["modules"], c["lines"]] for p, c in parts.items()])
    )
    touches = touch_lists()
    print()
    rows = [[change, len(t["before"]), len(t["after"]), ", ".join(t["after"])] for change, t in touches.items()]
    print(markdown_table(["change", "service files before", "after", "files after"], rows))
    crossed = asyncio.run(observation_post(os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0"))
    by_package = Counter(".".join(m.split(".")[:2]) for m in crossed.modules)
    print(
        f"\nPOST .../observations ran code in {len(crossed.modules)} mpflow modules, "
        f"{crossed.transitions} calls from one mpflow module into another:\n"
    )
    print(markdown_table(["package", "modules run"], sorted(by_package.items())))
    by_part = Counter(".".join(m.split(".")[:3]) for m in crossed.modules if m.startswith("mpflow.service."))
    print()
    print(markdown_table(["service part", "modules run"], sorted(by_part.items())))
    result = {
        "lines": lines,
        "service_parts": parts,
        "touch_lists": touches,
        "observation_post": {
            "modules": sorted(crossed.modules),
            "by_package": dict(by_package),
            "by_service_part": dict(by_part),
            "transitions": crossed.transitions,
            "distinct_module_pairs": len(crossed.pairs),
        },
    }
    write_outputs(result, out_stem(args, "structure"))


if __name__ == "__main__":
    main()
