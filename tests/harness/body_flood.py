"""Slow and oversized request bodies against a real server, for tests and benchmarks (issue 34, item 2).

:func:`flood` opens ``connections`` raw TCP connections at once, each sending a ``POST`` whose head announces
``Content-Length: announce`` and then up to ``send`` bytes of its body in ``chunk``-byte pieces ``pause`` seconds
apart (a slow-loris when ``pause`` is long, a flood when it is 0), with or without a valid key. While they are open
and after they all closed it samples the server process's resident memory (psutil; the process and its children,
the embedded redis-server left out), and it reads each connection's first answer line (``HTTP/1.1 401 ...``).

The answer (:class:`FloodResult`) has the server's RSS before, at its peak while the connections were open, and
after they closed (settled: sampled again once nothing changed for a while), in MB, and the count of statuses seen.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

import psutil

MB = 1e6


@dataclass
class FloodResult:
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    statuses: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def growth_mb(self) -> float:
        """Peak growth over the baseline while the connections were open."""
        return self.rss_peak_mb - self.rss_before_mb

    @property
    def kept_mb(self) -> float:
        """What was still held once every connection had closed."""
        return self.rss_after_mb - self.rss_before_mb


def server_rss_mb(pid: int) -> float:
    """Resident memory of the server process and its workers, in MB (its redis-server left out)."""
    proc = psutil.Process(pid)
    procs = [proc, *(c for c in proc.children(recursive=True) if "redis" not in c.name())]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / MB


def _head(host: str, port: int, announce: int, key: str | None, path: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {announce}",
    ]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _one(
    host: str, port: int, head: bytes, send: int, chunk: int, pause: float, hold: float, statuses: collections.Counter
) -> None:
    status = "no answer"
    try:
        with socket.create_connection((host, port), timeout=hold + 30) as sock:
            sock.sendall(head)
            sent, piece = 0, b" " * chunk
            with contextlib.suppress(OSError):  # the server may close while we still send: that is the point
                while sent < send:
                    sock.sendall(piece[: min(chunk, send - sent)])
                    sent += min(chunk, send - sent)
                    if pause:
                        time.sleep(pause)
            sock.settimeout(max(hold, 1.0))
            with contextlib.suppress(OSError):
                line = sock.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
                status = line.split(" ")[1] if line.startswith("HTTP/") else (line or "closed")
    except OSError as exc:
        status = type(exc).__name__
    statuses[status] += 1


def flood(
    url: str,
    pid: int,
    connections: int = 300,
    announce: int = 8 * 1024 * 1024,
    send: int = 1024 * 1024,
    chunk: int = 64 * 1024,
    pause: float = 0.0,
    hold: float = 10.0,
    key: str | None = None,
    path: str = "/v1/streams",
    settle_s: float = 3.0,
) -> FloodResult:
    """Run the flood described in the module docstring against ``url`` (a server whose process is ``pid``)."""
    host, port = url.removeprefix("http://").split(":")
    head = _head(host, int(port), announce, key, path)
    statuses: collections.Counter = collections.Counter()
    before = server_rss_mb(pid)
    threads = [
        threading.Thread(target=_one, args=(host, int(port), head, send, chunk, pause, hold, statuses), daemon=True)
        for _ in range(connections)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, server_rss_mb(pid))
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    peak = max(peak, server_rss_mb(pid))
    after, deadline = server_rss_mb(pid), time.monotonic() + 4 * settle_s
    while time.monotonic() < deadline:  # settled: unchanged (within 1 MB) for settle_s
        time.sleep(settle_s)
        now = server_rss_mb(pid)
        if abs(now - after) < 1.0:
            break
        after = now
    return FloodResult(before, peak, after, dict(statuses), seconds)


__all__ = ["FloodResult", "flood", "server_rss_mb"]
