"""A weighted ``mpf`` cloud on the dashboard: a stream of ``mpf`` with ``flow_fraction: "auto"`` carries importance
weights between steps, as ``smc`` does, and says so in its document (``capabilities.weighted``, declared by the
method); the page draws its particles by weight (opacity ∝ weight) and shows its ESS trace, and draws an ``mpf``
stream with the default share (uniform particles) with one opacity and no ESS trace (headless Chromium, as in
``test_dashboard``)."""

from __future__ import annotations

import httpx
import numpy as np

from tests.e2e.test_dashboard import (  # noqa: F401  (fixture)
    ARTIFACTS,
    PageLog,
    _cloud,
    _example,
    _wait_step,
    browser,
)

STEPS = 12
N = 256


def _create(client: httpx.Client, ex, stream_id: str, options: dict) -> tuple[dict, dict]:
    """A 4-d constant-velocity tracking stream of mpf with ``options``; (its model parameters, its document)."""
    params = ex.constant_velocity(dt=1.0, q=0.05, r=0.5)
    prior = {"type": "gaussian", "mean": [0.0, 0.0, 0.5, 0.25], "cov": np.diag([4.0, 4.0, 0.05, 0.05]).tolist()}
    body = {"stream_id": stream_id, "model": {"family": "lds", "params": params}, "prior": prior, "method": "mpf"}
    r = client.post("/v1/streams", json={**body, "method_options": options, "num_particles": N, "seed": 7})
    assert r.status_code == 201, r.text
    return params, r.json()


def test_a_weighted_mpf_cloud_is_drawn_by_weight_with_its_ess(browser, open_server: str) -> None:  # noqa: F811
    ex = _example()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    url = open_server
    with httpx.Client(base_url=url, timeout=30) as client:
        params, weighted = _create(client, ex, "auto-share", {"flow_fraction": "auto", "correct": True})
        _, uniform = _create(client, ex, "full-flow", {})
        assert weighted["capabilities"]["weighted"] is True and weighted["capabilities"]["exact"] is False
        assert uniform["capabilities"]["weighted"] is False
        models = client.get("/v1/models").json()
        assert models["capabilities"]["mpf"]["weighted_with"] == {"flow_fraction": "auto"}
        assert models["capabilities"]["smc"]["weighted"] is True and models["capabilities"]["kalman"]["exact"] is True

        # one step at a time until the stored cloud carries unequal weights (a step whose ESS stayed above the
        # resampling threshold): its particles must then be drawn with unequal opacities
        _, obs = ex.simulate(params, np.array([0.0, 0.0, 0.5, 0.25]), STEPS, np.random.default_rng(3))
        for m in range(1, STEPS + 1):
            answers = {
                stream_id: client.post(
                    f"/v1/streams/{stream_id}/observations", json={"seq": m, "observations": [obs[m - 1].tolist()]}
                )
                for stream_id in ("auto-share", "full-flow")
            }
            assert all(r.status_code == 200 for r in answers.values()), [r.text for r in answers.values()]
            answer = answers["auto-share"].json()
            if answer["summary"]["ess"] < N - 1:
                break
        else:
            raise AssertionError(f"the auto share resampled at every one of {STEPS} steps: no weighted cloud to draw")
        step, ess = answer["step"], answer["per_step"][-1]["ess"]  # the trace shows each step's ESS
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        log = PageLog(page)
        page.goto(f"{url}/streams/auto-share")
        _wait_step(page, step)
        drawn = _cloud(page)
        low, high = (float(v) for v in drawn["opacity"].split(","))
        assert drawn["weighted"] == "true" and low < high, drawn  # opacity ∝ weight: the weights differ
        assert page.locator("#ess-figure").is_visible()
        assert page.inner_text("#ess-note") == f"latest {ess:.1f} of {N}"
        page.locator("#cloud").screenshot(path=str(ARTIFACTS / "dashboard_weighted_mpf.png"))

        page.goto(f"{url}/streams/full-flow")
        _wait_step(page, step)
        drawn = _cloud(page)
        assert drawn["weighted"] == "false" and drawn["opacity"] == "0.350,0.350", drawn
        assert page.locator("#ess-figure").is_hidden()
        page.close()
    assert not log.errors, log.errors


def test_the_evidence_trace_bands_the_increments_standard_error(browser, open_server: str) -> None:  # noqa: F811
    """``mpf``'s marginal filter (its default on SV) reports each increment's ``log_evidence_sd``: the evidence trace
    draws ± 1.96 of it around the increments and the note gives the latest's, live and from the history after a
    reload; an ``smc`` stream, which reports none, gets no band."""
    url = open_server
    sv = {"family": "stochastic_volatility", "params": {}}
    prior = {"type": "gaussian", "mean": [-1.0], "cov": [[0.5]]}
    returns = [0.2, -0.4, 2.5]
    with httpx.Client(base_url=url, timeout=30) as client:
        for stream_id, method in (("sv-mpf", "mpf"), ("sv-smc", "smc")):
            body = {"stream_id": stream_id, "model": sv, "prior": prior, "method": method, "num_particles": 128}
            r = client.post("/v1/streams", json={**body, "seed": 5})
            assert r.status_code == 201, r.text
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        log = PageLog(page)
        page.goto(f"{url}/streams/sv-mpf")
        _wait_step(page, 0)
        for m, value in enumerate(returns, start=1):  # live: one event per step
            r = client.post("/v1/streams/sv-mpf/observations", json={"seq": m, "observations": [[value]]})
            assert r.status_code == 200, r.text
        sd = r.json()["per_step"][-1]["log_evidence_sd"]
        _wait_step(page, len(returns))
        note = f"latest {r.json()['per_step'][-1]['log_evidence_increment']:.3f} ± {1.96 * sd:.3f}"
        page.wait_for_function("n => document.getElementById('evidence-note').textContent === n", arg=note)
        assert page.eval_on_selector("#evidence", "c => c.dataset.banded") == str(len(returns))
        page.reload()  # the same steps from the stream's history
        _wait_step(page, len(returns))
        page.wait_for_function("n => document.getElementById('evidence-note').textContent === n", arg=note)
        assert page.eval_on_selector("#evidence", "c => c.dataset.banded") == str(len(returns))
        page.locator("#evidence").screenshot(path=str(ARTIFACTS / "dashboard_evidence_band.png"))

        r = client.post("/v1/streams/sv-smc/observations", json={"seq": 1, "observations": [[v] for v in returns]})
        assert r.status_code == 200, r.text
        page.goto(f"{url}/streams/sv-smc")
        _wait_step(page, len(returns))
        page.wait_for_function("() => document.getElementById('evidence-note').textContent.startsWith('latest ')")
        assert "±" not in page.inner_text("#evidence-note")
        assert page.eval_on_selector("#evidence", "c => c.dataset.banded") == "0"
        page.close()
    assert not log.errors, log.errors
