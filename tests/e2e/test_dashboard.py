"""The dashboard, end to end: ``python -m mpflow serve`` as a user starts it, the page in headless Chromium.

A server subprocess (real Redis, a fresh key prefix) serves the page; Playwright drives Debian's
``/usr/bin/chromium``. Observations are POSTed through the API by another client (httpx), and the page must
follow them live — the step counter and the plotted particles change — without reaching beyond its origin.
With API keys on, the page asks for a key and shows only that key's tenant's streams.

Screenshots go to ``tests/artifacts/`` (git-ignored); ``dashboard_tracking.png`` — a 30-step constant-velocity
tracking run — is the one in the README (``service/dashboard/screenshot.png``).

Skipped, with the reason, without Chromium, Playwright or a reachable Redis (failed instead under ``CI``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.harness.server import drop_prefix, redis_answers, serve_as_user

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REDIS_URL = os.environ.get("MPFLOW_REDIS_URL") or "redis://127.0.0.1:6379/0"
KEYS = {"tenant-a": "key-a-5b1f0c", "tenant-b": "key-b-93d2e7"}
WAIT_MS = 20_000


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


def _example():
    """examples/track_target.py (the constant-velocity model and its simulator), imported from its file."""
    spec = importlib.util.spec_from_file_location("track_target", ROOT / "examples" / "track_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync(coro):
    """Run a coroutine to its end on a thread of its own (Playwright's sync API holds this thread's loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@contextlib.contextmanager
def server(api_keys: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """``python -m mpflow serve`` on a free port with a fresh store prefix; yields (base URL, process, its log file)."""
    if not _sync(redis_answers(REDIS_URL)):
        _skip_or_fail(f"no Redis reachable at {REDIS_URL} (set MPFLOW_REDIS_URL or start redis-server)")
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {"MPFLOW_REDIS_PREFIX": prefix, "MPFLOW_LOG_LEVEL": "INFO"}
    env["MPFLOW_API_KEYS"] = ",".join(f"{t}:{k}" for t, k in (api_keys or {}).items())
    log_file = Path(tempfile.mkdtemp(prefix="mpflow-dashboard-")) / "server.log"
    try:
        with serve_as_user(env, log_file, args=["--redis-url", REDIS_URL], start_timeout=90) as srv:
            yield srv.url, srv.proc, log_file
    finally:
        _sync(drop_prefix(REDIS_URL, prefix))
        shutil.rmtree(log_file.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class PageLog:
    """Every request URL and every console error / uncaught exception of a page."""

    def __init__(self, page) -> None:
        self.urls: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))


def _cloud(page) -> dict[str, str]:
    """What the particle canvas says it drew."""
    return page.eval_on_selector("#cloud", "c => ({...c.dataset})")


def _wait_step(page, step: int) -> None:
    page.wait_for_function(
        "s => document.getElementById('step').textContent === String(s)"
        " && document.getElementById('cloud').dataset.step === String(s)",
        arg=step,
        timeout=WAIT_MS,
    )


def _tracking_stream(client: httpx.Client, ex, stream_id: str, method: str, n: int) -> dict:
    params = ex.constant_velocity(dt=1.0, q=0.05, r=0.5)
    prior = {"type": "gaussian", "mean": [0.0, 0.0, 0.5, 0.25], "cov": np.diag([4.0, 4.0, 0.05, 0.05]).tolist()}
    body = {
        "stream_id": stream_id,
        "model": {"family": "lds", "params": params},
        "prior": prior,
        "method": method,
        "num_particles": n,
        "seed": 7,
    }
    r = client.post("/v1/streams", json=body)
    assert r.status_code == 201, r.text
    return params


def test_page_follows_a_tracking_stream_live(browser, open_server: str) -> None:
    """List → stream page; each POSTed observation moves the step counter, the particles and the traces."""
    ex = _example()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    url = open_server
    with httpx.Client(base_url=url, timeout=30) as client:
        params = _tracking_stream(client, ex, "target-1", "smc", 256)
        rng = np.random.default_rng(3)
        _, obs = ex.simulate(params, np.array([0.0, 0.0, 0.5, 0.25]), 30, rng)

        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        log = PageLog(page)
        page.goto(f"{url}/")
        row = page.locator("#streams tbody tr[data-stream-id='target-1']")
        row.wait_for(timeout=WAIT_MS)
        assert [c.strip() for c in row.locator("td").all_inner_texts()[1:4]] == ["lds", "smc", "0"]
        row.locator("a").click()
        page.wait_for_url(f"{url}/streams/target-1")
        _wait_step(page, 0)
        before = _cloud(page)
        assert before["points"] == "256"
        assert page.locator("#key-view").is_hidden()

        r = client.post("/v1/streams/target-1/observations", json={"seq": 1, "observations": [obs[0].tolist()]})
        assert r.status_code == 200, r.text
        _wait_step(page, 1)
        after = _cloud(page)
        assert after["points"] == "256"
        assert after["hash"] != before["hash"] and after["first"] != before["first"]

        for m in range(2, 31):  # the rest of the run, one request per step as a tracker sends them
            r = client.post("/v1/streams/target-1/observations", json={"seq": m, "observations": [obs[m - 1].tolist()]})
            assert r.status_code == 200, r.text
        _wait_step(page, 30)
        final = _cloud(page)
        assert final["hash"] != after["hash"]
        # every step since the page opened is in the traces: 0..30, one band per state dimension, ESS (smc)
        assert page.inner_text("#history-count") == "31"
        assert page.locator("#bands canvas").count() == 4
        assert page.locator("#ess-figure").is_visible()
        assert page.inner_text("#evidence-note").startswith("latest ")
        page.screenshot(path=str(ARTIFACTS / "dashboard_tracking.png"), full_page=True)

        page.select_option("#cloud-mode", "density")  # the density view of the same cloud, zoomed in on it
        page.select_option("#cloud-fit", "cloud")
        assert _cloud(page)["hash"] == final["hash"]
        page.locator("#cloud").screenshot(path=str(ARTIFACTS / "dashboard_density.png"))
        page.close()
    assert not log.errors, log.errors
    outside = [u for u in log.urls if not u.startswith(url)]
    assert not outside, f"the page reached beyond its origin: {outside}"


def test_events_feed_pushes_each_applied_update(open_server: str) -> None:
    """GET /v1/streams/{id}/events: the document, then one event per update (with every step of a batch)."""
    with httpx.Client(base_url=open_server, timeout=30) as client:
        documented = client.get("/openapi.json").json()["paths"]["/v1/streams/{stream_id}/events"]["get"]
        assert "text/event-stream" in documented["responses"]["200"]["content"]
        assert {"404", "503"} <= set(documented["responses"])  # (401 only where keys are on)
        ex = _example()
        _tracking_stream(client, ex, "feed-1", "kalman", 16)
        with client.stream("GET", "/v1/streams/feed-1/events") as feed:
            assert feed.status_code == 200
            assert feed.headers["content-type"].startswith("text/event-stream")
            lines = feed.iter_lines()

            def next_event() -> tuple[str, dict]:
                name, data = "", ""
                for line in lines:
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif line == "" and name:
                        return name, json.loads(data)
                raise AssertionError("the feed ended")

            name, doc = next_event()
            assert (name, doc["stream_id"], doc["step"]) == ("stream", "feed-1", 0)
            body = {"seq": 1, "observations": [[0.1, 0.2], [0.3, 0.1], [0.5, 0.4]]}
            answer = client.post("/v1/streams/feed-1/observations", json=body).json()
            dup = client.post("/v1/streams/feed-1/observations", json=body).json()  # nothing applied: no event
            assert dup["duplicate"] is True
            client.post("/v1/streams/feed-1/observations", json={"seq": 4, "observations": [[0.6, 0.5]]})
            name, event = next_event()
            assert name == "update" and event["step"] == 3
            assert [p["step"] for p in event["per_step"]] == [1, 2, 3]
            assert event["per_step"] == answer["per_step"]
            assert "cov" not in event["summary"] and event["summary"]["mean"] == answer["summary"]["mean"]
            name, event = next_event()
            assert (name, event["step"]) == ("update", 4)
        assert client.get("/v1/streams/nope/events").status_code == 404


def test_with_api_keys_the_page_asks_for_a_key_and_shows_only_its_tenant(browser) -> None:
    with server(KEYS) as (url, proc, log_file):
        ex = _example()
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {KEYS['tenant-a']}"}) as a:
            _tracking_stream(a, ex, "stream-of-a", "smc", 64)
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {KEYS['tenant-b']}"}) as b:
            _tracking_stream(b, ex, "stream-of-b", "smc", 64)
            # the feed is scoped like every route: 401 without a key, 404 for another tenant's stream
            assert httpx.get(f"{url}/v1/streams/stream-of-b/events").status_code == 401
            other = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
            assert httpx.get(f"{url}/v1/streams/stream-of-b/events", headers=other).status_code == 404

        page = browser.new_page(viewport={"width": 1100, "height": 800})
        log = PageLog(page)
        page.goto(f"{url}/")
        page.locator("#key-input").wait_for(state="visible", timeout=WAIT_MS)
        assert page.locator("#list-view").is_hidden()
        page.fill("#key-input", "not-a-key")
        page.click("#key-form button[type=submit]")
        page.wait_for_function(
            "() => document.getElementById('key-error').textContent.includes('did not accept')", timeout=WAIT_MS
        )
        page.fill("#key-input", KEYS["tenant-a"])
        page.click("#key-form button[type=submit]")
        page.locator("#streams tbody tr[data-stream-id='stream-of-a']").wait_for(timeout=WAIT_MS)
        assert page.locator("#streams tbody tr").count() == 1
        assert "stream-of-b" not in page.content()
        page.screenshot(path=str(ARTIFACTS / "dashboard_tenant_a.png"), full_page=True)

        page.goto(f"{url}/streams/stream-of-b")  # the key is remembered for the tab; B's stream is not found
        page.wait_for_function(
            "() => document.getElementById('status').textContent.startsWith('No stream')", timeout=WAIT_MS
        )
        assert page.inner_text("#step") == "–"
        page.goto(f"{url}/streams/stream-of-a")
        _wait_step(page, 0)
        page.close()
        assert not [u for u in log.urls if KEYS["tenant-a"] in u], "the key appeared in a URL"
        assert all(u.startswith(url) for u in log.urls)
        proc.terminate()
        proc.wait(30)
        server_log = log_file.read_text()
    assert server_log, "the server logged nothing"
    assert all(k not in server_log for k in KEYS.values()), "an API key appeared in the server log"
    assert '"route":"/v1/streams/{stream_id}/events"' in server_log
