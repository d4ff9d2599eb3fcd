"""The dashboard opened late: a stream page opened after 30 observations were posted draws those 30 steps (read from
``GET .../history``), lists the observations, draws observed values on the traces where an observation is a vector
of the state's size, and names the dimensions by the family's ``state_names`` (headless Chromium, as in
``test_dashboard``)."""

from __future__ import annotations

import json
import math

import httpx

from tests.e2e.test_dashboard import ARTIFACTS, WAIT_MS, PageLog, _wait_step, browser  # noqa: F401  (fixture)

STEPS = 30
EYE = [[1.0, 0.0], [0.0, 1.0]]


def _count(page, element_id: str, n: int) -> None:
    page.wait_for_function(
        "([id, n]) => document.getElementById(id).textContent === String(n)", arg=[element_id, n], timeout=WAIT_MS
    )


def _range_bearing(m: int) -> list[float]:
    """What a sensor at the origin sees of a target moving from (5, 5) at (0.5, 0.25) per step, at step m."""
    px, py = 5.0 + 0.5 * m, 5.0 + 0.25 * m
    return [round(math.hypot(px, py) + 0.013 * math.sin(m), 3), round(math.atan2(py, px) + 0.001 * m, 4)]


def _post(client: httpx.Client, stream_id: str, seq: int, observations: list) -> None:
    r = client.post(f"/v1/streams/{stream_id}/observations", json={"seq": seq, "observations": observations})
    assert r.status_code == 200, r.text


def test_a_page_opened_late_shows_the_earlier_steps_and_their_observations(browser, open_server: str) -> None:  # noqa: F811
    url = open_server
    with httpx.Client(base_url=url, timeout=30) as client:
        prior = {
            "type": "gaussian",
            "mean": [5.0, 5.0, 0.5, 0.25],
            "cov": [[float(i == j) for j in range(4)] for i in range(4)],
        }
        create = {"stream_id": "late", "model": {"family": "range_bearing"}, "prior": prior, "method": "smc"}
        assert client.post("/v1/streams", json={**create, "num_particles": 128, "seed": 3}).status_code == 201
        observed = [_range_bearing(m) for m in range(1, STEPS + 1)]
        for seq in range(1, STEPS + 1, 5):  # six requests of five steps, the first step of each with its dt
            batch = [{"value": observed[seq - 1], "dt": 1.0}, *observed[seq : seq + 4]]
            _post(client, "late", seq, batch)
        _post(client, "late", 26, [{"value": observed[25], "dt": 1.0}, *observed[26:30]])  # a retry: recorded once

        gauss = {"type": "gaussian", "mean": [0.0, 0.0], "cov": EYE}
        create = {"stream_id": "vector", "model": {"family": "linear_gaussian"}, "prior": gauss, "method": "kalman"}
        assert client.post("/v1/streams", json=create).status_code == 201
        _post(client, "vector", 1, [[round(0.1 * m, 2), round(-0.05 * m, 3)] for m in range(1, STEPS + 1)])

        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        log = PageLog(page)
        page.goto(f"{url}/streams/late")
        _wait_step(page, STEPS)
        _count(page, "history-count", STEPS)  # steps 1..30, all from before the page opened
        assert page.inner_text("#history-kept") == "500"
        assert page.locator("#dim-x option").all_inner_texts() == ["px", "py", "vx", "vy"]
        assert page.locator("#bands canvas").count() == 4
        # [range, bearing] is not a state vector: the observations are listed, the latest first, none on the traces
        assert page.locator("#observations-figure").is_visible()
        rows = page.locator("#observations tbody tr")
        assert rows.count() == 12
        assert [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.step)")] == list(range(30, 18, -1))
        cells = rows.first.locator("td").all_inner_texts()
        assert cells[0] == "30" and cells[1] == "" and json.loads(cells[2]) == observed[29]
        assert rows.nth(4).locator("td").all_inner_texts()[1] == "1"  # step 26: posted with dt = 1.0
        assert page.locator("#observed-legend").is_hidden()
        assert page.inner_text("#observations-note") == f"latest 12 of {STEPS}"

        _post(client, "late", STEPS + 1, [[12.5, 0.55]])  # an update while the page is open: listed too
        _wait_step(page, STEPS + 1)
        page.wait_for_function(
            "() => document.querySelector('#observations tbody tr').dataset.step === '31'", timeout=WAIT_MS
        )
        _count(page, "history-count", STEPS + 1)
        assert json.loads(page.locator("#observations tbody tr td").nth(2).inner_text()) == [12.5, 0.55]
        page.screenshot(path=str(ARTIFACTS / "dashboard_history.png"), full_page=True)

        page.goto(f"{url}/streams/vector")  # observations of the state's size: drawn on each dimension's trace
        _wait_step(page, STEPS)
        _count(page, "history-count", STEPS)
        page.wait_for_function(
            "() => [...document.querySelectorAll('#bands canvas')].every(c => c.dataset.observed === '30')",
            timeout=WAIT_MS,
        )
        assert page.locator("#dim-x option").all_inner_texts() == ["x[0]", "x[1]"]
        assert page.locator("#observed-legend").is_visible()
        page.close()
    assert not log.errors, log.errors
    outside = [u for u in log.urls if not u.startswith(url)]
    assert not outside, f"the page reached beyond its origin: {outside}"
