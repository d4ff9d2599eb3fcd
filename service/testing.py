"""The app for tests and benchmarks, without starting a process.

``async with serve_in_process(settings) as (app, client)`` runs the app's lifespan (store, engine, operators)
and yields an ``httpx.AsyncClient`` bound to it through ASGI (no network). ``with serve_in_thread(settings) as
url`` serves the app with uvicorn on a free local port in a background thread (real HTTP and WebSockets).
``with serve_as_user(env, log_path) as server`` starts ``python -m service`` in a subprocess, as a user (or
``make serve``) starts it, and yields it once ``/readyz`` answers 200 (end-to-end tests, fault injection, load).
:func:`drop_prefix` deletes every key under a store prefix (tests use a fresh prefix each and clean up).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI

from service.app import create_app
from service.settings import Settings
from service.store import StreamStore


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


ROOT = Path(__file__).resolve().parents[1]


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
    """``python -m service --host 127.0.0.1 --port P *args`` as a user (or ``make serve``) starts it, run from the
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
        cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.new_session
            )
        wait_ready(self.url, self.proc, self.log_path, timeout)
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL the server process alone (no shutdown; its embedded redis-server, a daemon, lives on)."""
        assert self.proc is not None, "the server was not started"
        self.proc.kill()
        self.proc.wait()

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
    "UserServer",
    "drop_prefix",
    "free_port",
    "redis_answers",
    "serve_as_user",
    "serve_in_process",
    "serve_in_thread",
    "wait_ready",
]
