"""``mpflow filter --data FILE --model model.json``: filter a CSV or Parquet file, in-process or through a server.

The model file is the body of ``POST /v1/streams`` (docs/API.md): ``{"model": {"family", "params"}, "prior": {...},
"method", "num_particles", "seed", "method_options", "state_names", ...}``. It is validated by the service's own
request schema (:class:`~mpflow.service.schemas.CreateStreamRequest`) and, in-process, by the service's own stream
creation (:func:`mpflow.service.streams.creation.prepare`): a file accepted here is accepted by a server, and a stream
created here is the one a server would create (the same method, particles and seed give the same numbers).

The data file (``.csv``, ``.csv.gz``, ``.tsv`` or ``.parquet``/``.pq``): one row per step; the observation
columns are ``--columns`` (names, in the order of the family's observation) or else every column but ``dt`` and
the ``--inputs`` columns; a column ``dt`` is each step's time since the previous one; ``--inputs`` columns are
each step's control inputs ``u``. An empty cell is a missing entry; a row whose observation cells are all empty is
a step without a measurement. A cell that is not a number is refused naming its row (1-based, as a spreadsheet
numbers the data rows) and its column; so is a missing ``dt`` or input.

Times instead of durations: ``--time-column NAME`` names a column of timestamps — numbers (read as seconds, e.g.
Unix time) or dates and times pandas parses (``2024-01-01 00:05:00``, ISO 8601 with or without a zone; naive ones
all taken in one zone) — whose differences become each step's ``dt``, in seconds or in the ``--time-unit`` (``s``,
``ms``, ``min``, ``h``, ``d``): ``dt_m = (t_m − t_{m−1}) / unit``; the first step, which has no previous time, gets
the median of those differences (a typical step; one row alone gets no ``dt``). The timestamps must increase
strictly (a row whose time is not after the previous row's is refused, naming it), no cell may be empty, and the
file may not also have a ``dt`` column; the time column is not an observation column.

Running: in-process by default — the service's own stepping (:class:`~mpflow.service.engine.stepping.Stepper` on an
:class:`~mpflow.service.engine.update_engine.UpdateEngine`, its fall-backs included) without HTTP or a store; with
``--server URL``, a stream is created there and the rows sent ``--batch`` per request with ``seq`` (exactly once,
retried safely: :meth:`mpflow.service.client.Stream.filter`). Either way the answer is the ``per_step`` entries of the
observation answers, written one row per step by :func:`mpflow.client.frames.steps_frame` (``mean_<name>``,
``std_<name>``, ``q0.025_<name>``, ``q0.05_<name>``, ``q0.5_<name>``, ``q0.95_<name>``, ``q0.975_<name>``,
``log_evidence_increment`` (empty on a row with nothing observed: such a step has no score), ``ess``, ``pit_<j>``,
``pit_two_sided_<j>``, ``log_tail_lower_<j>`` and ``log_tail_upper_<j>`` per observed entry j, ``surprise``,
``anomaly_score`` and ``change_score`` (the step's surprise and change evidence ranked among the earlier steps' —
in-process as a server ranks them, the stream's ``anomaly_memory`` and ``anomaly_warmup`` from the model file; empty
during the warm-up), and any other
field a stream reports per step) to ``--out`` (CSV, or Parquet by its suffix;
stdout as CSV without it), and plotted with ``--plot``: each state dimension's mean and 95 % credible band (the
0.025 and 0.975 quantiles, the level the README, the dashboard and the examples draw) over the observations, and
the log-evidence increments (gaps where nothing was observed).

Bounds: at most :data:`MAX_ROWS` rows and :data:`MAX_COLUMNS` columns per file (a file is read whole into memory);
the server applies its own limits per request (``--batch`` at most its MPFLOW_MAX_OBSERVATIONS_PER_REQUEST).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the most rows (steps) one file may have
MAX_ROWS = 1_000_000
#: the most columns one file may have
MAX_COLUMNS = 256
#: steps per request through a server, and per in-process call of the stepper
DEFAULT_BATCH = 1000
#: the column read as each step's time since the previous one
DT_COLUMN = "dt"
#: ``--time-unit``: seconds per unit of the ``dt`` a ``--time-column`` gives
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "min": 60.0, "h": 3600.0, "d": 86400.0}
#: file suffixes read as Parquet; every other file is read as CSV (``.tsv``: tab-separated)
PARQUET_SUFFIXES = (".parquet", ".pq")


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ValueError("--data: reading data files needs pandas: pip install 'mpflow[files]'") from None
    return pandas


# ---------------------------------------------------------------------------------------------- the model file
def read_model(path: str) -> dict[str, Any]:
    """The model file as a ``POST /v1/streams`` body, checked against the service's request schema; ValueError
    naming the file and the field otherwise."""
    from pydantic import ValidationError

    from mpflow.service.schemas import CreateStreamRequest

    try:
        body = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--model: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(body, dict):
        raise ValueError(f"--model: {path} must hold a JSON object, the body of POST /v1/streams")
    try:
        CreateStreamRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the object)"
        raise ValueError(f"--model: {path}: {where}: {first['msg']}") from None
    return body


# ---------------------------------------------------------------------------------------------- the data file
def read_table(path: str) -> Any:
    """The data file as a DataFrame (CSV or Parquet by its suffix), within :data:`MAX_ROWS` × :data:`MAX_COLUMNS`."""
    pd = _pandas()
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data: no such file: {path}")
    try:
        if file.suffix.lower() in PARQUET_SUFFIXES:
            import pyarrow.parquet as pq

            shape = pq.ParquetFile(file).metadata  # the limits before reading: a Parquet file is read whole
            if shape.num_rows > MAX_ROWS or shape.num_columns > MAX_COLUMNS:
                raise ValueError(
                    f"--data: at most {MAX_ROWS} rows and {MAX_COLUMNS} columns per file, {path} has "
                    f"{shape.num_rows} rows and {shape.num_columns} columns"
                )
            frame = pd.read_parquet(file)
        else:
            sep = "\t" if file.name.lower().endswith((".tsv", ".tsv.gz")) else ","
            frame = pd.read_csv(file, sep=sep, nrows=MAX_ROWS + 1, skipinitialspace=True, skip_blank_lines=False)
    except ImportError as exc:
        need = "pip install 'mpflow[files]'"
        raise ValueError(f"--data: reading {file.suffix} files needs pyarrow: {need} ({exc})") from None
    except ValueError as exc:
        if str(exc).startswith("--data"):
            raise
        raise ValueError(f"--data: cannot read {path}: {exc}") from None
    except Exception as exc:  # pandas' and pyarrow's parser errors have no common base
        raise ValueError(f"--data: cannot read {path}: {exc}") from None
    if frame.shape[1] > MAX_COLUMNS:
        raise ValueError(f"--data: at most {MAX_COLUMNS} columns per file, {path} has {frame.shape[1]}")
    if len(frame) > MAX_ROWS:
        raise ValueError(f"--data: at most {MAX_ROWS} rows per file, {path} has more; split it")
    if len(frame) == 0:
        raise ValueError(f"--data: {path} has no data rows")
    frame.columns = [str(c).strip() for c in frame.columns]
    return frame


def _numbers(frame: Any, column: str, missing_ok: bool) -> list[float]:
    """A column as floats (empty cells NaN); ValueError naming the first cell that is not a number (row 1 is
    the first data row), or the first empty one when ``missing_ok`` is false."""
    pd = _pandas()
    raw = frame[column]
    values = pd.to_numeric(raw, errors="coerce")
    if not pd.api.types.is_numeric_dtype(raw):
        as_text = raw.astype(str).str.strip()
        blank = raw.isna() | (as_text == "")
        bad = values.isna() & ~blank
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise ValueError(f"--data: row {row + 1}, column {column!r}: {str(raw.iloc[row])[:40]!r} is not a number")
    floats = values.to_numpy(dtype=float, na_value=math.nan)
    if not missing_ok and pd.isna(values).any():
        row = int(pd.isna(values).to_numpy().argmax())
        raise ValueError(f"--data: row {row + 1}, column {column!r}: empty (a {column} cannot be missing)")
    infinite = [i for i, v in enumerate(floats) if math.isinf(v)]
    if infinite:
        raise ValueError(f"--data: row {infinite[0] + 1}, column {column!r}: infinite values are not observations")
    return floats.tolist()


def _present(frame: Any, names: Sequence[str], flag: str) -> None:
    missing = [c for c in names if c not in frame.columns]
    if missing:
        raise ValueError(f"{flag}: no column {missing[0]!r} in the data file (its columns: {list(frame.columns)})")


def time_steps(frame: Any, column: str, unit: str = "s") -> list[float]:
    """Each row's ``dt`` from the timestamps of ``column`` (module docstring): the differences in ``unit``
    (:data:`TIME_UNITS`), the first row's the median difference; ValueError naming the row of an empty or
    unreadable cell, or of a time not after the previous one."""
    from mpflow.client.observations import step_lengths

    pd = _pandas()
    if unit not in TIME_UNITS:
        raise ValueError(f"--time-unit: one of {list(TIME_UNITS)}, got {unit!r}")
    _present(frame, [column], "--time-column")
    raw = frame[column]
    blank = raw.isna() | (raw.astype(str).str.strip() == "")
    if blank.any():
        row = int(blank.to_numpy().argmax())
        raise ValueError(f"--time-column: row {row + 1}, column {column!r}: empty (every step needs its time)")
    numbers = pd.to_numeric(raw, errors="coerce")
    if not numbers.isna().any():
        seconds = numbers.to_numpy(dtype=float)
    else:
        try:
            times = pd.to_datetime(raw, errors="coerce", utc=True, format="mixed")
        except (TypeError, ValueError):
            times = pd.Series([pd.NaT] * len(raw))
        if times.isna().any():
            row = int(times.isna().to_numpy().argmax())
            cell = str(raw.iloc[row])[:40]
            raise ValueError(f"--time-column: row {row + 1}, column {column!r}: {cell!r} is not a time or a number")
        seconds = (times - times.iloc[0]).dt.total_seconds().to_numpy(dtype=float)
    if not all(math.isfinite(v) for v in seconds):
        raise ValueError(f"--time-column: column {column!r}: infinite times")
    steps = [d / TIME_UNITS[unit] for d in step_lengths(seconds)]
    bad = [i for i, d in enumerate(steps[1:]) if not d > 0]
    if bad:
        raise ValueError(
            f"--time-column: row {bad[0] + 2}, column {column!r}: its time is not after the previous row's "
            "(the times must increase)"
        )
    return steps


def table_steps(
    frame: Any,
    columns: Sequence[str] | None,
    inputs: Sequence[str],
    time_column: str | None = None,
    time_unit: str = "s",
) -> tuple[list[Any], list[str]]:
    """(the steps as ``POST .../observations`` items, the observation columns): a step is ``{"value": [...]}``
    with its ``dt`` and ``u`` where the file has them, NaN cells as ``None`` (missing entries); with
    ``time_column``, each step's ``dt`` from its timestamps (:func:`time_steps`)."""
    inputs = list(inputs)
    _present(frame, inputs, "--inputs")
    if time_column is not None and DT_COLUMN in frame.columns:
        raise ValueError(
            f"--time-column: the data file has a {DT_COLUMN!r} column too; give the steps one or the other"
        )
    if columns is None:
        columns = [c for c in frame.columns if c not in (DT_COLUMN, time_column) and c not in inputs]
    columns = list(columns)
    _present(frame, columns, "--columns")
    if not columns:
        raise ValueError("--columns: the data file has no observation column (every column is dt or an input)")
    values = list(zip(*(_numbers(frame, c, missing_ok=True) for c in columns), strict=True))
    dts = _numbers(frame, DT_COLUMN, missing_ok=False) if DT_COLUMN in frame.columns else None
    if time_column is not None:
        dts = time_steps(frame, time_column, time_unit) or None
    us = list(zip(*(_numbers(frame, c, missing_ok=False) for c in inputs), strict=True)) if inputs else None
    steps: list[Any] = []
    for i, row in enumerate(values):
        item: dict[str, Any] = {"value": [None if math.isnan(v) else v for v in row]}
        if dts is not None:
            item["dt"] = dts[i]
        if us is not None:
            item["u"] = list(us[i])
        steps.append(item)
    return steps, columns


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Filtered:
    """The ``per_step`` entries of every step, the names of the state's dimensions, and the seconds spent applying
    the steps (parsing them and stepping in-process; the observation requests through a server) — the stream's
    creation left out."""

    per_step: list[dict[str, Any]]
    names: list[str]
    seconds: float


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def filter_in_process(body: dict[str, Any], steps: Sequence[Any], batch: int, tick: Callable[[int], None]) -> Filtered:
    """The steps applied in this process by the service's own creation and stepping (module docstring)."""
    import asyncio

    return asyncio.run(_in_process(body, steps, batch, tick))


async def _in_process(body: dict[str, Any], steps: Sequence[Any], batch: int, tick: Callable[[int], None]) -> Filtered:
    from mpflow.service.engine import anomaly
    from mpflow.service.engine.catalogue import OperatorCatalogue
    from mpflow.service.engine.fallback import Fallbacks
    from mpflow.service.engine.methods import Methods
    from mpflow.service.engine.stepping import Stepper, parse, row_views
    from mpflow.service.engine.tensor_work import TensorWork
    from mpflow.service.engine.update_engine import UpdateEngine
    from mpflow.service.errors import ApiError
    from mpflow.service.results import state_names
    from mpflow.service.schemas import CreateStreamRequest
    from mpflow.service.settings import Settings
    from mpflow.service.streams import creation

    settings = Settings()
    operators = OperatorCatalogue(settings.operator_dir_list)
    operators.load()
    methods = Methods(settings, operators)
    engine = UpdateEngine(summarise=row_views, batching=False)
    await engine.start()
    try:
        work = TensorWork(engine)
        stepper = Stepper(engine, work, Fallbacks(methods, engine, work))
        try:
            meta, state, _ = creation.prepare(settings, methods, CreateStreamRequest.model_validate(body))
            model, updater = methods.resolve(meta)
            per_step: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            for start, chunk in zip(range(0, len(steps), batch), _chunks(steps, batch), strict=True):
                try:
                    parsed = parse(model, list(chunk))
                except ApiError as exc:  # "observations[i]: ..." → the file's row
                    raise ApiError(exc.status, exc.code, _row_message(exc.message, start)) from None
                with engine.expect(len(parsed)) as announced:
                    applied = await stepper.apply(meta, updater, state, parsed, 0, announced)
                state = applied.last.state
                meta.update(anomaly.scored(meta, applied.per_step))  # as a server scores them
                per_step += applied.per_step
                tick(len(chunk))
        except ApiError as exc:
            raise ValueError(_row_message(exc.message, 0)) from None
        return Filtered(per_step, state_names(meta, int(meta["state_dim"])), time.perf_counter() - t0)
    finally:
        await engine.stop()


def _row_message(message: str, start: int) -> str:
    """A service message naming ``observations[i]`` of a chunk starting at row ``start`` as the file's row."""
    import re

    return re.sub(r"observations\[(\d+)\](\.value)?", lambda m: f"row {start + int(m.group(1)) + 1}", message, count=1)


def filter_on_server(
    url: str, api_key: str | None, body: dict[str, Any], steps: Sequence[Any], batch: int, tick: Callable[[int], None]
) -> Filtered:
    """The steps sent to a new stream on the server at ``url`` (module docstring)."""
    from mpflow.service.client import Client, MpflowError
    from mpflow.service.results import state_names

    with Client(url, api_key=api_key, timeout=600) as client:
        try:
            stream = client.create_stream(**body)
            per_step: list[dict[str, Any]] = []
            names: list[str] = []
            t0 = time.perf_counter()
            for answer in stream.filter(list(steps), batch=batch, per_step_params=True):  # as in-process
                per_step += answer["per_step"]
                names = state_names(answer, len(answer["summary"]["mean"]))
                tick(len(answer["per_step"]))
        except MpflowError as exc:
            raise ValueError(f"--server {url}: {_row_message(str(exc), 0)}") from None
    return Filtered(per_step, names, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- output
def write_frame(frame: Any, out: str | None) -> None:
    """The estimates as CSV (stdout without ``out``) or Parquet (by ``out``'s suffix)."""
    if out is None:
        frame.to_csv(sys.stdout)
    elif Path(out).suffix.lower() in PARQUET_SUFFIXES:
        frame.to_parquet(out)
    else:
        frame.to_csv(out)


#: the quantile levels (as the API keys them) of ``--plot``'s band: the 95 % central credible interval
BAND = ("0.025", "0.975")


def plot(frame: Any, names: Sequence[str], observed: Any, columns: Sequence[str], path: str) -> None:
    """Each dimension's mean with its 95 % band (the 0.025 and 0.975 quantiles; with the observation columns of the
    same name, where the file has one), and the log-evidence increments, one panel each, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(10, 2.2 * (len(names) + 1)), sharex=True, squeeze=False)
    steps = frame.index.to_numpy()
    for ax, name in zip(axes[:-1, 0], names, strict=True):
        low, high = f"q{BAND[0]}_{name}", f"q{BAND[1]}_{name}"
        if low in frame and high in frame:
            ax.fill_between(steps, frame[low], frame[high], alpha=0.3, label="95 % band")
        ax.plot(steps, frame[f"mean_{name}"], lw=1, label="mean")
        if name in columns:
            ax.plot(steps, observed[name].to_numpy(), ".", ms=2, color="k", label="observed")
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].plot(steps, frame["log_evidence_increment"], lw=0.8)
    axes[-1, 0].set_ylabel("log-evidence\nincrement")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _progress(total: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=quiet, file=sys.stderr, desc="filtering")


def run(args: argparse.Namespace) -> int:
    """``mpflow filter --data``: read, filter, write (module docstring)."""
    from mpflow.client.frames import steps_frame

    if args.model is None:
        raise ValueError("--model: a model file (the body of POST /v1/streams) is required with --data")
    if args.batch < 1:
        raise ValueError(f"--batch: at least 1, got {args.batch}")
    body = read_model(args.model)
    frame = read_table(args.data)
    columns = args.columns.split(",") if args.columns else None
    inputs = args.inputs.split(",") if args.inputs else []
    steps, used = table_steps(frame, columns, inputs, args.time_column, args.time_unit)
    with _progress(len(steps), args.quiet) as bar:
        try:
            if args.server:
                done = filter_on_server(args.server, args.api_key, body, steps, args.batch, bar.update)
            else:
                done = filter_in_process(body, steps, args.batch, bar.update)
        except ValueError as exc:
            if "expected shape" not in str(exc):
                raise
            raise ValueError(f"{exc} (the observation columns: {used}; --columns chooses them)") from None
    estimates = steps_frame(done.per_step, done.names)
    write_frame(estimates, args.out)
    if args.plot:
        plot(estimates, done.names, frame, used, args.plot)
    if args.out is not None:
        where = f"through {args.server}" if args.server else "in-process"
        print(f"# {len(estimates)} steps filtered {where} in {done.seconds:.2f} s: {args.out}", file=sys.stderr)
    return 0


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``mpflow filter`` that filter a data file (``--data``)."""
    g = p.add_argument_group("filter a data file (--data; docs/API.md 'Filtering a data file')")
    g.add_argument("--data", help="a CSV or Parquet file, one row per step: filter it instead of a simulation")
    g.add_argument("--model", help="with --data: the stream as a JSON file, the body of POST /v1/streams")
    g.add_argument(
        "--columns", help="with --data: the observation columns, comma-separated (default: all but dt and --inputs)"
    )
    g.add_argument("--inputs", help="with --data: control-input columns, comma-separated (each step's u)")
    g.add_argument(
        "--time-column",
        help="with --data: a column of timestamps (numbers in seconds, or dates and times): their differences are "
        "the steps' dt, the first step's the median difference",
    )
    g.add_argument(
        "--time-unit",
        default="s",
        choices=sorted(TIME_UNITS),
        help="with --time-column: the unit of dt (default: s, seconds)",
    )
    g.add_argument("--server", help="with --data: filter through the mpflow server at this URL (default: in-process)")
    g.add_argument("--api-key", help="with --server: the API key (default: none)")
    g.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="with --data: steps per request")
    g.add_argument("--out", help="with --data: write the estimates to this .csv or .parquet (default: stdout, CSV)")
    g.add_argument("--plot", help="with --data: draw the estimates to this image file (PNG)")
    g.add_argument("--quiet", action="store_true", help="with --data: no progress bar")


__all__ = [
    "DEFAULT_BATCH",
    "MAX_COLUMNS",
    "MAX_ROWS",
    "TIME_UNITS",
    "Filtered",
    "add_options",
    "filter_in_process",
    "filter_on_server",
    "read_model",
    "read_table",
    "run",
    "table_steps",
    "time_steps",
]
