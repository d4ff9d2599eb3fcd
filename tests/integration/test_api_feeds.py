"""The live feed's own resources (service.dashboard.events): a per-process cap on open feeds, and every refused
or finished feed gives its subscription connection back; and what an update publishes (real Redis)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from mpflow.service.api.auth import OPEN_TENANT
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams.publish import channel, update_event

from tests.harness.server import drop_prefix, serve_in_process
from tests.integration.test_api_streams import new_stream, settings


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


async def next_event(pubsub: Any) -> dict[str, Any]:
    """The next message published on the subscribed channel (within 5 s), as ``{"channel", "data"}``."""
    m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    assert m is not None and m["type"] == "message", m
    return {"channel": m["channel"].decode(), "data": json.loads(m["data"])}


def test_each_applied_update_publishes_its_update_event_once(redis_url):
    """An applied observation request publishes ``update_event``'s payload on its channel, once; a duplicate
    (``update_event`` is None) publishes nothing — however the service publishes (separately, or in the CAS)."""
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    sid = "evt"
    name = channel(prefix, OPEN_TENANT, sid)

    async def main() -> None:
        listener = StreamStore.from_url(redis_url, prefix=prefix)
        pubsub = listener.client.pubsub()
        try:
            async with serve_in_process(settings(redis_url, prefix)) as (_, client):
                await pubsub.subscribe(name)
                assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"
                assert (
                    await client.post("/v1/streams", json=new_stream("linear_gaussian", "smc", stream_id=sid))
                ).status_code == 201
                obs = {"seq": 1, "observations": [[0.5, -1.0], [0.25, -0.75]]}
                first = (await client.post(f"/v1/streams/{sid}/observations", json=obs)).json()
                again = (await client.post(f"/v1/streams/{sid}/observations", json=obs)).json()
                later = (
                    await client.post(f"/v1/streams/{sid}/observations", json={"seq": 3, "observations": [[1.0, 0.0]]})
                ).json()
                assert again["duplicate"] and update_event(prefix, OPEN_TENANT, sid, again) is None
                assert update_event(prefix, OPEN_TENANT, sid, {**first, "per_step": []}) is None
                for doc in (first, later):  # in order, nothing for the duplicate in between
                    want_channel, payload = update_event(prefix, OPEN_TENANT, sid, doc)
                    assert await next_event(pubsub) == {"channel": want_channel, "data": json.loads(payload)}
                    assert want_channel == name and json.loads(payload)["step"] == doc["step"]
                # nothing more: a sentinel published now is the next message (Redis keeps a channel's order)
                await listener.client.publish(name, json.dumps("sentinel"))
                assert (await next_event(pubsub))["data"] == "sentinel"
        finally:
            await pubsub.aclose()
            await listener.aclose()
            await drop_prefix(redis_url, prefix)

    asyncio.run(main())
