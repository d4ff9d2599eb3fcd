"""The schema is the contract (issue 58): ``/openapi.json`` carries every limit the server enforces, from the same
settings, and schemathesis finds no difference between the document and the server.

* :func:`test_schemathesis_finds_no_mismatch` — the ``schemathesis`` CLI, every phase it offers (examples,
  coverage, fuzzing, stateful: the links between operations), against the app served by uvicorn over real TCP and
  Redis, with its checks: no 5xx, statuses, content types, headers and bodies as documented, schema-violating
  requests refused — a 413 ``limit_exceeded`` counts as a refusal — and, instead of ``positive_data_acceptance``,
  :func:`tests.harness.contract_hooks.schema_valid_request_accepted`: a schema-valid request is refused only by a
  rule no schema keyword can carry (the cost model's budgets, a value the model family cannot use), never by a limit
  or a form rule that the document leaves out. ``/events`` (a live feed, open for 20 s) is left out of it and checked
  here against its documented events.
* the limits in the document follow the settings the app was created with, and the server holds to what the document
  says where it once did not (``dt`` 0 in a step object; ``5.0`` for an integer).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("schemathesis")
from jsonschema import Draft202012Validator
from mpflow.service.api.contract import REGISTRY_NAME_PATTERN
from mpflow.service.app import create_app
from mpflow.service.dashboard.events import NOT_FUZZED
from mpflow.service.schemas import MAX_SEED, STREAM_ID_PATTERN
from mpflow.service.settings import Settings

from tests.harness.server import drop_prefix, serve_in_process, serve_in_thread
from tests.harness.specs import LINEAR_STREAM
from tests.integration.test_api_streams import settings

ROOT = Path(__file__).resolve().parents[2]
#: per operation and phase; about 1400 cases in all, ~20 s on 2 cores
MAX_EXAMPLES = 10
SEED = 58
#: small limits (generated streams stay cheap) at which the defaults a request may leave out still fit: a stream's
#: default particle count (256) and `n` of /samples (1000)
LIMITS: dict[str, Any] = {
    "method_options": {"nvgd": {"max_iters": 2, "inner_steps": 2}, "gpf": {"max_iters": 20}, "svgd": {"max_iters": 5}},
    "max_particles": 256,
    "max_state_dim": 4,
    "max_samples_per_request": 1000,
    "max_observations_per_request": 5,
}
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "use_after_free",
    "ensure_resource_availability",
    "schema_valid_request_accepted",  # tests/harness/contract_hooks.py, for positive_data_acceptance
)
#: the repository's schemathesis settings (a 413 refuses a schema-violating request too)
CONFIG = ROOT / "schemathesis.toml"


@pytest.fixture(scope="module")
def served(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    try:
        with serve_in_thread(settings(redis_url, prefix, **LIMITS)) as url:
            yield url
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def run_schemathesis(url: str, out: Path) -> dict[str, Any]:
    """The CLI against ``url`` (module docstring); what its NDJSON report says: cases, failures per check, the
    operations and phases that ran, seconds."""
    cmd = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run"),
        f"{url}/openapi.json",
        *("--exclude-path-regex", NOT_FUZZED),
        *("--phases", "examples,coverage,fuzzing,stateful"),
        *("--checks", ",".join(CHECKS)),
        *("--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1"),
        *("--continue-on-failure", "--suppress-health-check", "all", "--warnings", "off"),
        *("--report", "ndjson", "--report-dir", str(out / "report")),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.harness.contract_hooks"}
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - t0
    cases: set[str] = set()
    failures: collections.Counter = collections.Counter()
    operations: set[str] = set()
    phases: set[str] = set()
    for report in (out / "report").glob("*.ndjson"):
        for line in report.read_text().splitlines():
            event = json.loads(line)
            finished = event.get("ScenarioFinished")
            if finished is not None:
                recorder = finished["recorder"]
                if finished["phase"] != "stateful":  # its label: "Stateful tests"
                    operations.add(recorder.get("label"))
                phases.add(finished["phase"])
                cases.update(recorder.get("cases") or {})
                for checks in (recorder.get("checks") or {}).values():
                    failures.update(c["name"] for c in checks if c["status"] == "failure")
    return {
        "returncode": done.returncode,
        "cases": len(cases),
        "failures": dict(failures),
        "operations": sorted(operations),
        "phases": sorted(phases),
        "seconds": round(seconds, 1),
        "output": done.stdout[-6000:] + done.stderr[-2000:],
    }


def test_schemathesis_finds_no_mismatch(served, tmp_path):
    result = run_schemathesis(served, tmp_path)
    figures = {k: v for k, v in result.items() if k != "output"}
    print("schemathesis:", json.dumps(figures))  # the figures of the report (pytest -s)
    assert result["failures"] == {}, result["output"]
    assert result["returncode"] == 0, result["output"]
    assert len(result["operations"]) == 18, result["operations"]  # every operation but the live feed
    assert {"examples", "coverage", "fuzzing", "stateful"} <= set(result["phases"]), result["phases"]
    assert result["cases"] >= 1000, figures


def test_the_live_feed_sends_the_documented_events(served):
    """``/events`` is not fuzzed (a feed is open for 20 s): its first event and an update are checked against the
    schemas its 200 documents (``x-sse-events``)."""
    document = httpx.get(f"{served}/openapi.json").json()
    media = document["paths"]["/v1/streams/{stream_id}/events"]["get"]["responses"]["200"]["content"]
    events = media["text/event-stream"]["x-sse-events"]
    validators = {
        name: Draft202012Validator({**schema, "components": document["components"]}) for name, schema in events.items()
    }
    sid = httpx.post(f"{served}/v1/streams", json=LINEAR_STREAM, timeout=30).json()["stream_id"]
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=served, timeout=30) as c, c.stream("GET", f"/v1/streams/{sid}/events") as feed:
        assert feed.status_code == 200
        assert feed.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in feed.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name is not None:
                seen[name] = json.loads(line.removeprefix("data: "))
                if name == "stream":  # subscribed: an update now reaches this feed
                    r = httpx.post(f"{served}/v1/streams/{sid}/observations", json={"observations": [[0.1, 0.2]]})
                    assert r.status_code == 200, r.text
                if name == "update":
                    break
    assert set(seen) == {"stream", "update"}
    for name, data in seen.items():
        assert list(validators[name].iter_errors(data)) == [], (name, data)


# ---------------------------------------------------------------------------------------------- the limits
def _document(**overrides: Any) -> dict[str, Any]:
    return create_app(Settings(redis_url="redis://127.0.0.1:1/0", **overrides)).openapi()


def _limits(document: dict[str, Any]) -> dict[str, Any]:
    """The limits the document states, by name."""
    schemas, paths = document["components"]["schemas"], document["paths"]
    create = schemas["CreateStreamRequest"]["properties"]

    def param(path: str, name: str) -> dict[str, Any]:
        schema = next(p["schema"] for p in paths[path]["get"]["parameters"] if p["name"] == name)
        return next(b for b in [schema, *schema.get("anyOf", [])] if b.get("type") == "integer")

    return {
        "num_particles": create["num_particles"]["anyOf"][0]["maximum"],
        "seed": create["seed"]["anyOf"][0]["maximum"],
        "state_names": create["state_names"]["anyOf"][0]["maxItems"],
        "mean": schemas["GaussianPrior"]["properties"]["mean"]["maxItems"],
        "cov": schemas["GaussianPrior"]["properties"]["cov"]["items"]["maxItems"],
        "particles": schemas["ParticlesPrior"]["properties"]["particles"]["maxItems"],
        "particle": schemas["ParticlesPrior"]["properties"]["particles"]["items"]["maxItems"],
        "mixture_mean": schemas["MixturePrior"]["properties"]["means"]["items"]["maxItems"],
        "observations": schemas["ObservationsRequest"]["properties"]["observations"]["maxItems"],
        "batch_observations": schemas["BatchUpdate"]["properties"]["observations"]["maxItems"],
        "updates": schemas["BatchRequest"]["properties"]["updates"]["maxItems"],
        "return_samples": schemas["ObservationsRequest"]["properties"]["return_samples"]["maximum"],
        "n": param("/v1/streams/{stream_id}/samples", "n")["maximum"],
        "steps": param("/v1/streams/{stream_id}/forecast", "steps")["maximum"],
        "forecast_samples": param("/v1/streams/{stream_id}/forecast", "samples")["maximum"],
        "history_limit": param("/v1/streams/{stream_id}/history", "limit")["maximum"],
        "body": paths["/v1/streams"]["post"]["requestBody"]["x-max-body-bytes"],
        "snapshot": paths["/v1/streams:import"]["post"]["requestBody"]["content"]["application/octet-stream"]["schema"][
            "maxLength"
        ],
    }


def test_the_document_carries_the_limits_of_the_settings():
    for s in (Settings(redis_url="redis://127.0.0.1:1/0"), Settings(redis_url="redis://127.0.0.1:1/0", **LIMITS)):
        got = _limits(create_app(s).openapi())
        d, samples = s.max_state_dim, s.max_samples_per_request
        assert got == {
            **dict.fromkeys(("num_particles", "particles"), s.max_particles),
            "seed": MAX_SEED,
            **dict.fromkeys(("state_names", "mean", "cov", "particle", "mixture_mean"), d),
            **dict.fromkeys(("observations", "batch_observations", "updates"), s.max_observations_per_request),
            **dict.fromkeys(("return_samples", "n", "forecast_samples"), samples),
            "steps": s.max_forecast_steps,
            "history_limit": s.history_steps,
            **dict.fromkeys(("body", "snapshot"), s.max_body_bytes),
        }
    assert isinstance(got["seed"], int)  # exact (pydantic wrote 9.223372036854776e18, a number above it)
    odd = _limits(_document(max_particles=123, max_state_dim=7, max_forecast_steps=9, history_steps=11))
    assert (odd["num_particles"], odd["cov"], odd["steps"], odd["history_limit"]) == (123, 7, 9, 11)


def test_the_document_states_what_no_maximum_can():
    document = _document()
    for path, item in document["paths"].items():
        for method, op in item.items():
            for p in op.get("parameters", []):
                if p["name"] == "stream_id" and p["in"] == "path":
                    assert p["schema"]["pattern"] == STREAM_ID_PATTERN, (method, path)
            if (method, path) in {("post", "/v1/streams"), ("get", "/v1/streams/{stream_id}/forecast")}:
                assert "MPFLOW_MAX_REQUEST_FLOPS" in op["description"] and "413" in op["responses"], (method, path)
    schemas = document["components"]["schemas"]
    operator = schemas["CreateStreamRequest"]["properties"]["operator"]["anyOf"][0]
    assert operator["pattern"] == schemas["SamplerPrior"]["properties"]["name"]["pattern"] == REGISTRY_NAME_PATTERN
    # the batch's dt has the single endpoint's minimum: one schema of a step
    for name in ("ObservationsRequest", "BatchUpdate"):
        step = document["components"]["schemas"][name]["properties"]["observations"]["items"]
        dt = next(b for b in step["anyOf"] if "dt" in b.get("properties", {}))["properties"]["dt"]
        assert dt["exclusiveMinimum"] == 0, name


def test_the_server_holds_to_the_document(redis_url):
    """``dt`` 0 is refused as the schema says (it was applied); an integral ``5.0`` is an integer, as JSON Schema
    says (it was refused)."""

    async def main() -> None:
        prefix = f"mpflowtest-{uuid.uuid4().hex}"
        try:
            async with serve_in_process(settings(redis_url, prefix)) as (_, c):
                sid = (await c.post("/v1/streams", json={**LINEAR_STREAM, "seed": 3.0})).json()["stream_id"]
                step = {"value": [0.1, 0.2], "dt": 0.0}
                r = await c.post(f"/v1/streams/{sid}/observations", json={"observations": [step]})
                assert r.status_code == 422 and r.json()["error"]["message"].startswith("observations[0].dt"), r.text
                batch = {"updates": [{"stream_id": sid, "observations": [step]}]}
                r = await c.post("/v1/observations:batch", json=batch)
                assert r.status_code == 422 and "dt" in r.json()["error"]["message"], r.text
                r = await c.post(f"/v1/streams/{sid}/observations", json={"seq": 1.0, "observations": [[0.1, 0.2]]})
                assert r.status_code == 200 and r.json()["step"] == 1, r.text
                for bad in (1.5, "1", True):
                    r = await c.post(f"/v1/streams/{sid}/observations", json={"seq": bad, "observations": [[0, 0]]})
                    assert r.status_code == 422 and r.json()["error"]["message"].startswith("seq"), (bad, r.text)
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())
