"""The OpenAPI contract, checked by schemathesis against the app served by uvicorn (real Redis, real TCP).

Schemathesis generates valid and invalid requests from ``/openapi.json`` for every operation and checks the
answers: no 5xx, every status and body documented, schema-violating requests refused (4xx), a 405's ``Allow``
header right, and so on. Excluded: ``positive_data_acceptance`` — a schema-valid request may still be over a
configured limit (413) or invalid for its model family (422), which the schema cannot express.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from jsonschema import Draft202012Validator  # noqa: E402
from mpflow.service.app import create_app  # noqa: E402
from mpflow.service.dashboard.events import NOT_FUZZED  # noqa: E402
from mpflow.service.settings import Settings  # noqa: E402
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


# ---------------------------------------------------------------------------------------------- examples
def schema_examples(node: Any, path: str = "#") -> Iterator[tuple[str, dict, Any]]:
    """Every example of an OpenAPI document: (where, the schema it illustrates, the example). Schema nodes carry
    ``examples`` (a list, JSON Schema) or ``example``; a media type carries ``example`` or ``examples`` (a map of
    ``{"value": ...}``) for its ``schema``."""
    if isinstance(node, dict):
        if "schema" in node and isinstance(node["schema"], dict):  # a media type or a parameter
            if "example" in node:
                yield f"{path}/example", node["schema"], node["example"]
            for name, ex in (node.get("examples") or {}).items():
                if isinstance(ex, dict) and "value" in ex:
                    yield f"{path}/examples/{name}", node["schema"], ex["value"]
        elif "type" in node or "properties" in node or "anyOf" in node or "$ref" in node or "allOf" in node:
            for i, ex in enumerate(node.get("examples") or []):
                yield f"{path}/examples/{i}", node, ex
            if "example" in node:
                yield f"{path}/example", node, node["example"]
        for key, value in node.items():
            yield from schema_examples(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from schema_examples(value, f"{path}/{i}")


def example_errors(document: dict) -> list[str]:
    """Each example of ``document`` that does not validate against its own schema (JSON Schema 2020-12, the
    dialect of OpenAPI 3.1; ``$ref``s resolved in the document), as ``where: what``."""
    errors = []
    for where, schema, example in schema_examples(document):
        root = {**schema, "components": document.get("components", {})}  # so "#/components/..." resolves
        validator = Draft202012Validator(root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        errors += [f"{where}: {e.message}" for e in validator.iter_errors(example)]
    return errors


def test_every_openapi_example_matches_its_schema():
    document = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
    assert len(list(schema_examples(document))) >= 8
    assert example_errors(document) == []


def test_an_example_that_does_not_match_its_schema_is_found():
    """The check above can fail: an example missing a required field, or with a field of the wrong type."""
    document = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
    broken = copy.deepcopy(document)
    result = broken["components"]["schemas"]["ObservationResult"]
    result["examples"] = [{k: v for k, v in result["examples"][0].items() if k != "per_step"}]
    broken["components"]["schemas"]["ErrorResponse"]["examples"] = [{"error": {"code": 3, "message": "m"}}]
    errors = example_errors(broken)
    assert any("ObservationResult/examples/0: 'per_step' is a required property" in e for e in errors), errors
    assert any("ErrorResponse/examples/0: 3 is not of type 'string'" in e for e in errors), errors
