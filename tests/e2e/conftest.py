"""Shared set-up of the end-to-end tests: one open server (no API keys) for the dashboard tests of every module.

Each dashboard test creates streams of its own ids and reads only them, so the tests that need no API keys share
``open_server`` — one ``python -m mpflow serve`` start (torch in each worker) for the session instead of one per
test; the API-key test starts a server of its own (it stops it to read the whole log).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def open_server() -> Iterator[str]:
    """The base URL of a dashboard server with no API keys (:func:`tests.e2e.test_dashboard.server`)."""
    from tests.e2e.test_dashboard import server  # skips, with the reason, without Chromium or Playwright

    with server() as (url, _, _):
        yield url
