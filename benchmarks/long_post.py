"""A long request at in-process speed: ``python -m benchmarks.long_post [--quick]``.

Two measurements, in one run, on one machine (ratios taken within the run; docs/benchmarks.md "Long requests"):

1. **A 1000-observation POST against the same steps in-process**, for a 1-D ``lds`` stream run by ``kalman``,
   ``smc`` (N = 256): the wall time of one ``POST /v1/streams/{id}/observations`` carrying 1000
   observations (the client's view: HTTP, validation, the steps, their per-step summaries, the store's write,
   the JSON answer) against

   * *bare*: the same 1000 ``updater.update`` calls in a loop, nothing else (the floor: no summaries at all);
   * *in-process*: the service's own creation and stepping without HTTP or a store, per-step estimates included
     (:func:`mpflow.cli.filter_data.filter_in_process`, what ``mpflow filter --data`` runs by default).

   The goal (issue 36): POST ≤ 1.5 × bare.
2. **A 5000-row CSV through ``mpflow filter --data``**, in-process and through the server (``--server``,
   requests of 1000 steps), reading the file and writing the estimates included (the command's work without the
   interpreter's start-up), for the 1-D ``kalman`` stream.

The server is uvicorn in a thread of this process (:func:`tests.harness.server.serve_in_thread`: real HTTP, real
Redis at ``--redis-url``, by default the local one). Each timing is the median of ``--repeats`` runs; the kinds
run one after the other within a repeat, in a rotated order, so that a change of the machine's load hits them
alike, and each ratio is the median of the repeats' ratios. Results: a table on stdout,
``benchmarks/results/long_post.json`` and ``.png``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import report
from mpflow.cli import filter_data

NAME = "long_post"
OBSERVATIONS = 1000
FILE_ROWS = 5000
PARTICLES = 256
METHODS = ("kalman", "smc")
MODEL = {"family": "lds", "params": {"A": [[0.9]], "B": [[1.0]], "R": [[0.5]]}}
PRIOR = {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]}


def body(method: str) -> dict[str, Any]:
    out = {"model": MODEL, "prior": PRIOR, "method": method, "seed": 1}
    if method != "kalman":
        out["num_particles"] = PARTICLES
    return out


def simulated(n: int, seed: int) -> np.ndarray:
    """n observations of the 1-D model (x' = 0.9 x + N(0, 1), y = x + N(0, 0.5))."""
    rng = np.random.default_rng(seed)
    x, out = 0.0, np.empty(n)
    for i in range(n):
        x = 0.9 * x + rng.normal()
        out[i] = x + rng.normal(scale=np.sqrt(0.5))
    return out


def bare_loop(method: str, obs: list[list[float]]) -> float:
    """Seconds of the ``updater.update`` calls alone, from a stream created as the service creates it."""
    from mpflow.service.engine.catalogue import OperatorCatalogue
    from mpflow.service.engine.methods import Methods
    from mpflow.service.engine.stepping import parse
    from mpflow.service.schemas import CreateStreamRequest
    from mpflow.service.settings import Settings
    from mpflow.service.streams import creation

    settings = Settings()
    methods = Methods(settings, OperatorCatalogue(settings.operator_dir_list))
    meta, state, _ = creation.prepare(settings, methods, CreateStreamRequest.model_validate(body(method)))
    model, updater = methods.resolve(meta)
    steps = parse(model, obs)
    t0 = time.perf_counter()
    for o, m in steps:
        state, _ = updater.update(state, o[None], m)
    return time.perf_counter() - t0


def in_process(method: str, obs: list[list[float]]) -> float:
    """Seconds of the steps (parsing and stepping, estimates included) in ``mpflow filter --data``'s in-process
    path; the stream's creation left out."""
    return filter_data.filter_in_process(body(method), obs, OBSERVATIONS, lambda n: None).seconds


def one_post(url: str, method: str, obs: list[list[float]]) -> float:
    from mpflow.service.client import Client

    with Client(url, timeout=600) as client:
        b = body(method)
        stream = client.create_stream(
            b["model"], b["prior"], method=method, seed=1, num_particles=b.get("num_particles")
        )
        stream.update(obs[:1])  # the first update loads what a stream's method needs
        t0 = time.perf_counter()
        answer = stream.update(obs[1:] + obs[:1], seq=2)
        elapsed = time.perf_counter() - t0
        assert len(answer["per_step"]) == len(obs)
        stream.delete()
    return elapsed


def file_run(data: Path, model: Path, out: Path, server: str | None) -> float:
    """``mpflow filter --data`` in this process (parsing, reading, filtering, writing), in seconds."""
    from mpflow.cli.main import main

    args = ["filter", "--quiet", "--data", str(data), "--model", str(model), "--out", str(out)]
    t0 = time.perf_counter()
    code = main(args + (["--server", server] if server else []))
    elapsed = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"mpflow filter --data failed ({code})")
    return elapsed


def main() -> None:
    import json
    import tempfile

    from mpflow.service.settings import Settings

    from tests.harness.server import drop_prefix, serve_in_thread

    p = report.parser(NAME, __doc__, "one repeat of each timing (default 3)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--redis-url", default=os.environ.get("MPFLOW_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(1)
    load = os.getloadavg()
    obs = [[float(v)] for v in simulated(OBSERVATIONS, 0)]
    prefix = f"mpflowbench-{uuid.uuid4().hex}"
    settings = Settings(redis_url=args.redis_url, redis_prefix=prefix, log_level="WARNING")
    times: dict[str, dict[str, list[float]]] = {m: {"bare": [], "in_process": [], "post": []} for m in METHODS}
    file_times: dict[str, list[float]] = {"in_process": [], "server": []}
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(settings) as url:
        folder = Path(tmp)
        data, model = folder / "readings.csv", folder / "model.json"
        values = simulated(FILE_ROWS, 1)
        values[::50] = np.nan  # a missing reading every 50 rows
        with data.open("w") as f:
            f.write("y\n" + "\n".join("" if np.isnan(v) else f"{v:.6f}" for v in values) + "\n")
        model.write_text(json.dumps(body("kalman")))
        kinds = {"bare": bare_loop, "in_process": in_process, "post": lambda m, o: one_post(url, m, o)}
        order = list(kinds)
        for r in range(repeats):
            for method in METHODS:
                for kind in order[r % 3 :] + order[: r % 3]:
                    times[method][kind].append(kinds[kind](method, obs))
                print(
                    f"repeat {r + 1}/{repeats} {method}: "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times[method].items())
                )
            for where in ("in_process", "server")[:: 1 if r % 2 == 0 else -1]:
                server = url if where == "server" else None
                file_times[where].append(file_run(data, model, folder / f"{where}.csv", server))
            print(f"repeat {r + 1}/{repeats} file: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in file_times.items()))
    asyncio.run(drop_prefix(args.redis_url, prefix))

    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}

    def ratio(m: str, over: str) -> float:
        return statistics.median(p / b for p, b in zip(times[m]["post"], times[m][over], strict=True))

    rows = [
        (
            m,
            f"{med[m]['bare']:.2f}",
            f"{med[m]['in_process']:.2f}",
            f"{med[m]['post']:.2f}",
            f"{ratio(m, 'bare'):.2f}",
            f"{ratio(m, 'in_process'):.2f}",
        )
        for m in METHODS
    ]
    print(
        f"\n{OBSERVATIONS} observations of a 1-D lds stream (N = {PARTICLES} for the particle methods), "
        f"median of {repeats}:"
    )
    header = ["method", "bare updates (s)", "in-process (s)", "one POST (s)", "POST / bare", "POST / in-process"]
    print(report.markdown_table(header, rows, "lrrrrr"))
    fmed = {k: statistics.median(v) for k, v in file_times.items()}
    fratio = statistics.median(s / i for s, i in zip(file_times["server"], file_times["in_process"], strict=True))
    print(f"\n{FILE_ROWS}-row CSV through mpflow filter --data (kalman), median of {repeats}:")
    print(
        report.markdown_table(
            ["in-process (s)", "through a server (s)", "server / in-process"],
            [(f"{fmed['in_process']:.2f}", f"{fmed['server']:.2f}", f"{fratio:.2f}")],
            "rrr",
        )
    )
    result = {
        "observations": OBSERVATIONS,
        "particles": PARTICLES,
        "repeats": repeats,
        "seconds": times,
        "median_seconds": med,
        "post_over_bare": {m: ratio(m, "bare") for m in METHODS},
        "post_over_in_process": {m: ratio(m, "in_process") for m in METHODS},
        "file": {"rows": FILE_ROWS, "seconds": file_times, "median_seconds": fmed, "server_over_in_process": fratio},
        "machine": report.machine_meta(load),
    }

    def plot(path: Path) -> None:
        with report.figure(path, 1, 2, figsize=(11, 4)) as (fig, (ax, bx)):
            x = np.arange(len(METHODS))
            for k, (kind, label) in enumerate(
                [("bare", "bare updates"), ("in_process", "in-process (estimates)"), ("post", "one POST")]
            ):
                ax.bar(x + (k - 1) * 0.27, [med[m][kind] for m in METHODS], 0.27, label=label)
            ax.set_xticks(x, METHODS)
            ax.set_ylabel("seconds")
            ax.set_title(f"{OBSERVATIONS} observations, one request vs in-process")
            ax.legend(fontsize=8)
            bx.bar(["in-process", "through a server"], [fmed["in_process"], fmed["server"]], color=["C1", "C2"])
            bx.set_ylabel("seconds")
            bx.set_title(f"{FILE_ROWS}-row CSV, mpflow filter --data (kalman)")
            fig.tight_layout()

    report.write_outputs(result, report.out_stem(args, NAME), plot)


if __name__ == "__main__":
    main()
