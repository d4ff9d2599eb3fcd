"""The catalogue: ``GET /v1/models`` (the model families and methods this server runs, with what each method can
do) and ``GET /v1/operators`` (the trained ``mpf`` operators installed). Both read what the server was started
with, never a stream."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from mpflow.service.api.deps import AppSettings, Operators, Tenant
from mpflow.service.api.responses import error_responses
from mpflow.service.engine import catalogue
from mpflow.service.schemas import ModelsResponse, OperatorsResponse

router = APIRouter(prefix="/v1", tags=["streams"])


@router.get("/models", response_model=ModelsResponse, responses=error_responses(401, 422), tags=["catalogue"])
async def list_models(tenant: Tenant, settings: AppSettings) -> Response:
    """The model families this server runs — parameters, state dimensions, the shape of one observation, the
    methods that can run each — and every method with what it can do (`capabilities`: a weighted cloud, exact,
    forecasts, controls, smoothing, unknown parameters)."""
    families = catalogue.models(settings.max_state_dim)
    methods = catalogue.method_entries()
    return JSONResponse({"families": families, "methods": list(methods), "capabilities": methods})


@router.get("/operators", response_model=OperatorsResponse, responses=error_responses(401, 422), tags=["catalogue"])
async def list_operators(tenant: Tenant, operators: Operators) -> Response:
    """The trained `mpf` operators installed on this server, with the family and dimension each was trained for
    and its measured accuracy."""
    return JSONResponse({"operators": operators.to_json()})


__all__ = ["router"]
