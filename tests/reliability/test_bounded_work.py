"""Bounded work (issue 34, items 1 and 3), against the server as a user runs it (``python -m mpflow serve``, real
Redis, the default limits):

* item 1 — a ``lorenz96`` observation with ``"dt": 1e38`` (POST and WebSocket), a stream created with
  ``delta: 1e38`` or ``rk4_step: 1e-38``, and ``GET …/forecast?steps=1&dt=1e38`` ran an unbounded RK4 loop: each
  is now refused in well under a second with a 413 naming the field and the limit, nothing is half-applied (the
  stream's step is unchanged) and another stream's update succeeds right after;
* item 3 — a Gaussian prior at N = 65536, d = 128, a forecast at N = 65536, d = 64 with ``steps=10`` and 100000
  draws of that stream are refused by the cost model with the field named, and the server's peak memory does not
  grow by more than :data:`RSS_BOUND` while they are; creating the N = 65536, d = 64 stream (accepted) stays under
  3 × that bound; a forecast of 1000 steps on a small stream is answered within it;
* a ``/smoothed`` read priced at its real work: at 60 floating-point operations a backward-simulation proposal the
  cost model accepted an ``smc`` window of L = 100 steps of N = 35945 particles, whose read takes tens of seconds
  on a loaded core (docs/benchmarks.md "What a read costs against its price"), past the 30 s worker deadline;
  priced as measured, that stream's creation is refused (413 naming ``smoothing_lag``, nothing created), and the
  largest window now accepted (at L = 10, to keep the test short) answers its read 200 within the deadline;
* an ``smc2`` forecast within its price: its (θ, x) pairs were moved a horizon one at a time, as one-row models (63
  horizons at N = 65536 took about 20 s of CPU, against the 30 s worker deadline on a core of its own), and were
  priced 120000 floating-point operations a pair and horizon for it; moved together, as one model of a row per pair
  with one generator's call a horizon, they cost a particle filter's forecast and are priced as one. The largest
  forecast the defaults accept at N = 65536 (47 horizons, 9.7 s one pair at a time) answers within a few seconds,
  and one horizon more is refused (413 naming ``steps``);
* an iterative solver priced at its iterations: a ``gpf`` step was priced at its ``max_iters`` = 500 iterations'
  arithmetic only, a 25th of one iteration's fixed cost at N = 16 (Python, the tensor operations' launches: about
  0.6 ms), so a request of 1000 steps was accepted (about 14 s as it runs, and up to 500 iterations a step where the
  data keep it from converging). Priced at ``gpf.ITERATION_FLOPS`` an iteration, a 20-step request to that stream is
  refused (413 naming ``observations``, nothing applied), and the largest now accepted answers within a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mpflow.operators.models import make_model
from mpflow.operators.smoothing import backward_simulation
from mpflow.operators.updaters import get_updater, gpf
from mpflow.service.settings import Settings
from mpflow.service.streams import costs
from websockets.sync.client import connect

from tests.harness import rts
from tests.harness.server import drop_prefix, serve_as_user
from tests.harness.smoothing_windows import largest_window, smc_stream
from tests.harness.specs import LINEAR_STREAM
from tests.integration import conftest as integration

redis_url = integration.redis_url  # the real-Redis fixture of the integration tests

#: a refusal of the cost model comes before any work: well under a second (loaded CI machines included)
QUICK_S = 1.0
#: the growth of the server's peak RSS (VmHWM) allowed while refused requests arrive, or a forecast of 1000 steps
#: on a small stream is answered (measured: under 30 MiB for each; the refused requests allocate nothing)
RSS_BOUND = 100 * 2**20

D = 8
LORENZ = {
    "model": {"family": "lorenz96"},
    "prior": {"type": "gaussian", "mean": [8.0] * D, "cov": [[float(i == j) for j in range(D)] for i in range(D)]},
    "method": "smc",
    "num_particles": 64,
    "seed": 3,
}


def gaussian_stream(n: int, d: int, method: str = "smc") -> dict:
    eye = [[float(i == j) for j in range(d)] for i in range(d)]
    return {
        "model": {"family": "lds", "params": {"A": [[0.9 * v for v in row] for row in eye], "B": eye}},
        "prior": {"type": "gaussian", "mean": [0.0] * d, "cov": eye},
        "method": method,
        "num_particles": n,
        "seed": 2,
    }


class Server:
    def __init__(self, url: str, pid: int):
        self.url, self.pid = url, pid

    def status(self, key: str) -> int:
        """A ``/proc/PID/status`` memory line of the server, in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset_peak(self) -> int:
        """Reset the server's peak RSS to its current RSS (``clear_refs`` 5); that RSS."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.status("VmRSS")


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[Server]:
    prefix = f"mpflowtest-{uuid.uuid4().hex}"
    env = {"MPFLOW_REDIS_URL": redis_url, "MPFLOW_REDIS_PREFIX": prefix, "MPFLOW_LOG_LEVEL": "WARNING"}
    log_path = tmp_path_factory.mktemp("bounded") / "service.log"
    try:
        with serve_as_user(env, log_path, args=["--workers", "1"]) as s:  # one process: its memory is the server's
            yield Server(s.url, s.pid)
    finally:
        asyncio.run(drop_prefix(redis_url, prefix))


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def create(c: httpx.Client, body: dict) -> str:
    r = c.post("/v1/streams", json=body)
    assert r.status_code == 201, r.text
    return r.json()["stream_id"]


def refused(r: httpx.Response, seconds: float, *fields: str, status: int = 413) -> str:
    """The refusal's message, after checking its status, code, speed and that it names each field and a limit."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == ("limit_exceeded" if status == 413 else "invalid_request")
    assert seconds < QUICK_S, f"refused after {seconds:.2f} s"
    for field in fields:
        assert field in error["message"], error["message"]
    assert "at most" in error["message"], error["message"]
    return error["message"]


def timed(call, *args, **kwargs) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = call(*args, **kwargs)
    return r, time.perf_counter() - t0


def other_stream_updates(c: httpx.Client) -> None:
    sid = create(c, LINEAR_STREAM)
    r = c.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.1, 0.2]]})
    assert r.status_code == 200 and r.json()["step"] == 1, r.text


def test_lorenz96_observation_dt_is_bounded(server, client):
    sid = create(client, LORENZ)
    ok = client.post(f"/v1/streams/{sid}/observations", json={"observations": [[8.0] * D]})
    assert ok.status_code == 200 and ok.json()["step"] == 1
    body = {"observations": [{"value": [8.0] * D, "dt": 1.0}, {"value": [8.0] * D, "dt": 1e38}]}
    r, seconds = timed(client.post, f"/v1/streams/{sid}/observations", json=body)
    message = refused(r, seconds, "observations[1].dt", "MPFLOW_MAX_INTEGRATION_SUBSTEPS")
    assert "1000" in message
    assert client.get(f"/v1/streams/{sid}").json()["step"] == 1  # nothing half-applied (not even the first step)
    other_stream_updates(client)
    # the same frame over the WebSocket: the POST's answer, as an error frame
    with connect(f"{server.url.replace('http://', 'ws://')}/v1/streams/{sid}/ws", open_timeout=10) as ws:
        t0 = time.perf_counter()
        ws.send(json.dumps(body))
        frame = json.loads(ws.recv(timeout=10))
        assert time.perf_counter() - t0 < QUICK_S
    assert frame["status"] == 413 and "observations[1].dt" in frame["error"]["message"]
    assert client.get(f"/v1/streams/{sid}").json()["step"] == 1
    # the largest dt the message offers is accepted
    r = client.post(f"/v1/streams/{sid}/observations", json={"observations": [{"value": [8.0] * D, "dt": 1000.0}]})
    assert r.status_code == 200 and r.json()["step"] == 2, r.text


@pytest.mark.parametrize(("param", "value"), [("delta", 1e38), ("rk4_step", 1e-38)])
def test_lorenz96_creation_substeps_are_bounded(client, param, value):
    body = {**LORENZ, "model": {"family": "lorenz96", "params": {param: value}}}
    r, seconds = timed(client.post, "/v1/streams", json=body)
    refused(r, seconds, f"model.params.{param}", "MPFLOW_MAX_INTEGRATION_SUBSTEPS")
    other_stream_updates(client)


def test_forecast_dt_is_bounded(client):
    sid = create(client, LORENZ)
    r, seconds = timed(client.get, f"/v1/streams/{sid}/forecast", params={"steps": 1, "dt": 1e38})
    refused(r, seconds, "dt", "MPFLOW_MAX_INTEGRATION_SUBSTEPS")
    assert client.get(f"/v1/streams/{sid}").json()["step"] == 0
    other_stream_updates(client)


def test_heavy_requests_are_refused_before_they_allocate(server, client):
    before = server.reset_peak()
    # item 3: a Gaussian prior of N = 65536 particles in d = 128 (it built an [N, d, d] Cholesky: +4.2 GB)
    r, seconds = timed(client.post, "/v1/streams", json=gaussian_stream(65536, 128))
    refused(r, seconds, "num_particles", "MPFLOW_MAX_REQUEST_BYTES")
    # a stream at N = 65536, d = 64 is within the budget; its 10-step forecast (+2.25 GB, 29 s) is not
    sid = create(client, gaussian_stream(65536, 64))
    peak_created = server.status("VmHWM") - before
    before = server.reset_peak()
    r, seconds = timed(client.get, f"/v1/streams/{sid}/forecast", params={"steps": 10})
    refused(r, seconds, "steps", "MPFLOW_MAX_REQUEST")
    # nor are 100000 draws of it (as JSON: about 460 MiB)
    r, seconds = timed(client.get, f"/v1/streams/{sid}/samples", params={"n": 100000})
    refused(r, seconds, "n", "MPFLOW_MAX_REQUEST_BYTES")
    assert server.status("VmHWM") - before < RSS_BOUND
    assert peak_created < 3 * RSS_BOUND, f"creating N = 65536, d = 64 took {peak_created / 2**20:.0f} MiB"
    assert client.delete(f"/v1/streams/{sid}").status_code == 204
    other_stream_updates(client)


def test_long_forecast_of_a_small_stream_is_bounded(server, client):
    sid = create(client, gaussian_stream(256, 2))
    before = server.reset_peak()
    r, seconds = timed(client.get, f"/v1/streams/{sid}/forecast", params={"steps": 1000})
    assert r.status_code == 200, r.text
    assert len(r.json()["forecast"]) == 1000
    assert server.status("VmHWM") - before < RSS_BOUND
    assert seconds < 10.0


#: the limits the server runs with (its defaults)
DEFAULTS = Settings(redis_url="redis://unused")
#: an ``smc`` smoothing stream of the 2-D ``lds`` of ``tests/harness/rts.py``
SMOOTHING = {"model": {"family": "lds", "params": rts.PARAMS}, "prior": rts.PRIOR, "method": "smc", "seed": 5}


def test_a_smoothing_window_is_priced_at_its_reads_work(monkeypatch, client):
    with monkeypatch.context() as m:  # the window the earlier price of a proposal (and a kernel term) let a stream keep
        m.setattr(backward_simulation, "PROPOSAL_FLOPS", 60.0)
        m.setattr(backward_simulation, "KERNEL_TERM_FLOPS", 2.0 * 2 + 20.0)
        old = largest_window(DEFAULTS, 100)
    assert old == 35945
    sid = f"old-window-{uuid.uuid4().hex[:8]}"
    body = {**SMOOTHING, "stream_id": sid, "num_particles": old, "smoothing_lag": 100}
    r, seconds = timed(client.post, "/v1/streams", json=body)
    message = refused(r, seconds, "smoothing_lag", "MPFLOW_MAX_REQUEST_FLOPS")
    model, updater, _ = smc_stream()
    lags = costs.largest(DEFAULTS, 100, lambda lag: costs.smoothing_cost(model, updater, old, lag))
    assert message.startswith("smoothing_lag:") and f"at most {lags} here" in message, message
    assert client.get(f"/v1/streams/{sid}").status_code == 404  # nothing created
    # the largest window at L = 10 — as dear as any accepted read, and short to fill
    n = largest_window(DEFAULTS, 10)
    assert n < old
    r, seconds = timed(client.post, "/v1/streams", json={**SMOOTHING, "num_particles": n + 1, "smoothing_lag": 10})
    refused(r, seconds, "smoothing_lag", "MPFLOW_MAX_REQUEST_FLOPS")
    sid = create(client, {**SMOOTHING, "num_particles": n, "smoothing_lag": 10})
    r = client.post(f"/v1/streams/{sid}/observations", json={"observations": rts.data(15)})
    assert r.status_code == 200 and r.json()["step"] == 15, r.text
    r, seconds = timed(client.get, f"/v1/streams/{sid}/smoothed")
    assert r.status_code == 200, r.text
    assert [s["step"] for s in r.json()["steps"]] == list(range(6, 16))
    assert seconds < DEFAULTS.worker_deadline_seconds, f"the largest window's read took {seconds:.1f} s"
    other_stream_updates(client)


#: an ``smc2`` stream learning R of a 1-D ``lds`` (log R ~ N(0, 1)) at N = 65536: M = 256 θ-particles of 256 states
SMC2_PARAMS = {"A": [[0.9]], "B": [[1.0]], "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}}
SMC2_N = 65536


def smc2_forecast_steps() -> int:
    """The most horizons of a forecast of the ``smc2`` stream the cost model accepts (at most the server's limit)."""
    model = make_model("lds", SMC2_PARAMS, 1)
    updater = get_updater("smc2", **DEFAULTS.method_options.get("smc2", {}))
    return costs.largest(
        DEFAULTS,
        DEFAULTS.max_forecast_steps,
        lambda k: costs.forecast_cost(model, updater, SMC2_N, k, 1.0, 0),
    )


#: "within a few seconds": the largest ``smc2`` forecast now accepted (47 horizons at N = 65536, priced 1.0 s at 25
#: Gflop/s) answered in 1.2 s on an idle core; moved one pair at a time, the same request took 9.7 s — under a third
#: of the deadline, so this bound, not the deadline's, is what tells the two apart
SMC2_FORECAST_SECONDS = 5.0


def test_the_largest_smc2_forecast_answers_within_a_few_seconds(client):
    now = smc2_forecast_steps()
    assert now >= 40  # priced as a particle filter's forecast (it was 2 horizons at 120000 flops a pair and horizon)
    body = {
        "model": {"family": "lds", "params": SMC2_PARAMS},
        "prior": {"type": "gaussian", "mean": [0.0], "cov": [[1.0]]},
        "method": "smc2",
        "num_particles": SMC2_N,
        "seed": 6,
    }
    sid = create(client, body)
    r = client.post(f"/v1/streams/{sid}/observations", json={"observations": [[0.3], [-0.1]]})
    assert r.status_code == 200, r.text
    r, seconds = timed(client.get, f"/v1/streams/{sid}/forecast", params={"steps": now + 1})
    message = refused(r, seconds, "steps", "MPFLOW_MAX_REQUEST_FLOPS")
    assert f"at most {now} here" in message, message
    r, seconds = timed(client.get, f"/v1/streams/{sid}/forecast", params={"steps": now})
    assert r.status_code == 200, r.text
    assert len(r.json()["forecast"]) == now
    assert seconds < SMC2_FORECAST_SECONDS, f"the largest forecast took {seconds:.1f} s"
    assert client.delete(f"/v1/streams/{sid}").status_code == 204
    other_stream_updates(client)


#: a default ``gpf`` stream this small spends its step in its iterations' fixed cost (about 18 of them a step here)
GPF_N = 16
#: a request the arithmetic-only price accepted (it accepted 1000 steps, the field's own cap)
GPF_OLD_STEPS = 20
#: "within a few seconds": the largest accepted request's answer (2 steps of at most 500 iterations of about 0.6 ms;
#: a loaded core takes a few times as long)
GPF_SECONDS = 5.0


def gpf_observation_steps() -> int:
    """The most steps of one observation request to a default ``gpf`` stream of :data:`GPF_N` particles (``lds``
    d = 2, as :func:`gaussian_stream`) the default budget accepts."""
    body = gaussian_stream(GPF_N, 2, "gpf")
    updater = get_updater("gpf", **DEFAULTS.method_options.get("gpf", {}))
    model = make_model("lds", body["model"]["params"], 2, updater.model_dtype)
    return costs.largest(
        DEFAULTS,
        DEFAULTS.max_observations_per_request,
        lambda k: costs.observations_cost(model, updater, GPF_N, [(1.0, None)] * k, 0),
    )


def test_an_iterative_solver_is_priced_at_its_iterations(monkeypatch, client):
    with monkeypatch.context() as m:  # the price before: the iterations' arithmetic only
        m.setattr(gpf, "ITERATION_FLOPS", 0.0)
        old = gpf_observation_steps()
    assert old == DEFAULTS.max_observations_per_request >= GPF_OLD_STEPS
    now = gpf_observation_steps()
    assert 1 <= now < GPF_OLD_STEPS
    sid = create(client, gaussian_stream(GPF_N, 2, "gpf"))
    obs = [[0.3 * math.sin(i), 0.2 * math.cos(i)] for i in range(GPF_OLD_STEPS)]
    r, seconds = timed(client.post, f"/v1/streams/{sid}/observations", json={"observations": obs})
    message = refused(r, seconds, "observations", "MPFLOW_MAX_REQUEST_FLOPS")
    assert f"at most {now} here" in message, message
    assert client.get(f"/v1/streams/{sid}").json()["step"] == 0  # nothing applied
    r, seconds = timed(client.post, f"/v1/streams/{sid}/observations", json={"observations": obs[:now]})
    assert r.status_code == 200 and r.json()["step"] == now, r.text
    assert seconds < GPF_SECONDS, f"the largest accepted request took {seconds:.1f} s"
    assert client.delete(f"/v1/streams/{sid}").status_code == 204
    other_stream_updates(client)
