"""The live feed's own resources (service.dashboard.events): a per-process cap on open feeds, and every refused
or finished feed gives its subscription connection back (real Redis)."""

from __future__ import annotations

import asyncio
import uuid

from service.testing import drop_prefix, serve_in_process
from tests.integration.test_api_streams import settings


def test_feeds_over_the_cap_are_503_and_refused_feeds_give_their_slot_back(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"

    async def main() -> None:
        try:
            async with serve_in_process(settings(redis_url, prefix)) as (app, client):
                feeds = app.state.feeds
                for _ in range(3):  # unknown streams: 404, and the slot and connection come back each time
                    r = await client.get("/v1/streams/nope/events")
                    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
                assert feeds.open == 0
                pool = feeds.store.client.connection_pool
                assert len(pool._in_use_connections) == 0  # every subscription connection was released
                feeds.max_feeds = 0  # a full server
                r = await client.get("/v1/streams/nope/events")
                assert r.status_code == 503 and r.headers["Retry-After"]
                assert r.json()["error"]["code"] == "too_many_feeds"
                assert feeds.open == 0
                assert (await client.get("/readyz")).status_code == 200  # the API's own pool is untouched
        finally:
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())
