"""Numerical faults: extreme observations and degenerate priors never put NaN or inf into a stored state, and a
step whose method fails numerically is computed by a safe fall-back (``service/engine/numerics.py``), said in the
answer (``"fallback"``) and counted (``mpflow_update_fallbacks_total``).

Everything runs through the HTTP API (in process, real Redis) and reads back what was stored: the particles
(``GET /v1/streams/{id}/particles``), the summary and draws. The fall-back path is shown twice: by a real
trigger (the trained MPF operator on ``linear_gaussian`` overflows float32 on an observation of 1e30 — checked
directly on the operator first) and by fault injection: the registry entry of a method is replaced by a
subclass whose update returns NaN particles (a test double of the operator; the store and the service are
real).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import UPDATERS, get_updater

from tests.harness.numerics import all_finite, fallback_counts
from tests.harness.server import drop_prefix, serve_in_process
from tests.harness.specs import FAMILIES, GAUSS2
from tests.integration import conftest as integration
from tests.integration.test_api_streams import settings

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

# the iterative methods cut short: these tests are about what is stored, not about accuracy
FAST = {
    "method_options": {"nvgd": {"max_iters": 3, "inner_steps": 3}, "gpf": {"max_iters": 60}, "svgd": {"max_iters": 10}}
}
# finite in float32 and far in the tails (1e30, 3e38 overflow float32 arithmetic inside the operators)
EXTREME = [1e6, -1e6, 1e12, 1e30, -1e30, 3e38]
# finite float64 JSON numbers beyond float32: the service computes in float32, they must be refused
BEYOND_FLOAT32 = [1e39, -1e39, 1e300]

Body = Callable[[FastAPI, httpx.AsyncClient], Awaitable[Any]]


def run(url: str, *bodies: Body, prefix: str | None = None, **overrides: Any) -> list[Any]:
    """Each body on its own fresh app, all on one key prefix (deleted afterwards): a later app reads what an
    earlier one stored."""
    prefix = prefix or f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> list[Any]:
        out = []
        try:
            for body in bodies:
                async with serve_in_process(settings(url, prefix, **{**FAST, **overrides})) as (app, client):
                    out.append(await body(app, client))
        finally:
            await drop_prefix(url, prefix)
        return out

    return asyncio.run(main())


async def stored_is_finite(c: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    """Read back everything stored for ``sid``; assert it is finite; the stream document."""
    doc = await c.get(f"/v1/streams/{sid}")
    particles = await c.get(f"/v1/streams/{sid}/particles")
    samples = await c.get(f"/v1/streams/{sid}/samples", params={"n": 64})
    for r in (doc, particles, samples):
        assert r.status_code == 200, (sid, r.status_code, r.text[:300])
        assert all_finite(r.json()), (sid, r.request.url.path, r.text[:300])
    assert (
        all_finite(particles.json()["particles"]) and len(particles.json()["particles"]) == doc.json()["num_particles"]
    )
    return doc.json()


def stream_spec(family: str, method: str, prior: dict[str, Any] | None = None, n: int = 16) -> dict[str, Any]:
    params, _ = FAMILIES[family]
    spec = {"model": {"family": family, "params": params}, "prior": prior or GAUSS2, "method": method, "seed": 3}
    if (prior or GAUSS2)["type"] != "particles":
        spec["num_particles"] = n
    return spec


# ---------------------------------------------------------------------------------------------- extreme observations
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_extreme_observations_never_store_non_finite_values(redis_url, family):
    """Every method the catalogue lists for the family, fed observations from ±1e6 to 3e38: every answer is
    200 or 4xx, a 200's per-step entries are finite, and what is stored stays finite; numbers beyond float32
    are 422 naming the observation."""
    _, obs = FAMILIES[family]

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        models = {f["family"]: f["methods"] for f in (await c.get("/v1/models")).json()["families"]}
        assert models[family], family
        for method in models[family]:
            r = await c.post("/v1/streams", json=stream_spec(family, method))
            assert r.status_code == 201, (family, method, r.text)
            sid, step = r.json()["stream_id"], 0
            for v in [*EXTREME, 0.5]:
                r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(v)]})
                label = (family, method, v, r.text[:300])
                assert r.status_code == 200 or 400 <= r.status_code < 500, label
                if r.status_code == 200:
                    step += 1
                    answer = r.json()
                    assert all_finite(answer) and answer["step"] == step, label
                    assert answer.get("fallback") in (None, "gpf", "kalman", "smc"), label
                else:
                    assert r.json()["error"]["code"] == "non_finite_update", label
                doc = await stored_is_finite(c, sid)
                assert doc["step"] == step and doc["method"] == method, label
            for v in BEYOND_FLOAT32:
                r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(0.5), obs(v)]})
                assert r.status_code == 422, (family, method, v, r.text)
                assert r.json()["error"]["message"].startswith("observations[1]"), r.text
            assert (await stored_is_finite(c, sid))["step"] == step  # nothing of the refused requests applied

    run(redis_url, body)


# ---------------------------------------------------------------------------------------------- degenerate priors
def _near_singular(eps: float) -> list[list[float]]:
    """[[1, 1 − eps], [1 − eps, 1]]: eigenvalues 2 − eps and eps."""
    return [[1.0, 1.0 - eps], [1.0 - eps, 1.0]]


DEGENERATE_PRIORS = {
    "eigenvalue 1e-11": {"type": "gaussian", "mean": [0.0, 0.0], "cov": _near_singular(1e-11)},
    "cov 1e-11 I": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1e-11, 0.0], [0.0, 1e-11]]},
    "cov 1e30 I": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1e30, 0.0], [0.0, 1e30]]},
    "mean 1e30": {"type": "gaussian", "mean": [1e30, -1e30], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "identical particles": {"type": "particles", "particles": [[1.0, 2.0]] * 16},
    "near-singular mixture": {
        "type": "mixture",
        "weights": [0.5, 0.5],
        "means": [[0.0, 0.0], [1.0, 1.0]],
        "covs": [_near_singular(1e-11), [[1e-11, 0.0], [0.0, 1e-11]]],
    },
}
REFUSED_PRIORS = {  # prior -> the field the 422 must name
    "eigenvalue 1e-13": ({"type": "gaussian", "mean": [0.0, 0.0], "cov": _near_singular(1e-13)}, "prior.cov"),
    "singular": ({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 1.0], [1.0, 1.0]]}, "prior.cov"),
    "negative eigenvalue": ({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 2.0], [2.0, 1.0]]}, "prior.cov"),
    "zero": ({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[0.0, 0.0], [0.0, 0.0]]}, "prior.cov"),
    "asymmetric": ({"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.5], [0.0, 1.0]]}, "prior.cov"),
    "beyond float32": ({"type": "gaussian", "mean": [1e39, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}, "prior"),
    "singular mixture component": (
        {
            "type": "mixture",
            "weights": [0.5, 0.5],
            "means": [[0, 0], [1, 1]],
            "covs": [[[1, 0], [0, 1]], [[1, 1], [1, 1]]],
        },
        "prior.covs",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_degenerate_priors_stay_finite_and_unusable_ones_are_422(redis_url, family):
    """Near-singular (but positive-definite) priors, huge or tiny scales and a collapsed particle cloud give
    streams whose every stored state is finite through ordinary and extreme observations; covariances that fail
    the positive-definiteness check are 422 naming the prior's field, for every method."""
    _, obs = FAMILIES[family]

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        methods = {f["family"]: f["methods"] for f in (await c.get("/v1/models")).json()["families"]}[family]
        for method in methods:
            for name, prior in DEGENERATE_PRIORS.items():
                label = (family, method, name)
                r = await c.post("/v1/streams", json=stream_spec(family, method, prior))
                if method == "kalman" and prior["type"] != "gaussian":
                    assert r.status_code == 422 and r.json()["error"]["message"].startswith("prior"), label
                    continue
                assert r.status_code == 201, (label, r.text[:300])
                assert all_finite(r.json()), label
                sid = r.json()["stream_id"]
                for v in (0.5, 1e6):
                    r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(v)]})
                    assert r.status_code == 200 or 400 <= r.status_code < 500, (label, v, r.text[:300])
                    await stored_is_finite(c, sid)
            for name, (prior, field) in REFUSED_PRIORS.items():
                r = await c.post("/v1/streams", json=stream_spec(family, method, prior))
                assert r.status_code == 422, (family, method, name, r.text[:300])
                assert r.json()["error"]["message"].startswith(field), (family, method, name, r.text[:300])

    run(redis_url, body)


# ---------------------------------------------------------------------------------------------- the fall-back path
def test_an_extreme_observation_is_answered_finitely_by_the_operator(redis_url):
    """No injection: an observation of 1e30 to an mpf stream on linear_gaussian d=2 (the shipped operator). Its
    evidence is the predicted Gaussian's, in float64 (docs/methods.md "Anomaly scores"), so the step stays finite
    where the particle average of p(o | x) once underflowed to a non-finite state and a fall-back: checked on the
    operator itself, from the same prior and seed, and through the API — no fall-back, every number finite, an
    evidence increment that says how surprising the reading was. (Fall-backs of a failing operator: the injected
    faults below.)"""
    spec = stream_spec("linear_gaussian", "mpf", n=32)
    extreme = {"observations": [[1e30, -1e30]]}

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/streams", json=spec)
        assert r.status_code == 201, r.text
        doc = r.json()
        model = make_model("linear_gaussian", {}, 2)
        updater = get_updater("mpf", operator=doc["operator"]) if doc["operator"] else get_updater("mpf")
        state = updater.init(prior_from_spec(GAUSS2), model, 32, doc["seed"])
        new, info = updater.update(state, torch.tensor([[1e30, -1e30]]), model)
        assert bool(torch.isfinite(new.particles).all()) and float(info.log_evidence_increment[0]) < -1e50

        before = fallback_counts((await c.get("/metrics")).text)
        r = await c.post(f"/v1/streams/{doc['stream_id']}/observations", json=extreme)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer.get("fallback") is None and answer["method"] == "mpf" and answer["step"] == 1
        assert all_finite(answer) and answer["per_step"][0]["log_evidence_increment"] < -1e50
        await stored_is_finite(c, doc["stream_id"])
        assert fallback_counts((await c.get("/metrics")).text) == before

    run(redis_url, body)


def _nan_after(cls: type) -> type:
    """A subclass of the updater ``cls`` whose every update returns NaN particles (a faulty operator)."""

    class Faulty(cls):  # type: ignore[misc, valid-type]
        def _update(self, state, obs, model, gens):
            new, info = super()._update(state, obs, model, gens)
            return new.replace(particles=torch.full_like(new.particles, float("nan"))), info

    Faulty.__name__ = f"Faulty{cls.__name__}"
    return Faulty


# (family, the stream's method): a flow method, the learned operator, the weighted smc, the exact kalman
INJECTED = [
    ("linear_gaussian", "svgd"),
    ("gmm", "mpf"),
    ("stochastic_volatility", "nvgd"),
    ("logistic", "smc"),
    ("lds", "kalman"),
]


@pytest.mark.parametrize(("family", "method"), INJECTED, ids=[f"{f}-{m}" for f, m in INJECTED])
def test_injected_non_finite_particles_fall_back_to_gpf(redis_url, monkeypatch, family, method):
    """The stream's method returns NaN particles on every step: both steps are computed by gpf, the answer and
    every per-step entry say ``"fallback": "gpf"``, the metric counts 2, the stored state is finite and keeps
    the stream's method's form — a later app with the real method updates the same stream without falling back."""
    _, obs = FAMILIES[family]
    two = {"observations": [obs(0.5), obs(-0.25)]}
    sid = f"fault-{family}-{method}"

    async def faulty(app: FastAPI, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/streams", json={**stream_spec(family, method), "stream_id": sid})
        assert r.status_code == 201, r.text
        r = await c.post(f"/v1/streams/{sid}/observations", json=two)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["fallback"] == "gpf" and [s["fallback"] for s in answer["per_step"]] == ["gpf", "gpf"]
        assert answer["method"] == method and answer["step"] == 2 and all_finite(answer)
        counts = fallback_counts((await c.get("/metrics")).text)
        assert counts == {(family, method, "gpf"): 2.0}, counts
        p = (await c.get(f"/v1/streams/{sid}/particles")).json()
        if not UPDATERS[method].weighted:  # an unweighted method is never handed weighted particles
            assert max(p["log_weights"]) - min(p["log_weights"]) < 1e-9
        await stored_is_finite(c, sid)

    async def healthy(app: FastAPI, c: httpx.AsyncClient) -> None:
        r = await c.post(f"/v1/streams/{sid}/observations", json={"seq": 3, "observations": [obs(0.1)]})
        assert r.status_code == 200, r.text
        assert "fallback" not in r.json() and "fallback" not in r.json()["per_step"][0], r.text
        assert r.json()["step"] == 3 and all_finite(r.json())
        assert fallback_counts((await c.get("/metrics")).text) == {}

    real = UPDATERS[method]

    async def faulty_then_restore(app: FastAPI, c: httpx.AsyncClient) -> None:
        await faulty(app, c)
        monkeypatch.setitem(UPDATERS, method, real)  # the next app builds the real updater

    monkeypatch.setitem(UPDATERS, method, _nan_after(real))
    run(redis_url, faulty_then_restore, healthy)  # two apps, one key prefix: the second reads the first's stream
    assert UPDATERS[method] is real


@pytest.mark.parametrize(("family", "expected"), [("linear_gaussian", "kalman"), ("gmm", "smc")])
def test_when_gpf_fails_too_the_chain_goes_on(redis_url, monkeypatch, family, expected):
    """svgd and gpf both yield NaN: linear-Gaussian families fall back to the exact kalman update, others to
    smc; the stream stays svgd and its stored particles are uniformly weighted (svgd reads them so)."""
    _, obs = FAMILIES[family]
    monkeypatch.setitem(UPDATERS, "svgd", _nan_after(UPDATERS["svgd"]))
    monkeypatch.setitem(UPDATERS, "gpf", _nan_after(UPDATERS["gpf"]))

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        sid = (await c.post("/v1/streams", json=stream_spec(family, "svgd"))).json()["stream_id"]
        for v in (0.5, 2.0):
            r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(v)]})
            assert r.status_code == 200, r.text
            assert r.json()["fallback"] == expected and r.json()["method"] == "svgd"
        p = (await c.get(f"/v1/streams/{sid}/particles")).json()
        assert max(p["log_weights"]) - min(p["log_weights"]) < 1e-9
        assert (await stored_is_finite(c, sid))["step"] == 2
        assert fallback_counts((await c.get("/metrics")).text) == {(family, "svgd", expected): 2.0}

    run(redis_url, body)


def test_when_every_method_fails_nothing_is_applied(redis_url, monkeypatch):
    """The method and every fall-back yield NaN: 422 ``non_finite_update`` naming the observation, the stored
    stream is exactly as before (step, particles), and the metric counts the step under ``fallback="none"``."""
    for name in ("svgd", "gpf", "kalman", "smc"):
        monkeypatch.setitem(UPDATERS, name, _nan_after(UPDATERS[name]))

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        sid = (await c.post("/v1/streams", json=stream_spec("linear_gaussian", "svgd"))).json()["stream_id"]
        before = (await c.get(f"/v1/streams/{sid}/particles")).json()
        r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.5, 0.5], [1.0, 1.0]]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "non_finite_update", r.text
        message = r.json()["error"]["message"]
        assert message.startswith("observations[0]") and "nothing was applied" in message
        assert all(name in message for name in ("gpf", "kalman", "smc")), message
        assert (await c.get(f"/v1/streams/{sid}/particles")).json() == before
        assert (await stored_is_finite(c, sid))["step"] == 0
        assert fallback_counts((await c.get("/metrics")).text) == {("linear_gaussian", "svgd", "none"): 1.0}

    run(redis_url, body)


def test_a_step_that_cannot_run_as_asked_is_422_not_a_fall_back(redis_url, monkeypatch):
    """A ``ValueError`` that is not numerical (a method's own precondition) is not cured by another method: 422
    naming the step, nothing applied, no fall-back counted. A collapsed covariance (NotPositiveDefinite, a
    ValueError too) does fall back: the distinction is the exception's class, not its base."""

    class Refusing(UPDATERS["svgd"]):  # type: ignore[misc, valid-type]
        def _update(self, state, obs, model, gens):
            raise ValueError("options.kernel: this kernel cannot run on this stream")

    monkeypatch.setitem(UPDATERS, "svgd", Refusing)

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        sid = (await c.post("/v1/streams", json=stream_spec("linear_gaussian", "svgd"))).json()["stream_id"]
        r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.5, 0.5]]})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"].startswith("observations[0]: options.kernel"), r.text
        assert (await stored_is_finite(c, sid))["step"] == 0
        assert fallback_counts((await c.get("/metrics")).text) == {}

    run(redis_url, body)


def _nan_cov_after(cls: type) -> type:
    """A subclass of kalman whose updates have finite particles but a NaN covariance in the state's extras."""

    class NaNCov(cls):  # type: ignore[misc, valid-type]
        def _update(self, state, obs, model, gens):
            new, info = super()._update(state, obs, model, gens)
            return new.replace(extras={**new.extras, "cov": torch.full_like(new.extras["cov"], float("nan"))}), info

    return NaNCov


def test_non_finite_values_beyond_the_particles_are_never_stored(redis_url, monkeypatch):
    """The updater's own check covers particles, weights and evidence only; a NaN elsewhere in the state (here
    kalman's covariance) is caught by the service's guard: the step falls back and the stored state is finite."""
    monkeypatch.setitem(UPDATERS, "kalman", _nan_cov_after(UPDATERS["kalman"]))

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        sid = (await c.post("/v1/streams", json=stream_spec("lds", "kalman"))).json()["stream_id"]
        r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.5]]})
        assert r.status_code == 200 and r.json()["fallback"] == "gpf", r.text
        doc = await stored_is_finite(c, sid)
        assert doc["step"] == 1 and doc["method"] == "kalman"

    run(redis_url, body)


def test_explosive_dynamics_end_in_422_never_in_a_non_finite_state(redis_url):
    """x_m = 2 x_{m-1} + noise doubles the state every step, so after ~128 steps it leaves float32: each
    method goes as far as it can (falling back where it fails: ``ValueError`` from a collapsed covariance
    included), then answers 422 with nothing applied, and every state stored on the way is finite."""
    params = {"A": [[2.0, 0.0], [0.0, 2.0]], "B": [[1.0, 0.0]]}

    async def body(app: FastAPI, c: httpx.AsyncClient) -> None:
        fallbacks = 0
        for method in ("svgd", "gpf", "kalman", "smc"):
            spec = {
                "model": {"family": "lds", "params": params},
                "prior": GAUSS2,
                "method": method,
                "num_particles": 16,
                "seed": 0,  # with it smc reaches particles of zero weight (log-weight −inf) by step 80
            }
            sid = (await c.post("/v1/streams", json=spec)).json()["stream_id"]
            step, refused = 0, 0
            while refused < 2:
                r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.5]] * 10})
                assert r.status_code in (200, 422), (method, r.text[:300])
                if r.status_code == 200:
                    step += 10
                    fallbacks += sum("fallback" in s for s in r.json()["per_step"])
                else:
                    refused += 1
                    assert r.json()["error"]["code"] == "non_finite_update", r.text
                    assert "nothing was applied" in r.json()["error"]["message"], r.text
                assert (await stored_is_finite(c, sid))["step"] == step, method
                assert step <= 200, method  # 2^200 is far beyond float32: some step must have been refused
        assert fallbacks > 0  # measured: kalman took over svgd's and gpf's failing steps
        counted = sum(fallback_counts((await c.get("/metrics")).text).values())
        assert counted >= fallbacks

    run(redis_url, body)
