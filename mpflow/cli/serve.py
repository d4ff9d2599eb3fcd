"""``mpflow serve`` (and ``python -m mpflow serve``): run the HTTP service under uvicorn.

``add_parser(subparsers)`` registers the subcommand on the ``mpflow`` CLI; ``main(argv)`` is the stand-alone entry
point of ``python -m mpflow serve``. Worker processes: ``--workers``, else ``MPFLOW_WORKERS``, else
:func:`default_workers` — one per CPU core this process may use, at most ``MAX_DEFAULT_WORKERS`` (each worker has
its own event loop, engine and GIL; measured on 2 cores, 64 streams of ``mpf``: 634 updates/s with one worker, 1029
with two). Workers on the embedded store share its one redis-server (:mod:`mpflow.service.store.embedded`). Every other
setting comes from ``MPFLOW_*`` (see :mod:`mpflow.service.settings`; the connection limits are enforced by the HTTP
protocol of :mod:`mpflow.service.connection_guard`); ``--redis-url`` sets ``MPFLOW_REDIS_URL`` for
the worker processes. Without it the embedded Redis under ``./data`` is used. Logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mpflow.service.log_redaction import RedactSecrets

#: the most workers the default starts: each loads torch and the operators (a few hundred MB) and micro-batches
#: only its own requests, so past a handful of cores more replicas serve better than more workers
MAX_DEFAULT_WORKERS = 8
#: seconds a worker has to answer uvicorn's health-check ping. A worker answers from a thread, which cannot run
#: while the main thread loads torch's shared libraries (the GIL is held): with uvicorn's 5 s default, a worker
#: still starting on a loaded 2-core machine was killed and started again (measured: a 2-worker start took
#: 12.9-13.3 s with that restart, 8.1 s without); a worker hung for this long is still replaced
WORKER_HEALTHCHECK_S = 60


def usable_cpus() -> int:
    """CPU cores this process may use: its CPU affinity, bounded by a cgroup v2 CPU quota (a container's
    ``--cpus``, a Kubernetes CPU limit) rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_workers() -> int:
    """``MPFLOW_WORKERS`` when set, else one worker per usable core, at most ``MAX_DEFAULT_WORKERS``."""
    env = os.environ.get("MPFLOW_WORKERS", "").strip()
    if env:
        return _positive_workers(env)
    return min(usable_cpus(), MAX_DEFAULT_WORKERS)


def _positive_workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"workers: expected a whole number >= 1, got {text!r}")
    return n


class JsonFormatter(logging.Formatter):
    """One JSON object per line; messages that are JSON objects already (the access log) are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name}
        msg = record.getMessage()
        if msg.startswith("{"):
            try:
                line.update(json.loads(msg))
            except ValueError:
                line["msg"] = msg
        else:
            line["msg"] = msg
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"))


def log_config(level: str) -> dict[str, Any]:
    """A logging dictConfig for uvicorn (applied in every worker): JSON lines for mpflow and uvicorn."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        # on the handler, so every record it writes is redacted, whichever (child) logger made it
        "filters": {"redact": {"()": RedactSecrets}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "filters": ["redact"],
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "mpflow": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
        },
    }


#: ``mpflow serve``'s own settings (read from the environment by the command, not by ``Settings``): name → default
#: as docs/API.md "Limits" gives it (``tests/unit/test_docs_drift.py`` checks the two agree)
SERVE_SETTINGS = {
    "MPFLOW_HOST": "127.0.0.1",
    "MPFLOW_PORT": 8000,
    "MPFLOW_WORKERS": f"one per CPU core, at most {MAX_DEFAULT_WORKERS}",
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    host, port, workers = SERVE_SETTINGS.values()
    p.add_argument("--host", default=os.environ.get("MPFLOW_HOST", host), help=f"bind address (MPFLOW_HOST; {host})")
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("MPFLOW_PORT", str(port))), help=f"port (MPFLOW_PORT; {port})"
    )
    p.add_argument(
        "--workers", type=_positive_workers, default=None, help=f"worker processes (MPFLOW_WORKERS; default: {workers})"
    )
    p.add_argument("--redis-url", default=None, help="state store URL (default: embedded Redis under ./data)")
    p.add_argument("--log-level", default=None, help="CRITICAL/ERROR/WARNING/INFO/DEBUG (MPFLOW_LOG_LEVEL)")


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on the ``mpflow`` CLI."""
    p = subparsers.add_parser("serve", help="run the HTTP service (uvicorn)")
    _add_arguments(p)
    p.set_defaults(func=serve)


@contextmanager
def shared_metrics_dir(workers: int) -> Iterator[str | None]:
    """With ``workers > 1``: a fresh private directory (``mpflow-metrics-*``) in ``PROMETHEUS_MULTIPROC_DIR``
    for the workers, which are spawned later and inherit the environment; removed, with the variable, on exit.
    Yields the directory in use, or None with one worker. A directory the user set already is used as it is
    and kept (SystemExit if it is not a directory, before any worker starts)."""
    from mpflow.service.settings import MULTIPROC_ENV

    own = os.environ.get(MULTIPROC_ENV)
    if own:
        if not os.path.isdir(own):
            raise SystemExit(f"{MULTIPROC_ENV}={own!r} is not a directory")
        yield own
        return
    if workers <= 1:
        yield None
        return
    path = tempfile.mkdtemp(prefix="mpflow-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


def check_port_free(host: str, port: int) -> None:
    """SystemExit with a hint when ``host:port`` cannot be bound (another server holds it): which port, and how to
    pick another — instead of uvicorn's bare ``[Errno 98] Address already in use``. Bound as uvicorn binds it
    (``SO_REUSEADDR``: a port in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(
                f"mpflow serve: cannot listen on {host}:{port} ({exc.strerror}): another server (an earlier "
                f"mpflow serve?) holds port {port}. Stop it, or pick another port: mpflow serve --port {port + 1} "
                f"(or MPFLOW_PORT={port + 1})"
            ) from None


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn until it stops (``mpflow.service.app:create_app`` in ``args.workers`` processes); 0."""
    import uvicorn

    from mpflow.service.connection_guard import GuardedHttpToolsProtocol
    from mpflow.service.settings import Settings

    if args.redis_url:
        os.environ["MPFLOW_REDIS_URL"] = args.redis_url
    if args.log_level:
        os.environ["MPFLOW_LOG_LEVEL"] = args.log_level
    settings = Settings()  # fail here, with the field named, on a bad MPFLOW_* value
    try:
        workers = args.workers or default_workers()
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"MPFLOW_WORKERS: {e}") from None
    check_port_free(args.host, args.port)
    with shared_metrics_dir(workers):
        uvicorn.run(
            "mpflow.service.app:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            workers=workers,
            access_log=False,  # mpflow.access logs one JSON line per request
            log_config=log_config(settings.log_level),
            ws_max_size=settings.max_body_bytes,
            # a deadline and a size for each request head, the connection cap, JSON for the parser's own 400
            http=GuardedHttpToolsProtocol,
            # open dashboard feeds (SSE) and WebSockets would otherwise hold a stopping server until they end
            timeout_graceful_shutdown=5,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpflow serve", description="run the mpflow HTTP service")
    _add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
