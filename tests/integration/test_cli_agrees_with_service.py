"""``mpflow info`` and the service say the same thing (issue 38, item 2): the operators of ``mpflow info --json`` are
``GET /v1/operators``'s, each with ``auto_select`` and why; the text lists a named-only operator under its own
heading, never among those mpf picks; every family's parameters are ``GET /v1/models``'s, defaults included
(``sensor = [0, 0]``)."""

from __future__ import annotations

import asyncio
import json
import uuid

from mpflow.service.settings import Settings

from mpflow.cli.main import main
from tests.harness.server import serve_in_process


def _served(redis_url: str) -> tuple[list[dict], list[dict]]:
    settings = Settings(redis_url=redis_url, redis_prefix=f"mpflowtest-{uuid.uuid4().hex}", log_level="WARNING")

    async def read() -> tuple[list[dict], list[dict]]:
        async with serve_in_process(settings) as (_, client):
            operators = (await client.get("/v1/operators")).json()["operators"]
            models = (await client.get("/v1/models")).json()["families"]
            return operators, models

    return asyncio.run(read())


def test_info_and_the_service_list_the_same_operators_and_families(capsys, redis_url):
    operators, models = _served(redis_url)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["operators"] == operators
    assert {f["family"]: f["parameters"] for f in info["families"]} == {m["family"]: m["parameters"] for m in models}
    named = [o for o in operators if not o["auto_select"]]
    assert named and all(o["auto_select_note"] for o in named)  # every shipped named-only operator says why

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    picked_part, named_part = text.split("serve only a stream naming them (auto_select: false)")
    for o in operators:
        assert (o["name"] in named_part) == (not o["auto_select"]) and (o["name"] in picked_part) == o["auto_select"]
    assert "sensor = [0, 0]" in text and "not evaluated" not in text
