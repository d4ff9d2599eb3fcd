"""The HTTP API end to end in process (httpx over ASGI) against a real Redis (``MPFLOW_REDIS_URL``, else
redis://127.0.0.1:6379/0). Each test uses a fresh key prefix and deletes its keys afterwards. Without a reachable
Redis the tests fail under CI and are skipped elsewhere. Coroutines run under ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import torch
from fastapi import FastAPI
from mpflow.operators.models import FAMILIES as MODEL_FAMILIES
from mpflow.operators.models import make_model
from mpflow.operators.references import kalman_filter
from mpflow.operators.updaters import UPDATERS
from mpflow.service.engine.catalogue import methods_for
from mpflow.service.engine.default_methods import default_method, model_regime
from mpflow.service.settings import Settings

from tests.harness.server import TENANT_KEYS, drop_prefix, serve_in_process, serve_tenants

Body = Callable[[FastAPI, httpx.AsyncClient], Awaitable[Any]]


def settings(url: str, prefix: str, **overrides: Any) -> Settings:
    return Settings(redis_url=url, redis_prefix=prefix, **overrides)


def run(url: str, body: Body, api_key: str | None = None, **overrides: Any) -> Any:
    """``body(app, client)`` on a fresh app and key prefix; the prefix's keys are deleted afterwards."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> Any:
        try:
            async with serve_in_process(settings(url, prefix, **overrides), api_key) as (app, client):
                return await body(app, client)
        finally:
            await drop_prefix(url, prefix)

    return asyncio.run(main())


GAUSS2 = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}
FAMILIES = {  # family -> (params, prior, two observations)
    "linear_gaussian": ({}, GAUSS2, [[0.5, -1.0], [0.25, -0.75]]),
    "lds": ({"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.0]], "R": [[0.5]]}, GAUSS2, [[0.5], [-0.25]]),
    "gmm": ({"s": 1.0}, GAUSS2, [1.5, [-0.5]]),
    "logistic": (
        {},
        GAUSS2,
        [{"x": [[1.0, 0.0], [0.5, 1.0], [-1.0, 0.5]], "y": [1, 0, 1]}, {"x": [[0.2, -0.3]], "y": [0]}],
    ),
    "stochastic_volatility": ({"phi": 0.9}, GAUSS2, [[0.5, -1.0], [1.5, 0.1]]),
}


def new_stream(family: str, method: str | None, n: int = 16, **extra: Any) -> dict[str, Any]:
    params, prior, _ = FAMILIES[family]
    body = {"model": {"family": family, "params": params}, "prior": prior, "num_particles": n, "seed": 7, **extra}
    if method is not None:
        body["method"] = method
    return body


def check_document(doc: dict[str, Any], d: int, step: int) -> None:
    assert doc["step"] == step and doc["state_dim"] == d
    s = doc["summary"]
    assert len(s["mean"]) == d and len(s["std"]) == d and len(s["cov"]) == d
    assert set(s["quantiles"]) == {"0.025", "0.05", "0.5", "0.95", "0.975"}
    for j in range(d):
        assert s["quantiles"]["0.05"][j] <= s["quantiles"]["0.5"][j] <= s["quantiles"]["0.95"][j]
        assert math.isclose(s["std"][j] ** 2, s["cov"][j][j], rel_tol=1e-9, abs_tol=1e-12)
    if UPDATERS[doc["method"]].gaussian_state:  # kalman, ukf: a Gaussian, not a cloud (issue 38)
        assert s["ess"] is None
    else:
        assert 0 < s["ess"] <= doc["num_particles"] + 1e-6
    assert math.isfinite(s["log_evidence"])
    if step == 0:
        assert s["log_evidence"] == 0.0


COMBOS = [(f, m) for f in FAMILIES for m in methods_for(MODEL_FAMILIES[f])]


def test_round_trip_every_family_and_method(redis_url):
    """create → observe (2 steps, with samples) → get → samples → particles → delete, for every compatible pair."""

    async def body(app: FastAPI, c: httpx.AsyncClient):
        for family, method in COMBOS:
            label = f"{family}/{method}"
            r = await c.post("/v1/streams", json=new_stream(family, method, stream_id=f"{family}-{method}"))
            assert r.status_code == 201, (label, r.text)
            doc = r.json()
            sid = doc["stream_id"]
            assert doc["method"] == method and doc["model"]["family"] == family, label
            check_document(doc, 2, 0)
            obs = FAMILIES[family][2]
            req = {"seq": 1, "observations": obs, "return_samples": 5}
            r = await c.post(f"/v1/streams/{sid}/observations", json=req)
            assert r.status_code == 200, (label, r.text)
            upd = r.json()
            check_document(upd, 2, 2)
            assert upd["duplicate"] is False
            assert [p["step"] for p in upd["per_step"]] == [1, 2]
            inc = sum(p["log_evidence_increment"] for p in upd["per_step"])
            assert math.isclose(inc, upd["summary"]["log_evidence"], rel_tol=1e-6, abs_tol=1e-6), label
            assert len(upd["samples"]) == 5 and all(len(x) == 2 for x in upd["samples"])
            got = (await c.get(f"/v1/streams/{sid}")).json()
            assert got["summary"] == upd["summary"] and got["step"] == 2, label
            r = await c.get(f"/v1/streams/{sid}/samples", params={"n": 40})
            assert r.status_code == 200 and len(r.json()["samples"]) == 40, label
            # the same state gives the same draws (seeded by stream seed and step)
            assert (await c.get(f"/v1/streams/{sid}/samples", params={"n": 40})).json() == r.json()
            p = (await c.get(f"/v1/streams/{sid}/particles")).json()
            assert len(p["particles"]) == 16 and len(p["log_weights"]) == 16
            assert math.isclose(sum(math.exp(lw) for lw in p["log_weights"]), 1.0, rel_tol=1e-9)
            if not UPDATERS[method].weighted:
                assert max(p["log_weights"]) - min(p["log_weights"]) < 1e-9, label
            assert (await c.delete(f"/v1/streams/{sid}")).status_code == 204
            assert (await c.get(f"/v1/streams/{sid}")).status_code == 404

    # the iterative methods are cut short: this test is about the service's plumbing, not their accuracy
    run(redis_url, body, method_options={"nvgd": {"max_iters": 3, "inner_steps": 5}, "gpf": {"max_iters": 40}})


def test_kalman_matches_float64_kalman_filter(redis_url):
    params = {"A": [[0.9, 0.2], [-0.1, 0.8]], "Q": [[0.5, 0.1], [0.1, 0.3]], "B": [[1.0, 0.5]], "R": [[0.25]]}
    mean0, cov0 = [0.5, -1.0], [[2.0, 0.3], [0.3, 1.0]]
    obs = [[0.5], [-1.25], [2.0], [0.75], [-0.5]]

    model = make_model("lds", params, 2, dtype=torch.float64)
    means, covs, logz = kalman_filter(
        torch.tensor([mean0], dtype=torch.float64),
        torch.tensor([cov0], dtype=torch.float64),
        model,
        torch.tensor([obs], dtype=torch.float64),
    )

    async def body(app: FastAPI, c: httpx.AsyncClient):
        spec = {
            "model": {"family": "lds", "params": params},
            "prior": {"type": "gaussian", "mean": mean0, "cov": cov0},
            "method": "kalman",
            "num_particles": 32,
        }
        sid = (await c.post("/v1/streams", json=spec)).json()["stream_id"]
        # 2 steps then 3 steps: the filter is carried across requests through the store
        r1 = (await c.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": obs[:2]})).json()
        r2 = (await c.post(f"/v1/streams/{sid}/observations", json={"seq": 3, "observations": obs[2:]})).json()
        per_step = r1["per_step"] + r2["per_step"]
        for t, entry in enumerate(per_step):
            assert entry["step"] == t + 1
            assert torch.allclose(torch.tensor(entry["mean"], dtype=torch.float64), means[0, t], atol=1e-6, rtol=0)
            std = covs[0, t].diagonal().sqrt()
            assert torch.allclose(torch.tensor(entry["std"], dtype=torch.float64), std, atol=1e-6, rtol=0)
            assert abs(entry["log_evidence_increment"] - float(logz[0, t])) < 1e-6
        s = r2["summary"]
        assert torch.allclose(torch.tensor(s["mean"], dtype=torch.float64), means[0, -1], atol=1e-6, rtol=0)
        assert torch.allclose(torch.tensor(s["cov"], dtype=torch.float64), covs[0, -1], atol=1e-6, rtol=0)
        assert abs(s["log_evidence"] - float(logz[0].sum())) < 1e-6
        # exact Gaussian quantiles: m ± 1.6449 σ
        std = covs[0, -1].diagonal().sqrt()
        q95 = means[0, -1] + 1.6448536269514722 * std
        assert torch.allclose(torch.tensor(s["quantiles"]["0.95"], dtype=torch.float64), q95, atol=1e-6, rtol=0)
        # draws come from the exact posterior: their moments agree within Monte Carlo error
        draws = torch.tensor((await c.get(f"/v1/streams/{sid}/samples", params={"n": 20000})).json()["samples"])
        assert torch.allclose(draws.mean(0).double(), means[0, -1], atol=0.05)

    run(redis_url, body)


def test_default_method_and_reproducibility(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        spec = new_stream("linear_gaussian", None, n=32)
        a = (await c.post("/v1/streams", json={**spec, "stream_id": "a"})).json()
        b = (await c.post("/v1/streams", json={**spec, "stream_id": "b"})).json()
        default = default_method("linear_gaussian", 2, True)  # the benchmark's measured best
        assert a["method"] == default.method and a["method_reason"] == default.reason
        assert a["operator"] is None and a["operator_domain"] is None
        assert a["num_particles"] == 32  # the request's count wins over the default's
        assert a["summary"] == b["summary"]  # same seed, same step-0 cloud
        obs = {"observations": FAMILIES["linear_gaussian"][2]}
        ra = (await c.post("/v1/streams/a/observations", json=obs)).json()
        rb = (await c.post("/v1/streams/b/observations", json=obs)).json()
        assert ra["summary"] == rb["summary"] and ra["per_step"] == rb["per_step"]
        # a generated id; the same id twice is 409
        r = await c.post("/v1/streams", json=spec)
        assert r.status_code == 201 and len(r.json()["stream_id"]) >= 16
        r = await c.post("/v1/streams", json={**spec, "stream_id": "a"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "stream_exists"

    run(redis_url, body)


def test_lorenz96_default_follows_the_regime(redis_url):
    """A Lorenz-96 stream with no method and no num_particles gets the default measured in its regime: the
    spantini2019 one at Δ = 0.4 with every second variable observed, the sakov2008 one at the defaults (Δ = 0.05,
    every variable) — and the answer names it (``method``, ``method_reason``). In the Spantini regime that is the
    iterative EnKF (``ienkf``, measured best there) re-locking by the shipped observer (each step says whether it
    re-locked), whose options are checked with the field named."""
    d = 40
    prior = {"type": "gaussian", "mean": [8.0] * d, "cov": torch.eye(d).tolist()}
    spantini = {"delta": 0.4, "rk4_step": 0.02, "obs_every": 2, "R": 0.5}

    async def body(app: FastAPI, c: httpx.AsyncClient):
        for params, setting in ((spantini, "spantini2019"), ({}, "sakov2008")):
            spec = {"model": {"family": "lorenz96", "params": params}, "prior": prior, "seed": 3}
            r = await c.post("/v1/streams", json=spec)
            assert r.status_code == 201, r.text
            doc = r.json()
            model = make_model("lorenz96", params, d)
            default = default_method("lorenz96", d, False, params=model_regime(model.params))
            assert (doc["method"], doc["method_options"]) == (default.method, default.options)
            assert doc["num_particles"] == default.num_particles and doc["method_reason"] == default.reason
            assert f"Lorenz-96 {setting}" in doc["method_reason"]
            if setting == "spantini2019":
                assert doc["method"] == "ienkf" and f"ienkf N={doc['num_particles']}" in doc["method_reason"], doc
                assert doc["method_options"]["relock"] == "lorenz96-d40-v2", doc
                assert doc["operator_domain"] == {"inside": True, "outside": []}, doc  # the observer's domain
            obs = [[8.0] * (d // int(params.get("obs_every", 1)))]
            r = await c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": obs})
            assert r.status_code == 200 and r.json()["step"] == 1, r.text
            assert ("relocked" in r.json()["per_step"][0]) == (setting == "spantini2019"), r.text
        refused = (
            ({"iterations": 0}, "iterations"),
            ({"tolerance": 2}, "tolerance"),
            ({"correction": "../pretrained/lorenz96-d40-v1"}, "correction"),  # a name, never a path
            ({"correction": "lorenz96-d40-v99"}, "correction"),  # not registered
            ({"correction": "lorenz96-d40-v1"}, "correction"),  # an MPF operator, not a ring correction
            ({"relock": "lorenz96-d40-v1"}, "relock"),  # an MPF operator, not a ring observer
            ({"relock": "lorenz96-d40-v99"}, "relock"),  # not registered
            ({"correction": "lorenz96-d40-v2"}, "correction"),  # the observer is not a correction
        )
        for bad, field in refused:
            spec = {"model": {"family": "lorenz96", "params": spantini}, "prior": prior, "method": "ienkf"}
            r = await c.post("/v1/streams", json={**spec, "num_particles": 40, "method_options": bad})
            assert r.status_code == 422 and f"method_options.{field}" in r.text, r.text
        far = {**spantini, "delta": 1.0}  # beyond the observer's trained Δ: it still runs, and the answer says so
        spec = {"model": {"family": "lorenz96", "params": far}, "prior": prior, "method": "ienkf", "num_particles": 40}
        r = await c.post("/v1/streams", json={**spec, "method_options": {"relock": "lorenz96-d40-v2"}})
        assert r.status_code == 201 and r.json()["operator_domain"]["inside"] is False, r.text
        assert any(p.startswith("delta 1 outside") for p in r.json()["operator_domain"]["outside"]), r.text
        gmm_prior = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
        r = await c.post("/v1/streams", json={"model": {"family": "gmm"}, "prior": gmm_prior, "method": "ienkf"})
        assert r.status_code == 422 and "ienkf needs an observation o = h(x) + N(0, R)" in r.text, r.text

    run(redis_url, body)


def test_default_method_options_and_operator_domain(redis_url):
    """Without a method a stream gets the measured default with its options and particle count; a trained operator
    used outside its training domain says so in the document and in /metrics."""

    async def body(app: FastAPI, c: httpx.AsyncClient):
        d = 20
        prior = {"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}
        sv = {"model": {"family": "stochastic_volatility"}, "prior": prior, "seed": 1}
        doc = (await c.post("/v1/streams", json=sv)).json()
        default = default_method("stochastic_volatility", d, False)
        assert (doc["method"], doc["method_options"]) == (default.method, default.options)
        assert doc["num_particles"] == default.num_particles and doc["method_reason"] == default.reason
        r = await c.post(f"/v1/streams/{doc['stream_id']}/observations", json={"observations": [[0.3] * d, [-1.0] * d]})
        assert r.status_code == 200 and r.json()["step"] == 2 and r.json()["method_options"] == default.options

        unit = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
        wide = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[4.0, 0.0], [0.0, 4.0]]}
        inside = {"model": {"family": "gmm", "params": {"s": 1.0}}, "prior": unit, "method": "mpf"}
        outside = {"model": {"family": "gmm", "params": {"s": 0.5}}, "prior": wide, "method": "mpf"}
        a = (await c.post("/v1/streams", json=inside)).json()
        b = (await c.post("/v1/streams", json=outside)).json()
        assert a["operator"] and a["operator_domain"] == {"inside": True, "outside": []}
        assert b["operator"] == a["operator"] and b["operator_domain"]["inside"] is False
        assert [o.split(" ")[0] for o in b["operator_domain"]["outside"]] == ["s", "prior"]
        assert (await c.get(f"/v1/streams/{b['stream_id']}")).json()["operator_domain"] == b["operator_domain"]
        metrics = (await c.get("/metrics")).text
        line = f'mpflow_streams_outside_operator_domain_total{{family="gmm",operator="{b["operator"]}"}} 1.0'
        assert line in metrics
        # the d = 1 stochastic-volatility operator, named, serves a 3-dimensional stream one dimension at a time
        prior3 = {"type": "gaussian", "mean": [0.0] * 3, "cov": torch.eye(3).tolist()}
        named = {"model": {"family": "stochastic_volatility", "params": {"phi": 0.3}}, "prior": prior3}
        doc = await c.post("/v1/streams", json={**named, "method": "mpf", "operator": "stochastic_volatility-d1-v1"})
        assert doc.status_code == 201, doc.text
        assert doc.json()["operator_domain"]["outside"][0].startswith("phi 0.3 outside the trained [0.5, 0.995]")
        r = await c.post(f"/v1/streams/{doc.json()['stream_id']}/observations", json={"observations": [[0.3, -1, 2]]})
        assert r.status_code == 200 and r.json()["step"] == 1 and r.json()["per_step"][0]["ess"] > 0

    run(redis_url, body)


def test_method_options_per_stream(redis_url):
    """A stream's own method options: set, stored, used, and refused with a 422 naming the field when the method
    does not take them per stream or refuses their value (nothing is created then)."""

    async def body(app: FastAPI, c: httpx.AsyncClient):
        spec = new_stream("stochastic_volatility", "mpf", n=64)
        doc = (await c.post("/v1/streams", json={**spec, "method_options": {"substeps": 4, "max_substeps": 8}})).json()
        assert doc["method_options"] == {"substeps": 4, "max_substeps": 8} and doc["method_reason"] is None
        obs = {"observations": FAMILIES["stochastic_volatility"][2]}
        r = (await c.post(f"/v1/streams/{doc['stream_id']}/observations", json=obs)).json()
        assert r["step"] == 2 and all(0 < s["ess"] <= 64 for s in r["per_step"])
        stein = (
            await c.post(
                "/v1/streams", json={**spec, "stream_id": "stein", "method_options": {"linearisation": "stein"}}
            )
        ).json()
        assert stein["method_options"] == {"linearisation": "stein"}
        cases = [
            ({"method": "mpf", "method_options": {"operator": "x"}}, "method_options: ['operator'] cannot be set"),
            ({"method": "mpf", "method_options": {"substeps": 0}}, "method_options.substeps: an integer from 1"),
            ({"method": "gpf", "method_options": {"max_iters": 10**9}}, "for gpf; it takes none"),
            ({"method": "smc", "method_options": {"rejuvenate": "sometimes"}}, "method_options.rejuvenate"),
            ({"method": "mpf", "method_options": {"correct": True, "shrinkage": 1.5}}, "method_options.shrinkage"),
            ({"method": "mpf", "method_options": {"linearisation": "laplace"}}, "method_options.linearisation: one of"),
            ({"method": "mpf", "method_options": {"moves": 65}}, "method_options.moves: auto or an integer"),
            ({"method": "mpf", "method_options": {"moves": 3}}, "method_options.moves: posterior moves are for static"),
        ]
        for extra, message in cases:
            r = await c.post("/v1/streams", json={**spec, **extra, "stream_id": "refused"})
            assert r.status_code == 422 and message in r.json()["error"]["message"], r.text
        assert (await c.get("/v1/streams/refused")).status_code == 404
        # a logistic stream's posterior moves keep its window of observations in its stored state, across a gap
        moving = new_stream("logistic", "mpf", n=64, method_options={"moves": 3, "window": 1})
        doc = (await c.post("/v1/streams", json=moving)).json()
        assert "stream_id" in doc, doc
        url = f"/v1/streams/{doc['stream_id']}/observations"
        first, second = FAMILIES["logistic"][2]
        for chunk in ([first], [None], [second, first]):
            r = await c.post(url, json={"observations": chunk})
            assert r.status_code == 200, r.text
        assert r.json()["step"] == 4 and all(abs(m) < 5 for m in r.json()["summary"]["mean"])
        # the moves' acceptance rate: in each observed step's entry and in /metrics; a gap and a stream without
        # moves report none
        assert all(0 < s["acceptance"] <= 1 for s in r.json()["per_step"]), r.json()["per_step"]
        assert "acceptance" not in (await c.post(url, json={"observations": [None]})).json()["per_step"][0]
        plain = (await c.post(f"/v1/streams/{stein['stream_id']}/observations", json=obs)).json()["per_step"]
        assert all("acceptance" not in s for s in plain)
        metrics = (await c.get("/metrics")).text
        assert 'mpflow_update_move_acceptance_count{method="mpf"} 3.0' in metrics, metrics

    run(redis_url, body)


def test_seq_rules(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        sid = (await c.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))).json()["stream_id"]
        url = f"/v1/streams/{sid}/observations"
        o = FAMILIES["linear_gaussian"][2]
        r = await c.post(url, json={"seq": 2, "observations": o[:1]})  # a gap
        assert r.status_code == 409 and r.json()["error"]["code"] == "seq_conflict"
        first = await c.post(url, json={"seq": 1, "observations": o})
        assert first.status_code == 200 and first.json()["step"] == 2
        for seq, obs in ((1, o), (2, o[:1]), (1, o[:1])):  # wholly applied: duplicates, nothing re-applied
            r = await c.post(url, json={"seq": seq, "observations": obs})
            assert r.status_code == 200 and r.json()["duplicate"] is True and r.json()["per_step"] == []
            assert r.json()["summary"] == first.json()["summary"]
        r = await c.post(url, json={"seq": 2, "observations": o})  # partial overlap
        assert r.status_code == 409
        r = await c.post(url, json={"observations": o[:1]})  # no seq: appended
        assert r.status_code == 200 and r.json()["step"] == 3
        r = await c.post(url, json={"seq": 4, "observations": o[:1]})
        assert r.status_code == 200 and r.json()["step"] == 4 and r.json()["duplicate"] is False

    run(redis_url, body)


def test_failing_requests_change_nothing(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        sid = (await c.post("/v1/streams", json=new_stream("linear_gaussian", "gpf"))).json()["stream_id"]
        url = f"/v1/streams/{sid}/observations"
        before = (await c.get(f"/v1/streams/{sid}/particles")).json()
        doc_before = (await c.get(f"/v1/streams/{sid}")).json()
        cases = [
            ({"seq": 1, "observations": [[0.5, 1.0], [0.5, 1.0, 2.0]]}, 422, "observations[1]"),  # 2nd step bad
            ({"seq": 1, "observations": [[0.5, 1.0], 3.0]}, 422, "observations[1]"),
            ({"seq": 1, "observations": []}, 422, "observations"),
            ({"seq": 0, "observations": [[0.5, 1.0]]}, 422, "seq"),
            ({"seq": 1, "observations": [[0.5, 1.0]], "extra": 1}, 422, "extra"),
            ({"seq": 1, "observations": [["a", 1.0]]}, 422, "observations[0]"),
        ]
        for req, status, field in cases:
            r = await c.post(url, json=req)
            assert r.status_code == status, (req, r.text)
            err = r.json()["error"]
            assert set(err) == {"code", "message"} and field in err["message"], (req, err)
        # NaN / Infinity literals in the JSON text → 422
        for text in (b'{"observations": [[NaN, 1.0]]}', b'{"observations": [[Infinity, 1.0]]}'):
            r = await c.post(url, content=text, headers={"content-type": "application/json"})
            assert r.status_code == 422 and "observations[0]" in r.json()["error"]["message"]
        r = await c.post(url, content=b'{"observations": [[1.0, 2.0]', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json"
        assert (await c.get(f"/v1/streams/{sid}/particles")).json() == before
        assert (await c.get(f"/v1/streams/{sid}")).json() == doc_before

        bad_creates = [
            ({"model": {"family": "nope"}}, "model.family"),
            ({"model": {"family": "lds", "params": {"A": [[1.0]], "B": [[1.0, 0.0]]}}}, "model.params.A"),
            ({"model": {"family": "lds", "params": {"B": [[1.0, 0.0]]}}}, "model.params.A"),
            ({"prior": {"type": "gaussian", "mean": [0, 0], "cov": [[1, 2], [2, 1]]}}, "prior.cov"),
            ({"prior": {"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]], "x": 1}}, "prior"),
            ({"prior": {"type": "gaussian", "mean": [0, float("nan")], "cov": [[1, 0], [0, 1]]}}, "prior"),
            ({"method": "kalman", "model": {"family": "gmm"}}, "method"),
            ({"method": "magic"}, "method"),
            ({"num_particles": 1}, "num_particles"),
            ({"stream_id": "a b"}, "stream_id"),
            ({"operator": "nope-d2-v1"}, "operator"),
        ]
        for change, field in bad_creates:
            spec = {**new_stream("linear_gaussian", None), **change}
            content = json.dumps(spec).encode()  # json.dumps writes NaN as the literal NaN
            r = await c.post("/v1/streams", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 422, (change, r.text)
            assert field in r.json()["error"]["message"], (change, r.json())
        listed = (await c.get("/v1/streams")).json()["streams"]
        assert [s["stream_id"] for s in listed] == [sid]  # nothing was written by the failed creates

    run(redis_url, body)


def test_limits_answer_413(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        r = await c.post("/v1/streams", json=new_stream("linear_gaussian", "smc", n=65))
        assert r.status_code == 413 and r.json()["error"]["code"] == "limit_exceeded"
        assert "num_particles" in r.json()["error"]["message"]
        sid = (await c.post("/v1/streams", json=new_stream("linear_gaussian", "smc", n=64))).json()["stream_id"]
        r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.0, 0.0]] * 4})
        assert r.status_code == 413 and "observations" in r.json()["error"]["message"]
        r = await c.get(f"/v1/streams/{sid}/samples", params={"n": 101})
        assert r.status_code == 413
        big = b'{"observations": [' + b",".join([b"[0.0, 0.0]"] * 400) + b"]}"
        assert len(big) > 4000
        r = await c.post(f"/v1/streams/{sid}/observations", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["message"].startswith("body")

        async def chunks():  # no Content-Length: the streamed size is counted
            for _ in range(5):
                yield big[:1000]

        r = await c.post(
            f"/v1/streams/{sid}/observations", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert (await c.get(f"/v1/streams/{sid}")).json()["step"] == 0

    run(
        redis_url,
        body,
        max_particles=64,
        max_observations_per_request=3,
        max_samples_per_request=100,
        max_body_bytes=4000,
    )


def test_tenants_are_isolated_and_listing_is_scoped(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    s = settings(redis_url, prefix, api_keys=TENANT_KEYS)

    async def main():
        try:
            async with serve_tenants(s) as (a, b, anon):
                sid = (await a.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))).json()["stream_id"]
                for _ in range(3):
                    await a.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))
                assert (await a.get(f"/v1/streams/{sid}")).status_code == 200
                for method, path, kw in (
                    ("GET", f"/v1/streams/{sid}", {}),
                    ("GET", f"/v1/streams/{sid}/samples", {}),
                    ("GET", f"/v1/streams/{sid}/particles", {}),
                    ("POST", f"/v1/streams/{sid}/observations", {"json": {"observations": [[0.0, 0.0]]}}),
                    ("DELETE", f"/v1/streams/{sid}", {}),
                ):
                    r = await b.request(method, path, **kw)
                    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
                    r = await anon.request(method, path, **kw)
                    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
                    assert r.headers["www-authenticate"] == "Bearer"
                bad = await anon.get("/v1/streams", headers={"Authorization": "Bearer key-a-but-wrong"})
                assert bad.status_code == 401
                assert len((await a.get("/v1/streams")).json()["streams"]) == 4
                assert (await b.get("/v1/streams")).json()["streams"] == []
                # the same id in another tenant is another stream
                r = await b.post("/v1/streams", json={**new_stream("linear_gaussian", "smc"), "stream_id": sid})
                assert r.status_code == 201
                assert (await a.get(f"/v1/streams/{sid}")).json()["step"] == 0
                # paging: every stream once
                seen, cursor = [], None
                while True:
                    page = await a.get("/v1/streams", params={"limit": 3, **({"cursor": cursor} if cursor else {})})
                    seen += [it["stream_id"] for it in page.json()["streams"]]
                    cursor = page.json()["next_cursor"]
                    if cursor is None:
                        break
                assert len(seen) == len(set(seen)) == 4
                r = await a.get("/v1/streams", params={"cursor": "garbage!"})
                assert r.status_code == 422 and "cursor" in r.json()["error"]["message"]
                # open endpoints
                assert (await anon.get("/healthz")).status_code == 200
                assert (await anon.get("/readyz")).status_code == 200
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())


def test_a_restarted_app_serves_the_same_streams(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    s = settings(redis_url, prefix)
    obs = FAMILIES["lds"][2]

    async def main():
        try:
            async with serve_in_process(s) as (_, c):
                spec = new_stream("lds", "smc", stream_id="keep")
                await c.post("/v1/streams", json=spec)
                before = (await c.post("/v1/streams/keep/observations", json={"seq": 1, "observations": obs})).json()
            async with serve_in_process(s) as (_, c):  # a new app, engine and connection pool
                got = (await c.get("/v1/streams/keep")).json()
                assert got["summary"] == before["summary"] and got["step"] == 2
                r = await c.post("/v1/streams/keep/observations", json={"seq": 1, "observations": obs})
                assert r.json()["duplicate"] is True
                r = await c.post("/v1/streams/keep/observations", json={"seq": 3, "observations": obs[:1]})
                assert r.status_code == 200 and r.json()["step"] == 3
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())


def test_batch_endpoint_each_update_on_its_own(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        for sid in ("s1", "s2"):
            await c.post("/v1/streams", json=new_stream("linear_gaussian", "kalman", stream_id=sid))
        o = [[0.5, -1.0]]
        r = await c.post(
            "/v1/observations:batch",
            json={
                "updates": [
                    {"stream_id": "s1", "seq": 1, "observations": o},
                    {"stream_id": "s2", "seq": 1, "observations": o},
                    {"stream_id": "s1", "seq": 2, "observations": o},  # same stream: applied in order
                    {"stream_id": "s2", "seq": 5, "observations": o},  # a gap
                    {"stream_id": "nope", "observations": o},
                    {"stream_id": "s1", "observations": [[1.0]]},  # wrong shape
                ]
            },
        )
        assert r.status_code == 200
        res = r.json()["results"]
        assert [x["status"] for x in res] == [200, 200, 200, 409, 404, 422]
        assert res[2]["stream"]["step"] == 2 and res[1]["stream"]["step"] == 1
        assert res[3]["error"]["code"] == "seq_conflict" and "stream" not in res[3]
        assert (await c.get("/v1/streams/s1")).json()["step"] == 2
        # identical streams updated in one batch give identical answers (kalman is exact)
        assert res[0]["stream"]["summary"] == res[1]["stream"]["summary"]

    run(redis_url, body)


def test_store_unreachable_is_503_and_not_ready(redis_url):
    async def main():
        s = Settings(redis_url="redis://127.0.0.1:1/0", redis_prefix="unreachable")
        async with serve_in_process(s) as (app, c):
            assert (await c.get("/healthz")).status_code == 200
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            r = await c.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            r = await c.get("/v1/streams/x")
            assert r.status_code == 503
            metrics = (await c.get("/metrics")).text
            assert "mpflow_store_errors_total 2.0" in metrics

    asyncio.run(main())


def test_metrics_openapi_catalogue(redis_url):
    async def body(app: FastAPI, c: httpx.AsyncClient):
        sid = (await c.post("/v1/streams", json=new_stream("linear_gaussian", "smc"))).json()["stream_id"]
        await c.post(f"/v1/streams/{sid}/observations", json={"observations": FAMILIES["linear_gaussian"][2]})
        await c.get("/v1/streams/unknown")
        text = (await c.get("/metrics")).text
        for name in (
            'mpflow_http_requests_total{method="POST",route="/v1/streams",status="201"} 1.0',
            'mpflow_http_requests_total{method="GET",route="/v1/streams/{stream_id}",status="404"} 1.0',
            "mpflow_http_request_duration_seconds_bucket",
            'mpflow_updates_total{family="linear_gaussian",method="smc"} 2.0',
            'mpflow_update_duration_seconds_count{method="smc"} 2.0',
            "mpflow_batch_size_count 2.0",
            "mpflow_streams 1.0",
            "mpflow_store_errors_total 0.0",
        ):
            assert name in text, name
        spec = (await c.get("/openapi.json")).json()
        paths = spec["paths"]
        for path in (
            "/v1/streams",
            "/v1/streams/{stream_id}",
            "/v1/streams/{stream_id}/observations",
            "/v1/streams/{stream_id}/samples",
            "/v1/streams/{stream_id}/particles",
            "/v1/observations:batch",
            "/v1/models",
            "/v1/operators",
            "/healthz",
            "/readyz",
            "/metrics",
        ):
            assert path in paths, path
        create = paths["/v1/streams"]["post"]
        assert {"201", "409", "413", "422", "503"} <= set(create["responses"])
        schemas = spec["components"]["schemas"]
        assert set(schemas["Quantiles"]["properties"]) == {"0.025", "0.05", "0.5", "0.95", "0.975"}
        assert "examples" in schemas["CreateStreamRequest"]
        models = (await c.get("/v1/models")).json()
        by_family = {f["family"]: f for f in models["families"]}
        assert set(by_family) == set(MODEL_FAMILIES)  # every family the server loaded, plugins included
        assert by_family["lorenz96"]["methods"] == ["enkf", "ienkf", "mpf", "smc", "ukf"]
        assert "kalman" in by_family["lds"]["methods"] and "kalman" not in by_family["gmm"]["methods"]
        lds_params = {p["name"]: p for p in by_family["lds"]["parameters"]}
        # A or, in continuous time, F: neither alone is required (issue 19); B is
        assert not lds_params["A"]["required"] and lds_params["B"]["required"] and lds_params["Q"]["default"] == "1·I"
        ops = (await c.get("/v1/operators")).json()["operators"]
        assert [o["name"] for o in ops] == [r.name for r in app.state.operators.records]
        for o in ops:
            assert {"name", "family", "state_dim", "obs_dim", "metrics", "created", "content_hash"} <= set(o)

    run(redis_url, body)


def test_stream_from_a_cached_sampler_prior(redis_url, tmp_path, monkeypatch):
    """A prior of type "sampler" (a GPVI generator cached by ``mpflow fit-sampler``) starts a stream; an
    unknown sampler name is a 422 naming the field."""
    from mpflow.training.fit_sampler import fit_sampler

    mixture = {"type": "mixture", "weights": [0.5, 0.5], "means": [[-2, 0], [2, 0]], "covs": [[[1, 0], [0, 1]]] * 2}
    record = fit_sampler(mixture, out=tmp_path, iterations=20, particles=16, seed=0, progress=False)
    monkeypatch.setenv("MPFLOW_OPERATOR_DIRS", str(tmp_path))
    model = {"family": "linear_gaussian", "params": {}}

    async def body(app, client):
        ok = await client.post(
            "/v1/streams",
            json={
                "model": model,
                "prior": {"type": "sampler", "name": record.name},
                "method": "smc",
                "num_particles": 64,
                "seed": 1,
            },
        )
        assert ok.status_code == 201, ok.text
        sid = ok.json()["stream_id"]
        upd = await client.post(f"/v1/streams/{sid}/observations", json={"seq": 1, "observations": [[1.0, 0.5]]})
        assert upd.status_code == 200 and upd.json()["step"] == 1
        bad = await client.post("/v1/streams", json={"model": model, "prior": {"type": "sampler", "name": "nope"}})
        assert bad.status_code == 422 and "prior.name" in bad.json()["error"]["message"]

    run(redis_url, body)
