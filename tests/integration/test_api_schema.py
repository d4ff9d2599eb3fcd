"""The OpenAPI contract, checked by schemathesis against the app served by uvicorn (real Redis, real TCP).

Schemathesis generates valid and invalid requests from ``/openapi.json`` for every operation and checks the
answers: no 5xx, every status and body documented, schema-violating requests refused (4xx), a 405's ``Allow``
header right, and so on. Excluded: ``positive_data_acceptance`` — a schema-valid request may still be over a
configured limit (413) or invalid for its model family (422), which the schema cannot express.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from mpflow.service.dashboard.events import NOT_FUZZED  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from tests.harness.server import drop_prefix, serve_in_thread  # noqa: E402
from tests.integration.test_api_streams import settings  # noqa: E402

EXAMPLES = 4
# the iterative methods cut short and small limits: generated streams stay cheap
FAST = {
    "method_options": {"nvgd": {"max_iters": 2, "inner_steps": 2}, "gpf": {"max_iters": 20}, "svgd": {"max_iters": 5}},
    "max_particles": 64,
    "max_state_dim": 4,
    "max_samples_per_request": 200,
    "max_observations_per_request": 5,
}


@pytest.fixture(scope="module")
def api_schema(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    try:
        with serve_in_thread(settings(redis_url, prefix, **FAST)) as url:
            yield schemathesis.openapi.from_url(f"{url}/openapi.json").exclude(path_regex=NOT_FUZZED)
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


def test_openapi_contract(api_schema):
    """Positive and negative examples for every operation (schemathesis' pytest plugin is bypassed: its
    fixture loader does not run under this pytest)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @hypothesis_settings(
                max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def check(case) -> None:
                case.call_and_validate(excluded_checks=[positive_data_acceptance])

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
                assert mode is GenerationMode.NEGATIVE, op.label
