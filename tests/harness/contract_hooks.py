"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=tests.harness.contract_hooks``) of the contract test
(tests/integration/test_api_contract.py): the check :func:`schema_valid_request_accepted`.

It stands in for schemathesis' ``positive_data_acceptance`` (which counts every 4xx but 401/403/404/409/429 to a
schema-valid request as a mismatch), stricter where the schema can speak and lenient where it cannot: a request
generated as valid may be refused only

* 413 ``limit_exceeded`` by a limit that depends on several fields together — the cost model's budgets
  (``MPFLOW_MAX_REQUEST_FLOPS``, ``MPFLOW_MAX_REQUEST_BYTES``), the integration sub-steps, a batch's steps in all —
  which each priced operation's description documents (``service/api/contract.py``);
* 422 for a value the model family or the method cannot use (a shape, a ``dt`` a discrete-time model cannot step, a
  snapshot or cursor that is not one): a rule of values, never of form.

A 413 naming a plain limit (``at most 64 (MPFLOW_MAX_PARTICLES)``) or a 422 with a form message (a pattern, a bound,
a type, a length, an unknown field: pydantic's words) means the schema let through what the server refuses: a failure.
"""

from __future__ import annotations

import json

import schemathesis
from jsonschema import Draft202012Validator

#: the 413s whose limit no single schema keyword can carry (several fields together)
BUDGET_MARKS = (
    "MPFLOW_MAX_REQUEST_FLOPS",
    "MPFLOW_MAX_REQUEST_BYTES",
    "MPFLOW_MAX_INTEGRATION_SUBSTEPS",
    "observation steps per request in all",
)
#: pydantic's words for a form rule (what the schema says): a schema-valid request refused with one is a mismatch
FORM_MARKS = (
    "should match pattern",
    "Input should be",
    "should have at least",
    "should have at most",
    "Field required",
    "unknown field",
    "unknown query parameter",
    "expected a number or an array",
    "nested too deeply",
    "mixes numbers and arrays",
)
ACCEPTED = {401, 403, 404, 409, 429}


@schemathesis.check
def schema_valid_request_accepted(ctx, response, case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if not _schema_valid_body(case):  # labelled positive, yet not valid (a mutation of the fuzzing phase)
        return None
    status = response.status_code
    if status < 400 or status >= 500 or status in ACCEPTED:  # 5xx: not_a_server_error's
        return None
    try:
        error = json.loads(response.content)["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a schema-valid request answered {status} without the error body") from None
    if status == 413 and code == "limit_exceeded" and any(m in message for m in BUDGET_MARKS):
        return None
    if status == 422 and not any(m in message for m in FORM_MARKS):
        return None
    raise AssertionError(f"a schema-valid request refused, {status} {code}: {message[:300]}")


def _schema_valid_body(case) -> bool:
    """Whether the case's JSON body (if any) is valid for its operation's schema (JSON Schema 2020-12, the dialect of
    OpenAPI 3.1, with the document's components: schemathesis' own ``is_valid`` accepted an invalid body here)."""
    if not isinstance(case.body, dict | list):
        return True
    key = (case.operation.label, case.media_type)
    if key not in _VALIDATORS:
        document = case.operation.schema.raw_schema
        content = case.operation.definition.raw.get("requestBody", {}).get("content", {})
        schema = content.get(case.media_type, {}).get("schema")
        root = {**schema, "components": document.get("components", {})} if schema else None
        _VALIDATORS[key] = Draft202012Validator(root) if root else None
    validator = _VALIDATORS[key]
    return validator is None or validator.is_valid(case.body)


_VALIDATORS: dict = {}
