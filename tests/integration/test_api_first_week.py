"""Issue 58 ("a user's first week"), through a real server and Redis (the fixtures of ``test_client``): a step with
nothing observed has no score (null increment and p-values; NaN in the client's arrays)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpflow.service.client import Client

from tests.integration.test_client import MODEL, PRIOR, server  # noqa: F401  (fixture)

#: observed, nothing observed (all null), nothing observed (null), partly observed
GAPPY = [[0.5, -0.2], [None, None], None, [0.3, None]]


def test_a_step_with_nothing_observed_has_no_score(server):  # noqa: F811
    with Client(server) as client:
        for method in ("kalman", "smc"):
            stream = client.create_stream(model=MODEL, prior=PRIOR, method=method, num_particles=64, seed=5)
            answer = stream.update(GAPPY)
            per_step = answer["per_step"]
            assert [s["step"] for s in per_step] == [1, 2, 3, 4]
            increments = [s["log_evidence_increment"] for s in per_step]
            assert increments[1] is None and increments[2] is None, (method, increments)
            assert math.isfinite(increments[0]) and math.isfinite(increments[3])
            assert all(per_step[k].get("pit") in (None, [None, None]) for k in (1, 2))  # null or absent
            assert per_step[3]["pit"][0] is not None and per_step[3]["pit"][1] is None
            # the stream's log-evidence is the sum of the scored steps
            assert abs(answer["summary"]["log_evidence"] - increments[0] - increments[3]) < 1e-6
            steps = answer.steps
            assert np.isnan(steps.log_evidence_increment[1:3]).all()
            assert np.isfinite(steps.log_evidence_increment[[0, 3]]).all()
            assert np.isnan(steps.pit[1:3]).all()
            history = stream.history()
            assert [s.get("log_evidence_increment") for s in history_entries(client, stream)][1:3] == [None, None]
            assert np.isnan(history.log_evidence_increment[1:3]).all()
            assert np.isfinite(history.log_evidence_increment[[0, 3]]).all()


def history_entries(client: Client, stream) -> list[dict]:
    """The raw history entries of a stream (``GET .../history``)."""
    r = client.http.get(f"/v1/streams/{stream.stream_id}/history")
    assert r.status_code == 200, r.text
    return r.json()["steps"]


DEFAULT_KEYS = {"0.025", "0.05", "0.5", "0.95", "0.975"}


def test_the_95_percent_region_by_default_and_the_levels_a_request_asks_for(server):  # noqa: F811
    with Client(server) as client:
        stream = client.create_stream(model=MODEL, prior=PRIOR, method="kalman", seed=1)
        assert set(stream.document["summary"]["quantiles"]) == DEFAULT_KEYS
        answer = stream.update([[0.5, -0.2], [0.7, 0.1]])
        s, last = answer["summary"], answer["per_step"][-1]
        assert set(s["quantiles"]) == DEFAULT_KEYS
        assert all(set(p["quantiles"]) == DEFAULT_KEYS for p in answer["per_step"])
        mean, sd = np.array(s["mean"]), np.array(s["std"])
        np.testing.assert_allclose(s["quantiles"]["0.975"], mean + 1.959963984540054 * sd, atol=1e-9)
        np.testing.assert_allclose(s["quantiles"]["0.025"], mean - 1.959963984540054 * sd, atol=1e-9)
        assert "cov" not in last and last["std"] == s["std"]
        # the request's own levels, and each step's covariance
        url = f"/v1/streams/{stream.stream_id}"
        body = {"observations": [[0.2, 0.4], [-0.3, 0.6]], "levels": [0.975, 0.1, 0.025], "per_step_cov": True}
        r = client.http.post(f"{url}/observations", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        keys = {"0.025", "0.1", "0.975"}
        assert set(got["summary"]["quantiles"]) == keys and all(set(p["quantiles"]) == keys for p in got["per_step"])
        assert got["per_step"][-1]["cov"] == got["summary"]["cov"] and len(got["per_step"][0]["cov"]) == 2
        m, sd = np.array(got["summary"]["mean"]), np.array(got["summary"]["std"])
        np.testing.assert_allclose(got["summary"]["quantiles"]["0.1"], m - 1.2815515655446004 * sd, atol=1e-9)
        # the stored summary keeps the defaults; GET takes ?levels=
        assert set(client.http.get(url).json()["summary"]["quantiles"]) == DEFAULT_KEYS
        doc = client.http.get(url, params={"levels": "0.005,0.995"}).json()
        assert set(doc["summary"]["quantiles"]) == {"0.005", "0.995"}
        np.testing.assert_allclose(doc["summary"]["quantiles"]["0.995"], m + 2.5758293035489 * sd, atol=1e-9)
        kept = client.http.get(url, params={"levels": "0.975,0.025"}).json()["summary"]["quantiles"]
        assert list(kept) == ["0.025", "0.975"]
        # the client's arrays: string keys as in the JSON, a number finds the same entry
        posterior = stream.get()
        assert posterior.quantiles[0.975].shape == (2,) and set(posterior.quantiles) == DEFAULT_KEYS
        table = stream.update([[0.1, 0.1]], levels=[0.025, 0.975], per_step_cov=True).steps
        assert set(table.quantiles) == {"0.025", "0.975"} and table.quantiles[0.975].shape == (1, 2)
        assert table.cov.shape == (1, 2, 2)
        # bounded and validated: 422 naming the field
        for bad in ([0.0, 0.5], [1.0], [0.5] * 10, [], ["0.5"]):
            r = client.http.post(f"{url}/observations", json={"observations": [[0.0, 0.0]], "levels": bad})
            assert r.status_code == 422 and "levels" in r.json()["error"]["message"], (bad, r.text)
        for bad in ("0,0.5", "x", "1.5", ",".join(["0.5"] * 10)):
            r = client.http.get(url, params={"levels": bad})
            assert r.status_code == 422 and "levels" in r.json()["error"]["message"], (bad, r.text)
        assert stream.get().step == 5  # nothing refused was applied


def test_p_values_are_named_by_the_observations_entries_with_their_two_sided_value(server):  # noqa: F811
    pd = pytest.importorskip("pandas")
    with Client(server) as client:
        stream = client.create_stream(
            model=MODEL, prior=PRIOR, method="kalman", seed=2, state_names=["position", "velocity"]
        )
        answer = stream.update([[0.5, -0.2], [3.5, None], None])
        for entry in answer["per_step"][:2]:
            want = [None if u is None else 2 * min(u, 1 - u) for u in entry["pit"]]
            assert entry["pit_two_sided"] == pytest.approx(want)
        assert answer["per_step"][1]["pit_two_sided"][1] is None
        assert answer["per_step"][2].get("pit_two_sided") in (None, [None, None])  # nothing observed
        summary = answer["summary"]
        assert summary["pit_step"] == 2 and summary["pit_two_sided"][0] == answer["per_step"][1]["pit_two_sided"][0]
        # the flag and the two-sided p-value agree: flagged exactly where it is below pit_alert
        assert summary["pit_flags"][0] == (summary["pit_two_sided"][0] < summary["pit_alert"])
        steps = answer.steps
        np.testing.assert_allclose(steps.pit_two_sided, 2 * np.minimum(steps.pit, 1 - steps.pit))
        np.testing.assert_allclose(answer.pit_two_sided[:1], summary["pit_two_sided"][:1])
        table = steps.to_pandas()
        assert {"pit_0", "pit_1", "pit_two_sided_0", "pit_two_sided_1"} <= set(table.columns)
        # a DataFrame's estimates: the same names, never a state dimension's (pit_position)
        frame = stream.filter(pd.DataFrame({"a": [0.1, 0.2], "b": [0.3, np.nan]}))
        assert {"pit_0", "pit_1", "pit_two_sided_0", "pit_two_sided_1"} <= set(frame.columns)
        assert not any(c.startswith(("pit_position", "pit_velocity", "pit_two_sided_position")) for c in frame.columns)
        assert {"mean_position", "q0.975_velocity"} <= set(frame.columns)
