"""The limits the server enforces, written into ``/openapi.json`` from its :class:`Settings` (docs/API.md "Limits").

The request models of :mod:`mpflow.service.schemas` and the routes' parameters are static; the limits are the
server's settings (``MPFLOW_MAX_PARTICLES``, ...), so :func:`install` post-processes the app's OpenAPI document once,
when it is first built, from the settings ``create_app`` was given — one source of truth: the numbers a generated
client or validator reads are those the server refuses above (413 ``limit_exceeded``, or 422 where the server
answers so). What depends on several fields together — the cost model's budgets (``MPFLOW_MAX_REQUEST_FLOPS``,
``MPFLOW_MAX_REQUEST_BYTES``), the integration sub-steps (``MPFLOW_MAX_INTEGRATION_SUBSTEPS``), all the updates of a
batch together — cannot be a ``maximum``: it is written in the operation's description, and 413 is a documented
answer of every priced operation. The body limit (``MPFLOW_MAX_BODY_BYTES``) has no JSON Schema keyword: it is in each
request body's description and its ``x-max-body-bytes``, and the snapshot's ``maxLength``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from mpflow.operators.registry import NAME_RE
from mpflow.service.schemas import MAX_SEED, STREAM_ID_PATTERN
from mpflow.service.settings import Settings

#: a registered operator's or sampler's name, ``<family>-d<d>-v<k>`` (ECMA-262 regex: no Python group names)
REGISTRY_NAME_PATTERN = re.sub(r"\?P<\w+>", "", NAME_RE.pattern)
#: the operations the cost model prices (413 ``limit_exceeded`` over a budget: docs/API.md "Limits")
PRICED = {
    ("post", "/v1/streams"),
    ("post", "/v1/streams/{stream_id}/observations"),
    ("post", "/v1/observations:batch"),
    ("post", "/v1/streams:import"),
    ("get", "/v1/streams/{stream_id}/samples"),
    ("get", "/v1/streams/{stream_id}/forecast"),
    ("get", "/v1/streams/{stream_id}/smoothed"),
    ("get", "/v1/streams/{stream_id}/particles"),
}


def _bound(node: dict[str, Any] | None, kind: str, **keywords: Any) -> None:
    """Add ``keywords`` to the schema ``node`` of JSON type ``kind``, or to its ``anyOf`` branch of that type (an
    optional field: ``[{"type": kind, ...}, {"type": "null"}]``)."""
    if node is None:
        raise KeyError(f"no schema to bound with {keywords}")
    targets = [node] if node.get("type") == kind else [b for b in node.get("anyOf", []) if b.get("type") == kind]
    if not targets:
        raise KeyError(f"no {kind} in {node}")
    for target in targets:
        target.update(keywords)


def _vector(node: dict[str, Any], d: int) -> None:
    """A vector of the state: 1..d numbers."""
    _bound(node, "array", minItems=1, maxItems=d)


def _matrix(node: dict[str, Any], d: int) -> None:
    """A d × d matrix of the state (a covariance)."""
    _vector(node, d)
    _vector(node["items"], d)


def _budget_text(settings: Settings) -> str:
    return (
        '\n\nPriced by the cost model (docs/API.md "Limits"): a request whose estimated work is over '
        f"{settings.max_request_flops:.3g} floating-point operations (MPFLOW_MAX_REQUEST_FLOPS) or whose estimated "
        f"peak memory is over {settings.max_request_bytes} bytes (MPFLOW_MAX_REQUEST_BYTES), or a step that "
        f"integrates in more than {settings.max_integration_substeps} sub-steps (MPFLOW_MAX_INTEGRATION_SUBSTEPS), "
        "is answered 413 `limit_exceeded` naming the field that sets its size and the largest value that fits. "
        "These depend on several fields together (and on the stream), so no single `maximum` expresses them."
    )


def apply_limits(document: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``document`` (an app's OpenAPI) with the limits of ``settings`` (module docstring); changed in place."""
    s = settings
    schemas = document["components"]["schemas"]
    create = schemas["CreateStreamRequest"]["properties"]
    _bound(create["num_particles"], "integer", maximum=s.max_particles)
    _bound(create["seed"], "integer", minimum=0, maximum=MAX_SEED)  # an exact integer (pydantic writes a float)
    _bound(create["state_names"], "array", maxItems=s.max_state_dim)
    _bound(create["operator"], "string", pattern=REGISTRY_NAME_PATTERN)
    schemas["SamplerPrior"]["properties"]["name"]["pattern"] = REGISTRY_NAME_PATTERN
    gaussian = schemas["GaussianPrior"]["properties"]
    _vector(gaussian["mean"], s.max_state_dim)
    _matrix(gaussian["cov"], s.max_state_dim)
    particles = schemas["ParticlesPrior"]["properties"]["particles"]
    _bound(particles, "array", minItems=1, maxItems=s.max_particles)
    _vector(particles["items"], s.max_state_dim)
    mixture = schemas["MixturePrior"]["properties"]
    _vector(mixture["means"]["items"], s.max_state_dim)
    _matrix(mixture["covs"]["items"], s.max_state_dim)
    for name in ("ObservationsRequest", "BatchUpdate"):
        _bound(schemas[name]["properties"]["observations"], "array", maxItems=s.max_observations_per_request)
    _bound(schemas["ObservationsRequest"]["properties"]["return_samples"], "integer", maximum=s.max_samples_per_request)
    # a batch's update is answered on its own, inside the batch's 200: over the limit, its result is 413
    schemas["BatchUpdate"]["properties"]["return_samples"]["description"] = (
        f"posterior draws to return after the last step; above {s.max_samples_per_request} "
        "(MPFLOW_MAX_SAMPLES_PER_REQUEST) this update's result is 413 `limit_exceeded` (the others run)"
    )
    updates = schemas["BatchRequest"]["properties"]["updates"]
    _bound(updates, "array", maxItems=s.max_observations_per_request)
    updates["description"] = (
        f"at most {s.max_observations_per_request} observation steps in all the updates together "
        "(MPFLOW_MAX_OBSERVATIONS_PER_REQUEST; 413 `limit_exceeded` naming `updates` above)"
    )

    query: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {
        ("/v1/streams/{stream_id}/samples", "n"): lambda p: _bound(p, "integer", maximum=s.max_samples_per_request),
        ("/v1/streams/{stream_id}/forecast", "steps"): lambda p: _bound(p, "integer", maximum=s.max_forecast_steps),
        ("/v1/streams/{stream_id}/forecast", "samples"): lambda p: _bound(
            p, "integer", maximum=s.max_samples_per_request
        ),
        ("/v1/streams/{stream_id}/history", "limit"): lambda p: _bound(p, "integer", maximum=s.history_steps),
    }
    applied = set()
    body_text = f"at most {s.max_body_bytes} bytes (MPFLOW_MAX_BODY_BYTES; 413 `limit_exceeded` above)"
    for path, item in document["paths"].items():
        for method, op in item.items():
            if not isinstance(op, dict):
                continue
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "stream_id":
                    param["schema"]["pattern"] = STREAM_ID_PATTERN
                bound = query.get((path, param["name"])) if param["in"] == "query" else None
                if bound is not None:
                    bound(param["schema"])
                    applied.add((path, param["name"]))
            body = op.get("requestBody")
            if body is not None:
                body["description"] = body_text
                body["x-max-body-bytes"] = s.max_body_bytes
                for media in body.get("content", {}).values():
                    if media.get("schema", {}).get("format") == "binary":
                        media["schema"]["maxLength"] = s.max_body_bytes
            if (method, path) in PRICED:
                op["description"] = (op.get("description") or "") + _budget_text(s)
                op.setdefault("responses", {}).setdefault(
                    "413",
                    {
                        "description": "over a configured limit",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                    },
                )
    missing = set(query) - applied
    if missing:  # a renamed parameter must not silently lose its limit
        raise KeyError(f"parameters not found in the OpenAPI document: {sorted(missing)}")
    return document


def install(app: FastAPI, settings: Settings) -> None:
    """Build ``app``'s OpenAPI document with the limits of ``settings`` (once, at its first request)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = apply_limits(build(), settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["PRICED", "REGISTRY_NAME_PATTERN", "apply_limits", "install"]
