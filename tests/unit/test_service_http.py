"""The service's HTTP pieces that need no store: auth, error bodies, request schemas, the body limit, the catalogue."""

from __future__ import annotations

import asyncio
import hmac
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from mpflow.service.api import auth as auth_mod
from mpflow.service.api.auth import OPEN_TENANT, Authenticator
from mpflow.service.api.middleware import BodyLimit
from mpflow.service.engine import catalogue
from mpflow.service.errors import ApiError, from_validation_errors, install
from mpflow.service.schemas import CreateStreamRequest, ObservationsRequest
from mpflow.service.store.stream_store import StoreOutcomeUnknown, StoreUnavailable
from pydantic import ValidationError


def test_open_mode_is_tenant_default_and_says_so(caplog):
    a = Authenticator({})
    assert a.open and a.tenant(None) == OPEN_TENANT and a.tenant("Bearer anything") == OPEN_TENANT
    with caplog.at_level(logging.WARNING, logger="mpflow.auth"):
        a.warn_if_open()
    assert "open" in caplog.text


def test_keys_map_to_tenants_and_bad_keys_are_401(caplog):
    a = Authenticator({"k-alpha": "alpha", "k-beta": "beta"})
    assert a.tenant("Bearer k-alpha") == "alpha" and a.tenant("bearer k-beta") == "beta"
    assert a.tenant(None, query_key="k-beta") == "beta"
    for header in (None, "", "Bearer", "Bearer k-gamma", "Basic k-alpha", "Bearer k-alph", "k-alpha"):
        with pytest.raises(ApiError) as e:
            a.tenant(header)
        assert e.value.status == 401 and e.value.headers == {"WWW-Authenticate": "Bearer"}
    with caplog.at_level(logging.DEBUG, logger="mpflow"):
        a.warn_if_open()
    assert "k-alpha" not in caplog.text and "k-beta" not in caplog.text
    with pytest.raises(ValueError, match=r"^api_keys"):
        Authenticator({"k": "bad tenant"})


def test_every_key_is_compared_whichever_matches(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)
    a = Authenticator({f"key{i}": f"t{i}" for i in range(5)})
    for key in ("key0", "key4", "nope"):
        calls.clear()
        a.tenant_for_key(key)
        assert len(calls) == 5


def test_validation_messages_name_the_field():
    with pytest.raises(ValidationError) as e:
        ObservationsRequest.model_validate({"seq": 0, "observations": [[1.0, float("nan")]]})
    msg = from_validation_errors(e.value.errors()).message
    assert "seq:" in msg and "observations[0][1]: NaN is not a number; send null for a missing entry" in msg
    assert from_validation_errors([{"type": "json_invalid", "loc": ("body", 3), "msg": "x"}]).status == 400
    # a minibatch with a null label is refused by the request model, as its schema says, not counted first
    for step in ({"x": [[1.0, 2.0]], "y": [None]}, {"x": [[1.0, None]], "y": [1]}):
        with pytest.raises(ValidationError) as e:
            ObservationsRequest.model_validate({"seq": 1, "observations": [step]})
        msg = from_validation_errors(e.value.errors()).message
        assert msg.startswith('observations[0]: a minibatch\'s "x" and "y" are numbers only'), msg


@pytest.mark.parametrize(
    "change",
    [
        {"prior": {"type": "gaussian", "mean": [0.0, float("inf")], "cov": [[1.0, 0.0], [0.0, 1.0]]}},
        {"prior": {"type": "gaussian", "mean": ["0", 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}},
        {"prior": {"type": "gaussian", "mean": [True, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}},
        {"prior": {"type": "cloud"}},
        {"model": {"family": "lds", "params": {"A": [[float("nan")]]}}},
        {"model": {"family": "lds", "params": {"A": "identity"}}},
        {"model": {"family": "linear_gaussian", "extra": 1}},
        {"method": "magic"},
        {"seed": -1},
        {"stream_id": "has/slash"},
        {"unknown_field": 1},
    ],
)
def test_create_request_refuses(change):
    body = {
        "model": {"family": "linear_gaussian"},
        "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
        **change,
    }
    with pytest.raises(ValidationError):
        CreateStreamRequest.model_validate(body)


def test_create_request_accepts_every_prior_type():
    base = {"model": {"family": "gmm", "params": {"s": 0.5}}}
    for prior in (
        {"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]},
        {"type": "particles", "particles": [[0, 0], [1, 1], [2, 0]]},
        {"type": "mixture", "weights": [0.5, 0.5], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]] * 2},
    ):
        req = CreateStreamRequest.model_validate({**base, "prior": prior})
        assert req.prior.type == prior["type"]


def _limited_app(limit: int) -> FastAPI:
    app = FastAPI()
    install(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    app.add_middleware(BodyLimit, max_body_bytes=limit)
    return app


def test_body_limit_by_header_and_by_streamed_size():
    app = _limited_app(100)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/echo", content=b"x" * 100)).json() == {"n": 100}
            r = await c.post("/echo", content=b"x" * 101)
            assert r.status_code == 413 and r.json()["error"]["code"] == "limit_exceeded"

            async def chunks():
                for _ in range(4):
                    yield b"y" * 30

            r = await c.post("/echo", content=chunks())
            assert r.status_code == 413

            async def small():
                for _ in range(3):
                    yield b"y" * 30

            assert (await c.post("/echo", content=small())).json() == {"n": 90}
            r = await c.get("/nowhere")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    asyncio.run(main())


def test_store_errors_are_503_and_say_whether_a_write_may_have_applied():
    """A store that cannot be reached applied nothing; a write it never answered may have been applied, and the
    answer says so (and how to find out) instead of claiming nothing was."""
    app = FastAPI()
    install(app)

    @app.get("/down")
    async def down():
        raise StoreUnavailable("connection refused")

    @app.get("/unknown")
    async def unknown():
        raise StoreOutcomeUnknown("timeout after the write was sent")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/down")
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert r.json()["error"]["code"] == "store_unavailable" and "nothing was applied" in r.text
            r = await c.get("/unknown")
            assert r.status_code == 503 and r.headers["Retry-After"]
            err = r.json()["error"]
            assert err["code"] == "store_outcome_unknown" and "same seq" in err["message"]
            assert "nothing was applied" not in err["message"]

    asyncio.run(main())


def test_models_catalogue_reads_the_families():
    fams = {f["family"]: f for f in catalogue.models(512)}
    assert fams["gmm"]["state_dim"] == {"fixed": 2, "min": 2, "max": 2}
    assert fams["lds"]["state_dim"]["max"] == 512
    sv = {p["name"]: p for p in fams["stochastic_volatility"]["parameters"]}
    assert sv["phi"]["default"] == "0.95" and sv["phi"]["kind"] == "number or vector of length d"
    assert fams["linear_gaussian"]["methods"] == sorted(fams["linear_gaussian"]["methods"])
    assert "kalman" in fams["linear_gaussian"]["methods"] and "kalman" not in fams["logistic"]["methods"]


def test_the_served_log_handler_redacts_records_of_every_logger():
    """``mpflow serve``'s log handler carries the redaction filter, so records of child loggers (which a logger
    filter on ``mpflow`` never sees) are redacted too."""
    from mpflow.cli.serve import log_config

    cfg = log_config("INFO")
    assert cfg["filters"]["redact"]["()"] is auth_mod.RedactSecrets
    assert cfg["handlers"]["stderr"]["filters"] == ["redact"]
    record = logging.LogRecord(
        "mpflow.x", logging.INFO, __file__, 1, "GET /ws?api_key=%s (%s)", ("sekret-key-1", "Bearer tok-9"), None
    )
    assert auth_mod.RedactSecrets().filter(record)
    assert "sekret-key-1" not in record.getMessage() and "tok-9" not in record.getMessage()
    assert "<redacted>" in record.getMessage()
