"""The OpenAPI document says what the server does: one 422 code for one kind of fault (``invalid_request``, whether
the schema or the model family found it) documented with the API's error body on every operation (not FastAPI's
``{"detail": ...}``), and every field of the stream routes' answers named by its schema."""

from __future__ import annotations

from typing import Any

from tests.integration.test_api_streams import GAUSS2, run

BAD_FIELDS = {
    "a string for a number (schema)": {"prior": {**GAUSS2, "mean": ["a", 0.0]}},
    "an unknown family (schema)": {"model": {"family": "nope"}},
    "a mean of the wrong length (family)": {"prior": {**GAUSS2, "mean": [0.0, 0.0, 0.0]}},
    "an unknown operator (method)": {"method": "mpf", "operator": "no-such-operator"},
}


def test_every_unusable_field_is_invalid_request(redis_url):
    async def body(app, client):
        answers = {}
        for what, change in BAD_FIELDS.items():
            r = await client.post(
                "/v1/streams", json={"model": {"family": "linear_gaussian"}, "prior": GAUSS2, **change}
            )
            answers[what] = (r.status_code, r.json()["error"]["code"])
        r = await client.get("/v1/streams", params={"limit": 0})  # a query parameter out of range
        answers["limit=0 (query)"] = (r.status_code, r.json()["error"]["code"])
        r = await client.get("/v1/streams", params={"cursor": "!!"})
        answers["a bad cursor (store)"] = (r.status_code, r.json()["error"]["code"])
        spec = (await client.get("/openapi.json")).json()
        return answers, spec

    answers, spec = run(redis_url, body)
    assert set(answers.values()) == {(422, "invalid_request")}, answers
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, item in spec["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")) and "application/json" in response.get("content", {}):
                    assert response["content"]["application/json"]["schema"] == error, (method, path, status)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def _undocumented(value: Any, schema: dict, components: dict, where: str) -> list[str]:
    """Fields of ``value`` that its schema does not name (``$ref``, ``anyOf`` and arrays followed)."""
    if "$ref" in schema:
        return _undocumented(value, components[schema["$ref"].rsplit("/", 1)[1]], components, where)
    for option in schema.get("anyOf", []):
        if option.get("type") != "null" and value is not None:
            return _undocumented(value, option, components, where)
    if isinstance(value, list) and "items" in schema:
        return [e for i, v in enumerate(value) for e in _undocumented(v, schema["items"], components, f"{where}[{i}]")]
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    props = schema["properties"]
    missing = [f"{where}.{k}" for k in value if k not in props]
    return missing + [
        e for k, v in value.items() if k in props for e in _undocumented(v, props[k], components, f"{where}.{k}")
    ]


def test_every_field_the_server_sends_is_documented(redis_url):
    """The answers of the stream routes hold no field their OpenAPI schema leaves out."""

    async def body(app, client):
        create = {"stream_id": "doc-1", "model": {"family": "lds"}, "prior": GAUSS2, "method": "mpf", "seed": 1}
        create["model"]["params"] = {"A": [[0.9, 0.0], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}
        answers = {"StreamDocument": (await client.post("/v1/streams", json=create)).json()}
        observe = {"seq": 1, "observations": [[0.1, 0.2], [0.3, 0.1]], "return_samples": 2}
        answers["ObservationResult"] = (await client.post("/v1/streams/doc-1/observations", json=observe)).json()
        answers["StreamList"] = (await client.get("/v1/streams")).json()
        batch = {
            "updates": [
                {"stream_id": "doc-1", "observations": [[0.0, 0.1]]},
                {"stream_id": "x", "observations": [[0.0, 0.0]]},
            ]
        }
        answers["BatchResponse"] = (await client.post("/v1/observations:batch", json=batch)).json()
        answers["ParticlesResponse"] = (await client.get("/v1/streams/doc-1/particles")).json()
        spec = (await client.get("/openapi.json")).json()
        return answers, spec["components"]["schemas"]

    answers, components = run(redis_url, body)
    assert answers["StreamDocument"]["operator"] and answers["ObservationResult"]["per_step"]
    for name, answer in answers.items():
        assert _undocumented(answer, components[name], components, name) == []
