"""``/docs`` (Swagger UI) and ``/redoc`` work offline: headless Chromium with every request beyond the server's own
origin refused must still render the API's operations.

The pages' JavaScript and CSS come from the installed ``fastapi-offline`` package (served under
``/docs-assets``), not from a CDN. Skipped, with the reason, without Chromium, Playwright or a reachable Redis
(failed instead under ``CI``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from mpflow.service.api.docs import CDN_LOGO, REDOC_JS
from mpflow.service.app import DOCS_ASSETS

from tests.e2e.test_dashboard import WAIT_MS, PageLog, _sync, browser  # noqa: F401  (fixture)
from tests.harness.server import drop_prefix, serve_in_thread
from tests.integration.conftest import redis_url  # noqa: F401  (the real-Redis fixture)
from tests.integration.test_api_streams import settings

#: operations every page must show (their summaries)
OPERATIONS = ("Create a stream", "Apply observations (seq: exactly once)", "The stream document", "Delete a stream")


@pytest.fixture(scope="module")
def url(redis_url: str) -> Iterator[str]:  # noqa: F811
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    try:
        with serve_in_thread(settings(redis_url, prefix)) as base:
            yield base
    finally:
        _sync(drop_prefix(redis_url, prefix))


def _offline_page(chromium, origin: str):
    """A page whose requests beyond ``origin`` are refused as if offline (and listed in ``page.refused``)."""
    page = chromium.new_page(viewport={"width": 1280, "height": 1000})
    refused: list[str] = []

    def route(r) -> None:
        if r.request.url.startswith(origin):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort("internetdisconnected")

    page.route("**/*", route)
    page.refused = refused
    return page


def test_the_assets_are_served_from_the_package(url: str) -> None:
    html = httpx.get(f"{url}/docs").text
    assert f"{DOCS_ASSETS}/swagger-ui-bundle.js" in html and "cdn." not in html
    redoc = httpx.get(f"{url}/redoc").text
    assert f"{DOCS_ASSETS}/favicon.png" in redoc and "cdn." not in redoc  # its bundle: the next test
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        r = httpx.get(f"{url}{DOCS_ASSETS}/{name}")
        assert r.status_code == 200 and len(r.content) > 100_000, name


def test_swagger_ui_renders_the_operations_offline(url: str, browser) -> None:  # noqa: F811
    page = _offline_page(browser, url)
    log = PageLog(page)
    page.goto(f"{url}/docs")
    page.locator(".opblock").first.wait_for(timeout=WAIT_MS)
    summaries = page.locator(".opblock-summary-description").all_inner_texts()
    assert all(op in summaries for op in OPERATIONS), summaries
    assert page.locator(".opblock").count() >= 12
    page.locator(".opblock-summary", has_text="Create a stream").first.click()  # an operation opens: its text
    page.get_by_text("Open a stream: a model family").first.wait_for(timeout=WAIT_MS)
    page.close()
    assert not page.refused, f"the page reached beyond its origin: {page.refused}"
    assert not log.errors, log.errors


def test_redoc_renders_the_operations_offline(url: str, browser) -> None:  # noqa: F811
    page = _offline_page(browser, url)
    log = PageLog(page)
    page.goto(f"{url}/redoc")
    page.get_by_role("heading", name="Create a stream").first.wait_for(timeout=WAIT_MS)
    for op in OPERATIONS:
        assert page.get_by_role("heading", name=op).count() >= 1, op
    page.close()
    # ReDoc's bundle asked for one thing beyond the server, the vendor's logo; the served copy does not (redoc_page)
    assert not page.refused, f"the page reached beyond its origin: {page.refused}"
    assert not [e for e in log.errors if "ERR_INTERNET_DISCONNECTED" not in e], log.errors


def test_the_served_redoc_bundle_names_no_address_beyond_the_server(url: str) -> None:
    """Without a browser: the page loads the served bundle, which has no CDN logo left (the package's copy has)."""
    page = httpx.get(f"{url}/redoc", timeout=30).text
    assert REDOC_JS in page and "cdn." not in page and "fonts.googleapis" not in page
    bundle = httpx.get(f"{url}{REDOC_JS}", timeout=30)
    assert bundle.status_code == 200 and bundle.headers["content-type"].startswith("application/javascript")
    assert CDN_LOGO not in bundle.text and "cdn.redoc.ly" not in bundle.text and "API docs by Redocly" in bundle.text
