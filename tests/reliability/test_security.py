"""Security with API keys on (``MPFLOW_API_KEYS="tenantA:…,tenantB:…"``), against the server as a user runs it
(``python -m mpflow serve``, real Redis, INFO logs captured):

* every route of the app (``app.routes`` flattened, and every operation of ``/openapi.json``) answers 401 without
  a key, with a wrong key, a key's prefix, another scheme or a key in the query string — except an explicit
  allow-list: ``/healthz``, ``/readyz``, ``/metrics`` (while ``metrics_public``), the OpenAPI documents and the
  dashboard's HTML pages and files; no ``/v1`` route is on it. The WebSocket refuses its handshake;
* tenant A cannot read, update, list, sample, get particles of, open the WebSocket or the event feed of,
  batch-update or delete tenant B's streams, by their ids or by guessing: every answer is byte-for-byte the
  answer for an id that does not exist (taken after B deleted them), and B's streams are untouched;
* keys are compared with :func:`hmac.compare_digest` against every configured key whichever matches;
* no key — valid or not, sent in a header or a query string — appears in any log line or answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import routing as fastapi_routing
from mpflow.service.api import auth as auth_mod
from mpflow.service.app import create_app
from mpflow.service.settings import Settings
from starlette.routing import Mount, WebSocketRoute
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.harness.server import drop_prefix, serve_as_user, serve_in_process
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

KEY_A = "ka-" + secrets.token_hex(16)
KEY_B = "kb-" + secrets.token_hex(16)
WRONG = "kx-" + secrets.token_hex(16)
API_KEYS = f"tenantA:{KEY_A},tenantB:{KEY_B}"
SECRETS = (KEY_A, KEY_B, WRONG)

#: routes answered without a key (method, path template); HEAD goes with GET. Nothing under /v1 may be here.
PUBLIC = {
    "/healthz",  # liveness
    "/readyz",  # readiness
    "/metrics",  # while Settings.metrics_public (the default)
    "/openapi.json",  # the API's description, no data
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/redoc/redoc.standalone.js",  # the ReDoc bundle /redoc loads, served without its CDN logo
    "/docs-assets",  # the Swagger UI and ReDoc files of /docs and /redoc (a static mount)
    "/",  # the dashboard's pages: HTML only, every datum they show comes from /v1 with the user's key
    "/streams/{stream_id}",
    "/dashboard/{name}",
}
STREAM = {
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "smc",
    "num_particles": 8,
    "seed": 1,
}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def no_secret_in(r: httpx.Response) -> httpx.Response:
    """``r``, after checking that no key is echoed in its body or headers."""
    text = r.text + json.dumps(dict(r.headers))
    assert not any(k in text for k in SECRETS), (r.request.url.path, r.status_code)
    return r


def flat_routes(app: Any) -> list[Any]:
    expand = getattr(fastapi_routing, "iter_route_contexts", None)
    return list(expand(app.router.routes)) if expand is not None else list(app.router.routes)


@dataclass
class Server:
    url: str
    log_path: Path

    @property
    def ws(self) -> str:
        return self.url.replace("http://", "ws://")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[Server]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {"MPFLOW_API_KEYS": API_KEYS, "MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix}
    env["MPFLOW_LOG_LEVEL"] = "INFO"
    log_path = tmp_path_factory.mktemp("security") / "service.log"
    try:
        with serve_as_user(env, log_path) as s:
            yield Server(s.url, log_path)
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def _fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "probe-stream", path)


def _ws_refused(url: str, headers: dict[str, str] | None = None) -> int:
    """The HTTP status of a refused WebSocket handshake (fails if it is accepted)."""
    try:
        with connect(url, additional_headers=headers or {}, open_timeout=10) as ws:
            ws.close()
    except InvalidStatus as exc:
        return exc.response.status_code
    raise AssertionError(f"the WebSocket {url} accepted a handshake without a valid key")


# ---------------------------------------------------------------------------------------------- every route
def test_every_route_but_the_allow_list_needs_a_valid_key(server):
    app = create_app(Settings(api_keys=API_KEYS, redis_url="redis://127.0.0.1:1/0"))  # its routes only
    assert not any(p.startswith("/v1") for p in PUBLIC)
    http_routes, ws_routes, public_seen = [], [], set()
    for route in flat_routes(app):
        original = getattr(route, "original_route", route)
        if isinstance(original, Mount):
            assert route.path in PUBLIC, f"mount {route.path} is not on the allow-list"  # static files only
            continue
        if isinstance(original, WebSocketRoute) or getattr(route, "methods", None) is None:
            ws_routes.append(route.path)
            continue
        for method in sorted(route.methods - {"HEAD"}):
            if route.path in PUBLIC:
                public_seen.add(route.path)
            else:
                http_routes.append((method, route.path))
    assert len(http_routes) >= 10 and ws_routes == ["/v1/streams/{stream_id}/ws"], (http_routes, ws_routes)
    assert all(path.startswith("/v1/") for _, path in http_routes), http_routes  # the API is all under /v1

    # the OpenAPI document lists nothing the enumeration missed, and declares the bearer scheme on /v1
    spec = no_secret_in(httpx.get(f"{server.url}/openapi.json")).json()
    documented = {(m.upper(), p) for p, item in spec["paths"].items() for m in item if m != "parameters"}
    assert documented - {(m, p) for m, p in http_routes} <= {("GET", p) for p in PUBLIC}, documented
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if path.startswith("/v1"):
                assert op.get("security") and "401" in op["responses"], (method, path)

    bad_credentials = [
        {},
        bearer(WRONG),
        bearer(KEY_A[:-1]),  # a prefix of a valid key
        bearer(KEY_A + "x"),
        {"Authorization": f"Basic {KEY_A}"},  # a valid key under another scheme
        {"Authorization": KEY_A},
        {"Authorization": "Bearer"},
    ]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path in http_routes:
            for headers in bad_credentials:
                r = no_secret_in(c.request(method, _fill(path), json={}, headers=headers))
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
                assert r.json()["error"]["code"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
            # a key in the query string is not a credential for HTTP routes
            r = no_secret_in(c.request(method, _fill(path), params={"api_key": KEY_A}, json={}))
            assert r.status_code == 401, (method, path)
            # control: with a valid key the same request is past authentication
            r = no_secret_in(c.request(method, _fill(path), json={}, headers=bearer(KEY_A)))
            assert r.status_code != 401, (method, path, r.text[:200])
        for path in sorted(public_seen):
            r = no_secret_in(c.get(_fill(path).replace("probe-stream", "index.html")))
            assert r.status_code != 401, path

    ws = server.ws + _fill(ws_routes[0])
    for headers, query in ((None, ""), (bearer(WRONG), ""), (None, f"?api_key={WRONG}"), (bearer(KEY_A[:-1]), "")):
        assert _ws_refused(ws + query, headers) == 401  # the HTTP 401 of every route (denial response)
    with connect(ws, additional_headers=bearer(KEY_A)) as sock:  # control: accepted, then 404 for the stream
        assert json.loads(sock.recv(timeout=10))["status"] == 404


def test_metrics_can_be_made_private(redis_url):
    async def body(public: bool) -> None:
        settings = Settings(
            api_keys=API_KEYS, redis_url=redis_url, redis_prefix=f"mpflowtest-{uuid.uuid4().hex}", metrics_public=public
        )
        async with serve_in_process(settings) as (_, c):
            for headers in ({}, bearer(WRONG)):
                r = no_secret_in(await c.get("/metrics", headers=headers))
                assert r.status_code == (200 if public else 401), (public, headers)
            r = await c.get("/metrics", headers=bearer(KEY_B))
            assert r.status_code == 200 and "mpflow_http_requests_total" in r.text
            assert (await c.get("/healthz")).status_code == 200 and (await c.get("/readyz")).status_code == 200

    asyncio.run(body(True))
    asyncio.run(body(False))


# ---------------------------------------------------------------------------------------------- tenants
def _answers(server: Server, ids: list[str], events: bool) -> list[Any]:
    """Tenant A's answers (status, body) to every operation on each of ``ids``."""
    out: list[Any] = []
    with httpx.Client(base_url=server.url, headers=bearer(KEY_A), timeout=30) as c:
        for sid in ids:
            calls = [
                ("GET", f"/v1/streams/{sid}", None),
                ("GET", f"/v1/streams/{sid}/samples?n=5", None),
                ("GET", f"/v1/streams/{sid}/particles", None),
                ("POST", f"/v1/streams/{sid}/observations", {"observations": [[0.1, 0.2]]}),
                ("POST", f"/v1/streams/{sid}/observations", {"seq": 1, "observations": [[0.1, 0.2]]}),
                ("POST", "/v1/observations:batch", {"updates": [{"stream_id": sid, "observations": [[0.1, 0.2]]}]}),
                ("DELETE", f"/v1/streams/{sid}", None),
            ]
            if events:
                calls.append(("GET", f"/v1/streams/{sid}/events", None))
            for method, path, body in calls:
                r = no_secret_in(c.request(method, path, json=body))
                out.append((method, path, r.status_code, r.headers.get("content-type"), r.text))
            with connect(f"{server.ws}/v1/streams/{sid}/ws", additional_headers=bearer(KEY_A)) as ws:
                frame = ws.recv(timeout=10)
                with pytest.raises(ConnectionClosed):  # the server closes after the error frame
                    ws.recv(timeout=10)
                out.append(("WS", sid, frame, ws.close_code))
    return out


def test_a_tenant_cannot_reach_another_tenants_streams(server):
    b = httpx.Client(base_url=server.url, headers=bearer(KEY_B), timeout=30)
    a = httpx.Client(base_url=server.url, headers=bearer(KEY_A), timeout=30)
    events = any(r.path.endswith("/events") for r in flat_routes(create_app(Settings(redis_url="redis://x:1/0"))))
    with a, b:
        named = no_secret_in(b.post("/v1/streams", json={**STREAM, "stream_id": "b-secret"}))
        generated = no_secret_in(b.post("/v1/streams", json=STREAM))
        assert named.status_code == 201 and generated.status_code == 201
        ids = ["b-secret", generated.json()["stream_id"]]
        assert (
            no_secret_in(b.post(f"/v1/streams/{ids[0]}/observations", json={"observations": [[1.0, 1.0]]})).status_code
            == 200
        )
        before = {sid: b.get(f"/v1/streams/{sid}/particles").json() for sid in ids}

        while_they_exist = _answers(server, ids, events)
        for entry in while_they_exist:
            if entry[0] == "WS":
                frame = json.loads(entry[2])
                assert frame["status"] == 404 and frame["error"]["code"] == "stream_not_found", entry
                assert entry[3] == 1008, entry
            elif "batch" in entry[1]:
                assert entry[2] == 200 and json.loads(entry[4])["results"][0]["status"] == 404, entry
            else:
                assert entry[2] == 404, entry

        # A's listing (every page, with A's and with B's cursor) never shows B's streams
        for sid in ("a-1", "a-2"):
            assert a.post("/v1/streams", json={**STREAM, "stream_id": sid}).status_code == 201
        b_cursor = b.get("/v1/streams", params={"limit": 1}).json()["next_cursor"]
        assert b_cursor
        seen, cursor = [], None
        while True:
            page = no_secret_in(
                a.get("/v1/streams", params={"limit": 1, **({"cursor": cursor} if cursor else {})})
            ).json()
            seen += [s["stream_id"] for s in page["streams"]]
            if not (cursor := page["next_cursor"]):
                break
        assert sorted(seen) == ["a-1", "a-2"], seen
        with_b_cursor = no_secret_in(a.get("/v1/streams", params={"cursor": b_cursor}))
        assert with_b_cursor.status_code in (200, 422)
        if with_b_cursor.status_code == 200:
            assert not set(ids) & {s["stream_id"] for s in with_b_cursor.json()["streams"]}

        # guessing: prefixes, case, the store key's own syntax, traversal
        guesses = [ids[1][:8], ids[1].upper(), "B-SECRET", "b-secre", "tenantB:b-secret", "{tenantB:b-secret}", "*"]
        guesses += ["..%2Fb-secret", "b-secret%00", "tenantB%3Ab-secret", "%7BtenantB%3Ab-secret%7D"]
        for guess in guesses:
            for path in (f"/v1/streams/{guess}", f"/v1/streams/{guess}/particles"):
                r = no_secret_in(a.get(path))
                assert r.status_code in (404, 422) and set(r.json()) == {"error"}, (guess, r.text)

        # A may use B's id for its own stream (ids are per tenant): 201, and B's stream is not touched
        mine = no_secret_in(a.post("/v1/streams", json={**STREAM, "stream_id": "b-secret", "seed": 99}))
        assert mine.status_code == 201
        assert a.delete("/v1/streams/b-secret").status_code == 204

        # B's streams are exactly as before A's attempts
        for sid in ids:
            assert b.get(f"/v1/streams/{sid}/particles").json() == before[sid], sid
        assert b.get(f"/v1/streams/{ids[0]}").json()["step"] == 1

        # and A's answers were exactly those for ids that do not exist
        for sid in ids:
            assert b.delete(f"/v1/streams/{sid}").status_code == 204
        assert _answers(server, ids, events) == while_they_exist


# ---------------------------------------------------------------------------------------------- key handling
def test_keys_are_compared_in_constant_time_against_every_key(redis_url, monkeypatch):
    """Through the HTTP stack: one :func:`hmac.compare_digest` per configured key for every request that carries
    a key — the first key, the last one or none of them — on SHA-256 digests (equal lengths whatever the key)."""
    keys = {f"tenant{i}": f"k{i}-" + secrets.token_hex(8 + i) for i in range(5)}
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(x: bytes, y: bytes) -> bool:
        calls.append((len(x), len(y)))
        return real(x, y)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)

    async def body() -> None:
        settings = Settings(
            api_keys=",".join(f"{t}:{k}" for t, k in keys.items()),
            redis_url=redis_url,
            redis_prefix=f"mpflowtest-{uuid.uuid4().hex}",
        )
        async with serve_in_process(settings) as (_, c):
            for key, status in (
                (keys["tenant0"], 200),
                (keys["tenant4"], 200),
                ("k0-" + "0" * 16, 401),
                (keys["tenant2"][:-1], 401),
                ("x" * 500, 401),
            ):
                calls.clear()
                r = await c.get("/v1/streams", headers=bearer(key))
                assert r.status_code == status and key not in r.text
                assert len(calls) == len(keys), (key[:4], calls)
                assert set(calls) == {(32, 32)}

    asyncio.run(body())


def test_keys_never_appear_in_the_logs(server):
    """Valid and invalid keys, in the Authorization header and in ``?api_key=`` (HTTP and WebSocket): the server's
    whole log — the JSON access log and uvicorn's lines, at INFO — carries none of them, while it does log the
    requests (the WebSocket lines with the key ``<redacted>``)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        sid = c.post("/v1/streams", json=STREAM, headers=bearer(KEY_A)).json()["stream_id"]
        for key in SECRETS:
            no_secret_in(c.get(f"/v1/streams/{sid}", headers=bearer(key)))
            no_secret_in(c.get(f"/v1/streams/{sid}?api_key={key}"))
            no_secret_in(
                c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0, 0]]}, headers=bearer(key))
            )
            no_secret_in(c.get("/v1/nowhere", headers=bearer(key)))
    with connect(f"{server.ws}/v1/streams/{sid}/ws?api_key={KEY_A}") as ws:
        ws.send(json.dumps({"observations": [[0.1, 0.1]]}))
        assert "step" in json.loads(ws.recv(timeout=30))
    assert _ws_refused(f"{server.ws}/v1/streams/{sid}/ws?api_key={WRONG}") == 401
    assert _ws_refused(f"{server.ws}/v1/streams/{sid}/ws", bearer(KEY_B[:-2])) == 401

    log = server.log()
    for key in SECRETS:
        for fragment in (key, key[: len(key) // 2 + 4], key[-12:]):
            assert fragment not in log, f"a key fragment is in the server's log: {fragment[:6]}…"
    assert '"route":"/v1/streams/{stream_id}"' in log and '"tenant":"tenantA"' in log  # the access log is there
    assert "WebSocket" in log and "api_key=<redacted>" in log  # uvicorn's WebSocket lines, redacted
    assert "ERROR" not in log  # refused handshakes are answered (401), not logged as failures
