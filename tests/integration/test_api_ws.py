"""WS /v1/streams/{id}/ws over a real uvicorn server and Redis: the same documents and seq rules as the POST."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.harness.server import drop_prefix, serve_in_thread
from tests.integration.test_api_streams import settings

SPEC = {
    "stream_id": "ws",
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "kalman",
    "num_particles": 8,
}


def test_websocket_observations(redis_url):
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    auth = {"Authorization": "Bearer secret-1"}
    try:
        with serve_in_thread(settings(redis_url, prefix, api_keys="t1:secret-1,t2:secret-2")) as url:
            ws_url = url.replace("http://", "ws://") + "/v1/streams/ws/ws"
            assert httpx.post(f"{url}/v1/streams", json=SPEC, headers=auth).status_code == 201

            def ask(ws, frame) -> dict:
                ws.send(frame if isinstance(frame, str) else json.dumps(frame))
                return json.loads(ws.recv(timeout=30))

            with connect(ws_url, additional_headers=auth, proxy=None) as ws:
                doc = ask(ws, {"seq": 1, "observations": [[0.5, -1.0]]})
                assert doc["step"] == 1 and doc["duplicate"] is False and len(doc["per_step"]) == 1
                assert ask(ws, {"seq": 1, "observations": [[0.5, -1.0]]})["duplicate"] is True
                err = ask(ws, {"seq": 5, "observations": [[0.5, -1.0]]})
                assert err["status"] == 409 and err["error"]["code"] == "seq_conflict"
                assert ask(ws, '{"seq": 2, ')["error"]["code"] == "malformed_json"
                err = ask(ws, '{"seq": 2, "observations": [[NaN, 1.0]]}')
                assert err["status"] == 422 and "observations[0]" in err["error"]["message"]
                doc = ask(ws, {"seq": 2, "observations": [[0.25, 0.5]], "return_samples": 3})
                assert doc["step"] == 2 and len(doc["samples"]) == 3
            http = httpx.get(f"{url}/v1/streams/ws", headers=auth).json()
            assert http["summary"] == doc["summary"]  # the socket wrote through the same store
            # the key may come as ?api_key= (browsers cannot set headers)
            with connect(ws_url + "?api_key=secret-1", proxy=None) as ws:
                assert ask(ws, {"seq": 3, "observations": [[0.0, 0.0]]})["step"] == 3
            # another tenant: a 404 frame, then the socket is closed
            with connect(ws_url, additional_headers={"Authorization": "Bearer secret-2"}, proxy=None) as ws:
                frame = json.loads(ws.recv(timeout=30))
                assert frame["status"] == 404 and frame["error"]["code"] == "stream_not_found"
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=30)
            # no key: the handshake is refused
            with pytest.raises(InvalidStatus), connect(ws_url, proxy=None):
                pass
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))
