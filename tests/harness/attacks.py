"""Issue 34's abuse items 1–10, and issue 54's at the edge (slow request heads, the connection cap, batch ids, what
the HTTP parser refuses), as an attacker sends them, against a running server (``benchmarks/abuse.py``).

Each attack takes the server's base URL (tenants alpha ``key-a`` and beta ``key-b``, :mod:`tests.harness.isolation`)
and returns an *outcome*: ``request`` (what was sent), ``status`` (the answer's HTTP status, or a short text such
as ``"no answer in 10 s"``), ``seconds``, ``refused`` (whether the server refused or bounded it — each attack
says what that means for it; never assumed) and ``detail`` (the error message, or what was observed). Nothing
here knows which fixes are merged: the outcome is what the server answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from mpflow.operators.state import ParticleState, read_metadata
from mpflow.service.streams import snapshots

from tests.harness.isolation import ALPHA, BETA, StreamDriver, create, gaussian_stream

Outcome = dict[str, Any]


def _message(r: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(r.json()["error"]["message"])[:240]
    return r.text[:240]


def _refused(status: Any) -> bool:
    return isinstance(status, int) and 400 <= status < 500


def send(method: str, url: str, path: str, timeout: float, headers: dict | None = None, **kw: Any) -> Outcome:
    """One request: its status (or ``"no answer in T s"``), seconds and message; ``refused``: a 4xx."""
    t0 = time.perf_counter()
    try:
        r = httpx.request(method, url + path, headers=headers or ALPHA, timeout=timeout, **kw)
    except httpx.TimeoutException:
        return {"status": f"no answer in {timeout:g} s", "seconds": time.perf_counter() - t0, "refused": False}
    return {
        "status": r.status_code,
        "seconds": time.perf_counter() - t0,
        "refused": _refused(r.status_code),
        "detail": _message(r) if r.status_code >= 400 else "",
    }


# ------------------------------------------------------------------------------------------------ item 1
def lorenz96(n: int = 64, d: int = 8, **params: Any) -> dict[str, Any]:
    spec = gaussian_stream("smc", n, d)
    spec["model"] = {"family": "lorenz96", "params": params}
    return spec


Plan = tuple[str, Callable[[], Outcome]]


def item1(url: str, timeout: float) -> list[Plan]:
    """Unbounded RK4, each request on its own (an answer that never comes means the loop ran): an observation's
    ``dt`` 1e38, a stream's ``delta`` 1e38 or ``rk4_step`` 1e-38, a forecast's ``dt`` 1e38 (N = 64, d = 8).
    Refused: a 4xx."""
    with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha:
        _, sid = create(alpha, lorenz96())
    body = {"seq": 1, "observations": [{"value": [0.0] * 8, "dt": 1e38}]}

    def created_then_updated(**params: Any) -> Outcome:
        """The creation's answer when refused, else the first update's (where the integration runs)."""
        t0 = time.perf_counter()
        try:
            with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha:
                r = alpha.post("/v1/streams", json=lorenz96(**params))
        except httpx.TimeoutException:
            return {"status": f"no answer in {timeout:g} s", "seconds": time.perf_counter() - t0, "refused": False}
        if r.status_code != 201:
            return {
                "status": r.status_code,
                "seconds": time.perf_counter() - t0,
                "refused": _refused(r.status_code),
                "detail": _message(r),
            }
        path = f"/v1/streams/{r.json()['stream_id']}/observations"
        update = send("POST", url, path, timeout, json={"seq": 1, "observations": [[0.0] * 8]})
        return {**update, "status": f"created 201, update: {update['status']}", "seconds": time.perf_counter() - t0}

    return [
        (
            "lorenz96 observation dt=1e38",
            lambda: send("POST", url, f"/v1/streams/{sid}/observations", timeout, json=body),
        ),
        ("lorenz96 create delta=1e38, then an update", lambda: created_then_updated(delta=1e38)),
        ("lorenz96 create rk4_step=1e-38, then an update", lambda: created_then_updated(rk4_step=1e-38)),
        (
            "lorenz96 forecast steps=1&dt=1e38",
            lambda: send("GET", url, f"/v1/streams/{sid}/forecast?steps=1&dt=1e38", timeout),
        ),
    ]


# ------------------------------------------------------------------------------------------------ item 2
def keyless_uploads(url: str, connections: int, announce: int) -> tuple[Outcome, list[socket.socket]]:
    """``connections`` connections without a key, each announcing ``announce`` bytes (Content-Length) and sending
    them but the last byte; the outcome and the sockets, still open (the caller measures the server's memory,
    then closes them). Refused: the server answered 401 without reading the bodies."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    head = (
        f"POST /v1/streams HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {announce}\r\n\r\n"
    ).encode()
    body = b" " * (announce - 1)
    socks, answered, sent_all = [], 0, 0
    t0 = time.perf_counter()
    for _ in range(connections):
        s = socket.create_connection((host, port), timeout=10)
        socks.append(s)
        try:
            s.sendall(head)
            if answered < 3:  # once bodies are refused three times, the rest announce only (no 1 s waits)
                s.settimeout(1.0)
                s.sendall(body)
                sent_all += 1
        except OSError:  # the server answered and closed (or stopped reading) before the body was read
            answered += 1
    held = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for s in socks:
        s.settimeout(0.05)
        try:
            line = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
            status = line.split(" ")[1] if line.startswith("HTTP/") else "none"
        except OSError:
            status = "none"
        statuses[status] = statuses.get(status, 0) + 1
    return {
        "request": f"{connections} keyless POSTs announcing {announce} bytes, body sent but 1 byte",
        "status": statuses,
        "seconds": held,
        "bodies_sent_whole": sent_all,
        "refused": sent_all == 0 or "401" in statuses,
    }, socks


# ------------------------------------------------------------------------------------------------ item 3
def item3(url: str, timeout: float, n: int, d_prior: int, d_forecast: int, forecast_steps: int) -> list[Plan]:
    """Requests inside the documented limits that need much memory: a Gaussian prior at N, ``d_prior`` (a Cholesky
    per particle), a forecast of ``forecast_steps`` at N, ``d_forecast``. Refused: a 4xx (the caller measures
    memory and time of what is accepted)."""

    def forecast() -> Outcome:
        with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha:
            status, sid = create(alpha, gaussian_stream("smc", n, d_forecast))
        if sid is None:
            return {"status": f"stream refused ({status})", "refused": True, "seconds": 0.0}
        return send("GET", url, f"/v1/streams/{sid}/forecast?steps={forecast_steps}", timeout)

    return [
        (
            f"create gaussian prior N={n} d={d_prior}",
            lambda: send("POST", url, "/v1/streams", timeout, json=gaussian_stream("smc", n, d_prior)),
        ),
        (f"forecast N={n} d={d_forecast} steps={forecast_steps}", forecast),
    ]


# ------------------------------------------------------------------------------------------------ item 5
def item5(url: str, timeout: float) -> Outcome:
    """A sampler prior named by a path: an existing directory, a missing one, a relative climb. Refused: all 4xx
    with the same message (nothing tells them apart)."""
    answers = {}
    for name in ("/etc", "/no-such-dir-mpflow", "../../../../tmp"):
        spec = gaussian_stream("smc", 64, 2)
        spec["prior"] = {"type": "sampler", "name": name}
        answers[name] = send("POST", url, "/v1/streams", timeout, json=spec)
    statuses = {k: v["status"] for k, v in answers.items()}
    same = len({(v["status"], v.get("detail", "").replace(k, "<name>")) for k, v in answers.items()}) == 1
    return {
        "request": "sampler prior name=/etc, /no-such-dir-mpflow, ../../../../tmp",
        "status": statuses,
        "seconds": sum(v["seconds"] for v in answers.values()),
        "refused": all(_refused(s) for s in statuses.values()) and same,
        "detail": f"same answer for every path: {same}; /etc: {answers['/etc'].get('detail', '')}",
    }


# ------------------------------------------------------------------------------------------------ item 6
async def _feeds(url: str, held: int, timeout: float) -> Outcome:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        own = (await client.post("/v1/streams", headers=ALPHA, json=gaussian_stream("kalman", 16, 2))).json()
        beta = (await client.post("/v1/streams", headers=BETA, json=gaussian_stream("kalman", 16, 2))).json()
        async with contextlib.AsyncExitStack() as stack:
            statuses: dict[int, int] = {}
            for _ in range(held):
                r = await stack.enter_async_context(
                    client.stream("GET", f"/v1/streams/{own['stream_id']}/events", headers=ALPHA)
                )
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            t0 = time.perf_counter()
            async with client.stream("GET", f"/v1/streams/{beta['stream_id']}/events", headers=BETA) as other:
                other_status = other.status_code
                other_body = (await other.aread()).decode()[:200] if other_status != 200 else ""
            seconds = time.perf_counter() - t0
    return {
        "request": f"tenant alpha holds {held} live feeds; tenant beta opens one",
        "status": {"alpha": statuses, "beta": other_status},
        "seconds": seconds,
        "refused": other_status == 200 and statuses.get(200, 0) < held,
        "detail": other_body,
    }


def item6(url: str, held: int, timeout: float) -> Outcome:
    """One tenant holds ``held`` live feeds, another asks for one. Refused: the other tenant is served (200) and
    the first is capped below ``held``."""
    return asyncio.run(_feeds(url, held, timeout))


# ------------------------------------------------------------------------------------------------ item 7
def item7(url: str, streams: int, timeout: float) -> Outcome:
    """``streams`` streams, each with its own ``method_options`` (a distinct ``ess_threshold``), then deleted. The
    caller measures the server's memory: refused (bounded) when it does not keep growing per option."""
    statuses: dict[int, int] = {}
    ids = []
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha:
        for i in range(streams):
            spec = gaussian_stream("smc", 16, 2, method_options={"ess_threshold": 0.3 + i * 1e-6})
            status, sid = create(alpha, spec)
            statuses[status] = statuses.get(status, 0) + 1
            if sid is not None:
                ids.append(sid)
                alpha.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": [[0.1, 0.2]]})
        for sid in ids:
            alpha.delete(f"/v1/streams/{sid}")
    return {
        "request": f"{streams} streams with distinct method_options, each updated once, then deleted",
        "status": statuses,
        "seconds": time.perf_counter() - t0,
        "refused": None,
    }


# ------------------------------------------------------------------------------------------------ items 8 and 9
def export(url: str, spec: dict[str, Any], timeout: float) -> bytes:
    with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha:
        status, sid = create(alpha, spec)
        assert sid is not None, f"the stream to export was refused ({status})"
        blob = alpha.get(f"/v1/streams/{sid}/export").content
        alpha.delete(f"/v1/streams/{sid}")
    return blob


def item8(url: str, imports: int, timeout: float, redis_memory, max_body_bytes: int) -> Outcome:
    """``imports`` imports of one snapshot of 65536 particles just under ``max_body_bytes`` by one tenant;
    ``redis_memory()`` gives the bytes of the server's keys. Refused: a 429 (or 413) before all were stored."""
    d = max(1, int(0.9 * max_body_bytes / (4 * 65536)))
    blob = export(url, gaussian_stream("smc", 65536, d), timeout)
    before = redis_memory()
    statuses: dict[int, int] = {}
    t0 = time.perf_counter()
    headers = {**ALPHA, "Content-Type": snapshots.MEDIA_TYPE}
    created: list[str] = []
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for _ in range(imports):
            r = client.post("/v1/streams:import", headers=headers, content=blob)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 201:
                created.append(r.json()["stream_id"])
        grown = redis_memory() - before
        for stream_id in created:  # give the tenant's quota back for the scenarios that follow
            client.delete(f"/v1/streams/{stream_id}", headers=ALPHA)
    return {
        "request": f"{imports} imports of one {len(blob) / 1e6:.1f} MB snapshot",
        "status": statuses,
        "seconds": time.perf_counter() - t0,
        "redis_growth_mb": grown / 1e6,
        "refused": statuses.get(201, 0) < imports,
    }


def forge(blob: bytes, edit_stream, edit_state=None) -> bytes:
    """A snapshot re-signed with the unkeyed SHA-256 of the published format, after ``edit_stream(stream dict)``
    and ``edit_state(ParticleState)`` — what anyone can do when the checksum has no key."""
    meta = read_metadata(blob)
    stream = json.loads(meta["stream"])
    edit_stream(stream)
    state = ParticleState.from_bytes(blob)
    if edit_state is not None:
        edit_state(state)
    text = json.dumps(stream, sort_keys=True, separators=(",", ":"))
    data = state.to_bytes()
    digest = hashlib.sha256(meta["format"].encode() + b"\0" + text.encode() + b"\0" + data).hexdigest()
    return state.to_bytes({**meta, "stream": text, "sha256": digest})


def item9(url: str, timeout: float) -> list[Plan]:
    """Forged snapshots: step 2⁶³−1, a 4 MB junk tensor. Refused: a 4xx."""
    import torch

    blob = export(url, gaussian_stream("smc", 64, 2), timeout)
    top = 2**63 - 1

    def big_step(state: ParticleState) -> None:
        state.step = torch.full_like(state.step, top)

    def junk(state: ParticleState) -> None:
        state.extras["junk"] = torch.zeros(1, 1024 * 1024)

    forged = {
        "forged snapshot step=2^63-1": forge(blob, lambda s: s.update(step=top), big_step),
        "forged snapshot with a 4 MB junk tensor": forge(blob, lambda s: None, junk),
    }
    headers = {**ALPHA, "Content-Type": snapshots.MEDIA_TYPE}
    return [
        (what, lambda body=body: send("POST", url, "/v1/streams:import", timeout, headers=headers, content=body))
        for what, body in forged.items()
    ]


# ------------------------------------------------------------------------------------------------ item 10
def aborted_upload(url: str, metrics_500) -> Outcome:
    """A POST with a key announcing 100 kB that sends 1 kB and closes. Refused: no 500 counted for it."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    before = metrics_500()
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(
            f"POST /v1/streams HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer key-a\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n".encode()
            + b" " * 1000
        )
    time.sleep(1.0)
    counted = metrics_500() - before
    return {
        "request": "POST announcing 100 kB, 1 kB sent, connection closed",
        "status": f"500s counted: {counted:g}",
        "seconds": 1.0,
        "refused": counted == 0,
    }


def upper_case_key_in_log(url: str, log_path: Path) -> Outcome:
    """A WebSocket opened with ``?API_KEY=<key>`` (upper case); refused: the key is not in the server's log."""
    from websockets.sync.client import connect

    ws_url = url.replace("http://", "ws://") + "/v1/streams/none/ws?API_KEY=key-a"
    t0 = time.perf_counter()
    with contextlib.suppress(Exception), connect(ws_url, open_timeout=5) as ws:
        ws.close()
    time.sleep(0.5)
    leaked = "API_KEY=key-a" in log_path.read_text(errors="replace")
    return {
        "request": "WebSocket ...?API_KEY=key-a",
        "status": f"key in log: {leaked}",
        "seconds": time.perf_counter() - t0,
        "refused": not leaked,
    }


async def _sockets(url: str, count: int) -> tuple[dict[str, int], list]:
    from websockets.asyncio.client import connect

    async with httpx.AsyncClient(base_url=url, headers=ALPHA) as client:
        sid = (await client.post("/v1/streams", json=gaussian_stream("kalman", 16, 2))).json()["stream_id"]
    ws_url = url.replace("http://", "ws://") + f"/v1/streams/{sid}/ws"
    opened, outcomes = [], {}
    for _ in range(count):
        try:
            opened.append(await connect(ws_url, additional_headers=ALPHA, open_timeout=10))
            outcomes["accepted"] = outcomes.get("accepted", 0) + 1
        except Exception as exc:
            code = getattr(getattr(exc, "response", None), "status_code", type(exc).__name__)
            outcomes[str(code)] = outcomes.get(str(code), 0) + 1
    return outcomes, opened


def many_websockets(url: str, count: int) -> Outcome:
    """``count`` WebSockets of one tenant, all held open; refused: some are refused (a cap)."""

    async def run() -> tuple[dict[str, int], float]:
        t0 = time.perf_counter()
        outcomes, opened = await _sockets(url, count)
        seconds = time.perf_counter() - t0
        await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)
        return outcomes, seconds

    outcomes, seconds = asyncio.run(run())
    return {
        "request": f"{count} WebSockets of one tenant held open",
        "status": outcomes,
        "seconds": seconds,
        "refused": outcomes.get("accepted", 0) < count,
    }


def weights_only_source(root: Path) -> Outcome:
    """``torch.load(..., weights_only=False)`` anywhere in the package's source (training resume loads a
    checkpoint a user may be handed). A source check: no request reaches it."""
    hits = []
    for path in sorted(root.glob("*/**/*.py")):
        if ".venv" in path.parts or "tests" in path.parts or "benchmarks" in path.parts:
            continue
        text = path.read_text(errors="replace")
        hits += [
            f"{path.relative_to(root)}:{text[: m.start()].count(chr(10)) + 1}"
            for m in re.finditer(r"weights_only\s*=\s*False", text)
        ]
    return {
        "request": "source check: torch.load(weights_only=False)",
        "status": f"{len(hits)} found",
        "seconds": 0.0,
        "refused": not hits,
        "detail": ", ".join(hits),
    }


# ------------------------------------------------------------------------------------------------ issue 54: the edge
def _connect(url: str) -> socket.socket:
    host, port = urlsplit(url).hostname, urlsplit(url).port
    return socket.create_connection((host, port), timeout=10)


def _first_line(answer: bytes) -> str:
    line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    return " ".join(line.split(" ")[:2]) if line.startswith("HTTP/") else (line[:40] or "closed without an answer")


def error_of(answer: bytes) -> dict[str, Any] | None:
    """The ``error`` object of a raw answer's JSON body, or None when the body is no such JSON."""
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        if isinstance(error, dict) and set(error) == {"code", "message"}:
            return error
    return None


def slow_heads(url: str, connections: int, *, every: float = 2.0, seconds: float = 30.0) -> Outcome:
    """``connections`` keyless connections, each sending a request line, then one header line every ``every``
    seconds, never the blank line that ends the head, for ``seconds``; meanwhile tenant beta lists its streams
    every 0.25 s on a connection of its own. How many the server still held at the end and when it had dropped 90 %
    of them, its answers to them (first lines, and whether each was the API's JSON error), and beta's answers.
    Refused: 90 % were dropped within ``seconds`` and every one of beta's requests was answered 200."""
    import select
    import threading

    other: list[tuple[int | str, float]] = []
    stop = threading.Event()

    def other_tenant() -> None:
        with httpx.Client(base_url=url, headers=BETA, timeout=10) as beta:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    status: int | str = beta.get("/v1/streams").status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                other.append((status, time.perf_counter() - t0))
                stop.wait(0.25)

    host = urlsplit(url).hostname
    socks: dict[int, socket.socket] = {}
    poller = select.poll()
    t0 = time.perf_counter()
    for _ in range(connections):
        s = _connect(url)
        s.sendall(f"GET /v1/streams HTTP/1.1\r\nHost: {host}\r\n".encode())
        s.setblocking(False)
        socks[s.fileno()] = s
        poller.register(s, select.POLLIN)
    opened = time.perf_counter() - t0
    thread = threading.Thread(target=other_tenant, name="beta", daemon=True)
    thread.start()
    held, answers = set(socks), {fd: b"" for fd in socks}
    dropped_90: float | None = None
    start, line = time.monotonic(), 0
    next_line = start + every
    try:
        while time.monotonic() - start < seconds and held:
            for fd, _ in poller.poll(100):
                try:
                    data = socks[fd].recv(4096)
                except OSError:
                    data = b""
                answers[fd] += data
                if not data:
                    held.discard(fd)
                    poller.unregister(fd)
            if dropped_90 is None and len(held) <= 0.1 * connections:
                dropped_90 = time.monotonic() - start
            if time.monotonic() >= next_line:
                line += 1
                for fd in list(held):
                    with contextlib.suppress(OSError):
                        socks[fd].send(f"X-Dribble-{line}: {line}\r\n".encode())
                next_line += every
    finally:
        stop.set()
        thread.join(15)
        for s in socks.values():
            s.close()
    statuses: dict[str, int] = {}
    for answer in answers.values():
        key = _first_line(answer) + ("" if not answer or error_of(answer) else " (not the JSON error body)")
        statuses[key] = statuses.get(key, 0) + 1
    other_statuses = {str(s) for s, _ in other}
    return {
        "request": f"{connections} keyless connections, one header line every {every:g} s, for {seconds:g} s",
        "status": statuses,
        "seconds": time.monotonic() - start,
        "opened_s": opened,
        "still_open": len(held),
        "dropped_90_percent_after_s": dropped_90,
        "other_tenant": {
            "requests": len(other),
            "statuses": sorted(other_statuses),
            "max_s": max((s for _, s in other), default=None),
        },
        "refused": dropped_90 is not None and other_statuses == {"200"},
    }


def connection_cap(url: str, held: int, extra: int) -> Outcome:
    """``held`` connections with tenant alpha's key, each a complete head announcing a 10-byte body that never
    comes (held by the server until its body deadline), then ``extra`` more sending the same; the answers of the
    extra ones, read at once. Refused: the server answered some of them 503 with the API's JSON error body without
    waiting for their bodies (a cap on open connections), and every answer is that body."""
    host = urlsplit(url).hostname
    head = (
        f"POST /v1/streams HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer key-a\r\n"
        "Content-Type: application/json\r\nContent-Length: 10\r\n\r\n"
    ).encode()
    socks: list[socket.socket] = []
    t0 = time.perf_counter()
    try:
        for _ in range(held):
            socks.append(_connect(url))
            socks[-1].sendall(head)
        answers: list[bytes] = []
        for _ in range(extra):
            s = _connect(url)
            socks.append(s)
            with contextlib.suppress(OSError):
                s.sendall(head)
            s.settimeout(1.0)
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(4096):
                    answer += chunk
            answers.append(answer)
    finally:
        for s in socks:
            s.close()
    statuses: dict[str, int] = {}
    for answer in answers:
        statuses[_first_line(answer)] = statuses.get(_first_line(answer), 0) + 1
    errors = [error_of(a) for a in answers if a]
    codes = sorted({e["code"] for e in errors if e is not None})
    retry_after = sum(b"\r\nretry-after: 1\r\n" in a.lower() for a in answers)
    return {
        "request": f"{held} connections held (a body that never comes), then {extra} more",
        "status": statuses,
        "seconds": time.perf_counter() - t0,
        "codes": codes,
        "with_retry_after": retry_after,
        "refused": statuses.get("HTTP/1.1 503", 0) > 0 and all(e is not None for e in errors),
    }


#: a batch update's ``stream_id`` that no stream can have, as raw JSON (a lone surrogate is a JSON escape)
BAD_BATCH_IDS = {"lone surrogate": r'"\ud800"', "empty": '""', "key syntax": '"../../x}:{a}"'}


def batch_ids(url: str, timeout: float) -> list[Plan]:
    """``POST /v1/observations:batch`` with an update whose ``stream_id`` is :data:`BAD_BATCH_IDS`'s, each on its
    own. Refused: 422 whose message names ``updates[0].stream_id``."""

    def one(raw_id: str) -> Outcome:
        body = '{"updates": [{"stream_id": ' + raw_id + ', "observations": [[0.1, 0.2]]}]}'
        headers = {**ALPHA, "Content-Type": "application/json"}
        out = send("POST", url, "/v1/observations:batch", timeout, headers=headers, content=body.encode())
        names = str(out.get("detail", "")).startswith("updates[0].stream_id:")
        return {**out, "refused": out["status"] == 422 and names}

    return [(f"batch update stream_id {what} ({raw})", lambda raw=raw: one(raw)) for what, raw in BAD_BATCH_IDS.items()]


#: requests the HTTP parser itself refuses (or that are too large a head), as raw bytes
BAD_HEADS = {
    "a 100 KB path": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: mpflow\r\n\r\n",
    "a malformed request line": b"NOT HTTP AT ALL\r\n\r\n",
    "a header without a colon": b"GET /healthz HTTP/1.1\r\nHost: mpflow\r\nno colon here\r\n\r\n",
    "a 200 KB header": b"GET /healthz HTTP/1.1\r\nHost: mpflow\r\nX-Big: " + b"v" * 200_000 + b"\r\n\r\n",
}


def bad_heads(url: str) -> list[Plan]:
    """Each of :data:`BAD_HEADS` on a connection of its own: the answer's first line and body. Refused: a 4xx
    with the API's JSON error body."""

    def one(raw: bytes) -> Outcome:
        t0 = time.perf_counter()
        answer = b""
        with _connect(url) as s:
            with contextlib.suppress(OSError):
                s.sendall(raw)
            s.settimeout(5.0)
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    answer += chunk
        error = error_of(answer)
        status = _first_line(answer)
        return {
            "status": status,
            "seconds": time.perf_counter() - t0,
            "refused": status.startswith("HTTP/1.1 4") and error is not None,
            "detail": error["message"] if error else answer[-120:].decode(errors="replace"),
            "code": error["code"] if error else None,
        }

    return [(f"raw request: {what}", lambda raw=raw: one(raw)) for what, raw in BAD_HEADS.items()]


# ------------------------------------------------------------------------------------------------ issue 54 item 3
#: what :func:`heavy_reads`' readers read, one path each (cycled): the stream document, and every read of the state
HEAVY_READ_PATHS = ("", "", "", "/smoothed", "/export", "/particles", "/samples?n=1000", "/forecast?steps=1")


def heavy_reads(
    url: str,
    rss: Callable[[], int],
    *,
    n: int = 30000,
    d: int = 2,
    lag: int = 100,
    readers: int = 8,
    seconds: float = 20.0,
    settle: float = 10.0,
    paths: tuple[str, ...] = HEAVY_READ_PATHS,
    timeout: float = 60.0,
) -> Outcome:
    """Reads are not priced: tenant alpha's ``smc`` stream of N = ``n``, d = ``d`` and ``smoothing_lag`` ``lag``
    (84 MB of state at the defaults, accepted at creation) read by ``readers`` threads for ``seconds``, each on its
    own connection and path of ``paths`` (``""``: ``GET /v1/streams/{id}``, a 1 KB answer), while tenant beta
    updates a ``kalman`` d = 2 stream in a loop; ``rss()`` gives the server's resident bytes, read before, every
    0.2 s during, and ``settle`` seconds after. Refused (bounded): beta saw no 5xx and no update slower than 2 s,
    and the RSS came back within 500 MB of before."""
    import statistics
    import threading

    out: dict[str, Any] = {}
    with (
        httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as alpha,
        httpx.Client(base_url=url, headers=BETA, timeout=timeout) as beta,
    ):
        status, sid = create(alpha, gaussian_stream("smc", n, d, smoothing_lag=lag))
        if sid is None:
            return {"request": f"smc N={n} d={d} lag={lag}", "status": f"stream refused ({status})", "refused": True}
        out["state_mb"] = alpha.get(f"/v1/streams/{sid}").json()["state_bytes"] / 1e6
        _, light = create(beta, gaussian_stream("kalman", 256, 2))
        assert light is not None, "the light stream was refused"
        driver = StreamDriver(beta, light, 2)
        for _ in range(5):  # warm-up
            driver.send()
        out["idle_p50_s"] = statistics.median(driver.send()[1] for _ in range(20))
        time.sleep(1.0)
        before = rss()
        answers: list[tuple[str, int | str, float]] = []
        updates: list[tuple[int | str, float]] = []
        peak = [before]
        stop = threading.Event()

        def reader(path: str) -> None:
            with httpx.Client(base_url=url, headers=ALPHA, timeout=timeout) as own:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        got: int | str = own.get(f"/v1/streams/{sid}{path}").status_code
                    except httpx.HTTPError as exc:
                        got = type(exc).__name__
                    answers.append((path or "/", got, time.perf_counter() - t0))

        def memory() -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], rss())

        threads = [threading.Thread(target=memory, name="rss", daemon=True)]
        threads += [
            threading.Thread(target=reader, args=(paths[i % len(paths)],), name=f"reader-{i}", daemon=True)
            for i in range(readers)
        ]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        while time.perf_counter() - t0 < seconds:
            try:
                updates.append(driver.send())
            except httpx.HTTPError as exc:
                updates.append((type(exc).__name__, timeout))
        stop.set()
        for thread in threads:
            thread.join(timeout + 5)
        read_s = time.perf_counter() - t0
        time.sleep(settle)
        after = rss()
        alpha.delete(f"/v1/streams/{sid}")
        beta.delete(f"/v1/streams/{light}")
    reads: dict[str, dict[str, Any]] = {}
    for path, got, s in answers:
        entry = reads.setdefault(path, {"n": 0, "statuses": {}, "worst_s": 0.0})
        entry["n"] += 1
        entry["statuses"][str(got)] = entry["statuses"].get(str(got), 0) + 1
        entry["worst_s"] = max(entry["worst_s"], s)
    light_statuses = sorted({str(s) for s, _ in updates})
    worst = max((s for _, s in updates), default=float("nan"))
    no_5xx = all(isinstance(s, int) and s < 500 for s, _ in updates)
    return {
        "request": f"{readers} readers of an smc N={n} d={d} lag={lag} stream for {seconds:g} s",
        "status": {"light": light_statuses, "reads": {p: e["statuses"] for p, e in reads.items()}},
        "seconds": read_s,
        "refused": no_5xx and worst <= 2.0 and after - before <= 500e6,
        **out,
        "light_updates": len(updates),
        "light_p50_s": statistics.median(s for _, s in updates) if updates else float("nan"),
        "light_worst_s": worst,
        "light_statuses": light_statuses,
        "reads": reads,
        "rss_before_mb": before / 1e6,
        "rss_peak_mb": peak[0] / 1e6,
        "rss_after_mb": after / 1e6,
    }


__all__ = [
    "BAD_BATCH_IDS",
    "BAD_HEADS",
    "HEAVY_READ_PATHS",
    "aborted_upload",
    "bad_heads",
    "batch_ids",
    "connection_cap",
    "error_of",
    "forge",
    "heavy_reads",
    "item1",
    "item3",
    "item5",
    "item6",
    "item7",
    "item8",
    "item9",
    "keyless_uploads",
    "many_websockets",
    "send",
    "slow_heads",
    "upper_case_key_in_log",
    "weights_only_source",
]
