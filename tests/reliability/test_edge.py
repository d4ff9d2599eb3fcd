"""The service's edge (issue 54, items 4, 5 and 6b), against ``python -m mpflow serve --workers 1`` with two tenants
(:func:`tests.harness.isolation.tenant_server`) and the attacks of :mod:`tests.harness.attacks`:

* slow request heads: 800 keyless connections each sending a header line every 2 s are dropped once
  ``MPFLOW_HEADER_TIMEOUT_S`` passes (all of them were still open after 30 s before), with the API's JSON 408,
  while another tenant's requests are answered; the deadline also runs from a keep-alive connection's previous
  answer;
* the connection cap: past ``MPFLOW_MAX_CONNECTIONS`` a connection is answered a JSON 503 at once and closed, and
  once connections close, new ones are served again;
* every stream id is checked against the one id pattern: a batch update's ``stream_id`` (a lone surrogate, which
  answered 500, and ``""`` or store-key syntax, which were looked up) and a path's are 422 naming the field;
* what the HTTP parser refuses itself (a 100 KB path, a malformed request line or header) and a head over 64 KiB
  are answered with the API's JSON error body, not uvicorn's ``text/plain``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.harness import attacks
from tests.harness.isolation import ALPHA, BETA, tenant_server

HEAD_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 900  # above the 800 slow heads (and the probes), below what the cap test opens


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    env = {
        "MPFLOW_HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "MPFLOW_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "MPFLOW_BODY_READ_TIMEOUT_S": "60",  # the cap test's held requests wait for their bodies this long
    }
    with tenant_server(tmp_path_factory.mktemp("edge") / "service.log", env) as server:
        yield server.url


def test_slow_heads_are_dropped_while_another_tenant_is_served(url):
    out = attacks.slow_heads(url, 800, every=2.0, seconds=30.0)
    # ≥ 90 % dropped within the 30 s (before: 800 of 800 still open); in fact all of them, soon after the deadline
    assert out["dropped_90_percent_after_s"] is not None, out
    assert out["still_open"] == 0, out
    assert out["dropped_90_percent_after_s"] < HEAD_TIMEOUT_S + 10, out
    # each had sent part of a head: the API's 408, as JSON
    assert out["status"] == {"HTTP/1.1 408": 800}, out
    other = out["other_tenant"]
    assert other["statuses"] == ["200"] and other["requests"] >= 3, other  # while the slow heads were held
    assert other["max_s"] < 5, other


def test_the_deadline_runs_again_after_a_keep_alive_answer(url):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        first = sock.recv(65536)
        while first and not first.endswith(b"}"):  # the whole first answer (its JSON body), however it was split
            first += (more := sock.recv(65536))
            assert more, first
        assert first.startswith(b"HTTP/1.1 200"), first
        t0 = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head, never finished
        sock.settimeout(0.5)
        answer = b""
        while time.monotonic() - t0 < HEAD_TIMEOUT_S + 10:  # (before: held for as long as the lines came)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b"X-Dribble: 1\r\n")  # a header line every 0.5 s: no help
                continue
            except ConnectionResetError:  # a line sent as the server closed; its answer was read first
                break
            if not chunk:
                break
            if not answer:
                seconds = time.monotonic() - t0
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert attacks.error_of(answer)["code"] == "header_timeout", answer
    assert HEAD_TIMEOUT_S * 0.9 <= seconds < HEAD_TIMEOUT_S + 5, seconds


def test_past_the_connection_cap_a_json_503_then_served_again(url):
    out = attacks.connection_cap(url, MAX_CONNECTIONS, 30)
    # a few of the 30 may still fit (the connections of earlier tests close asynchronously): most are refused
    assert out["status"].get("HTTP/1.1 503", 0) >= 25, out
    assert set(out["status"]) <= {"HTTP/1.1 503", "closed without an answer"}, out
    assert out["codes"] == ["too_many_connections"], out
    assert out["with_retry_after"] == out["status"]["HTTP/1.1 503"], out
    assert out["refused"], out
    # the held connections are closed: served again
    deadline = time.monotonic() + 10
    while (status := httpx.get(f"{url}/v1/streams", headers=BETA, timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.mark.parametrize("what", sorted(attacks.BAD_BATCH_IDS))
def test_a_batch_stream_id_off_the_pattern_is_422_naming_it(url, what):
    (label, run), *_ = [plan for plan in attacks.batch_ids(url, 30) if what in plan[0]]
    out = run()
    # before: the lone surrogate answered 500 internal_error, "" and "../../x}:{a}" were looked up (200, each 404)
    assert out["status"] == 422, (label, out)
    assert out["detail"].startswith("updates[0].stream_id:"), (label, out)


def test_a_path_stream_id_off_the_pattern_is_422_naming_it(url):
    for path in ("/v1/streams/%ED%A0%80", "/v1/streams/%20/particles", "/v1/streams/" + "a" * 129 + "/history"):
        r = httpx.get(url + path, headers=ALPHA, timeout=10)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["error"]["message"].startswith("stream_id: "), (path, r.text)  # never the id echoed
    r = httpx.delete(f"{url}/v1/streams/{'b' * 200}", headers=ALPHA, timeout=10)
    assert r.status_code == 422 and "bbbb" not in r.text, r.text


@pytest.mark.parametrize("what", sorted(attacks.BAD_HEADS))
def test_what_the_parser_refuses_is_answered_with_the_json_error_body(url, what):
    (label, run), *_ = [plan for plan in attacks.bad_heads(url) if what in plan[0]]
    out = run()
    # before: "Invalid HTTP request received." as text/plain (and a 200 KB header was read and answered 200)
    assert out["refused"], (label, out)
    refusals = {("HTTP/1.1 400", "bad_request"), ("HTTP/1.1 431", "header_too_large")}
    expected = {
        "a 100 KB path": refusals,  # the parser's limit or the head's size, whichever the bytes' chunks meet first
        "a 200 KB header": {("HTTP/1.1 431", "header_too_large")},
    }.get(what, {("HTTP/1.1 400", "bad_request")})
    assert (out["status"], out["code"]) in expected, (label, out)
