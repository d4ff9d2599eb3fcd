"""The dashboard names what runs a stream: ``mpf`` without a trained operator that fits the stream is its untrained
base flow, and the list and the stream page say so (headless Chromium, as in ``test_dashboard``)."""

from __future__ import annotations

import httpx

from tests.e2e.test_dashboard import WAIT_MS, PageLog, _wait_step, browser  # noqa: F401  (fixture)


def test_mpf_without_an_operator_reads_as_the_base_flow(browser, open_server: str) -> None:  # noqa: F811
    url = open_server
    with httpx.Client(base_url=url, timeout=30) as client:
        prior = {"type": "gaussian", "mean": [0.0, 0.0, 0.0], "cov": [[1, 0, 0], [0, 1, 0], [0, 0, 1]]}
        for stream_id, family in (("base-flow", "linear_gaussian"), ("trained", None)):
            body = {"stream_id": stream_id, "model": {"family": family or "linear_gaussian"}, "method": "mpf"}
            if family is None:  # d = 2: the shipped linear_gaussian-d2 operator fits
                body["prior"] = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1, 0], [0, 1]]}
            else:  # d = 3: no shipped operator fits
                body["prior"] = prior
            r = client.post("/v1/streams", json=body)
            assert r.status_code == 201, r.text
        assert r.json()["operator"] is not None and client.get("/v1/streams/base-flow").json()["operator"] is None

        page = browser.new_page(viewport={"width": 1100, "height": 800})
        log = PageLog(page)
        page.goto(f"{url}/")
        row = page.locator("#streams tbody tr[data-stream-id='base-flow']")
        row.wait_for(timeout=WAIT_MS)
        assert row.locator("td").nth(2).inner_text() == "mpf (base flow, no operator)"
        trained = page.locator("#streams tbody tr[data-stream-id='trained'] td").nth(2).inner_text()
        assert trained.startswith("mpf (linear_gaussian-d2-v")
        page.goto(f"{url}/streams/base-flow")
        _wait_step(page, 0)
        assert page.inner_text("#method") == "mpf (base flow, no operator)"
        assert page.locator("#dim-x option").all_inner_texts() == ["x[0]", "x[1]", "x[2]"]
        page.close()
    assert not log.errors, log.errors
