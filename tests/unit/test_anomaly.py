"""The surprise and the anomaly score's sketch (``service/engine/anomaly.py``, issue 56): the sketch's rank is the
exact empirical CDF (ties half) within its bins' resolution, forgetting follows e^(−1/M), its stored form is bounded
and round-trips, the surprise is the Bonferroni-combined two-sided p-value's −log, and a request's steps are ranked
against every earlier one, its own included, after the warm-up."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mpflow.service.engine import anomaly
from mpflow.service.engine.anomaly import BINS, EDGES, Detector, Sketch
from scipy.stats import norm


def exact_rank(history: np.ndarray, s: float) -> float:
    return float((history < s).mean() + 0.5 * (history == s).mean())


def own_bin_mass(history: np.ndarray, s: float) -> float:
    """The fraction of the history in ``s``'s bin: how far the interpolated rank may be from the exact one."""
    b = anomaly._bin(s)
    return float(np.mean([anomaly._bin(float(h)) == b for h in history]))


@pytest.mark.parametrize("draw", ["exponential", "lognormal"])
def test_rank_is_the_empirical_cdf_within_the_bin_resolution(draw):
    rng = np.random.default_rng(7)
    history = rng.exponential(2.0, 3000) if draw == "exponential" else rng.lognormal(2.0, 1.5, 3000)  # to ~1e4
    sketch = Sketch()
    for s in history:
        sketch.add(float(s))
    queries = np.concatenate([rng.choice(history, 200), rng.uniform(0, history.max() * 1.1, 200)])
    errors = []
    for s in queries:
        got, want = sketch.rank(float(s)), exact_rank(history, float(s))
        assert abs(got - want) <= own_bin_mass(history, float(s)) + 1e-9, (s, got, want)
        errors.append(abs(got - want))
    assert max(errors) < 0.01  # 1 % of the steps: a bin of 0.05 nats, or 5 % of the surprise beyond 10 nats
    assert sketch.rank(history.max() * 1.2) == 1.0 and sketch.rank(0.0) == 0.0  # beyond the top bin: all below


def test_bins_are_bounded_and_fine():
    assert BINS <= 400
    widths = np.diff(EDGES)  # bin i ≥ 1: [EDGES[i − 1], EDGES[i])
    assert widths[:200].max() <= 0.05 + 1e-12  # 1 % of the surprise from 5 nats
    assert (widths[200:] / np.array(EDGES[200:-1])).max() <= 0.05 + 1e-12
    assert EDGES[-1] >= 1e5
    assert anomaly._bin(1e300) == BINS - 1 and anomaly._bin(0.0) == 0 and anomaly._bin(1e-300) == 1
    for i in range(1, BINS - 1):  # the middle of each bin is in it
        assert anomaly._bin(0.5 * (EDGES[i - 1] + EDGES[i])) == i


def test_forgetting_follows_the_memory():
    old, new = 1.0, 5.0
    keep, forget = Sketch(0), Sketch(100)
    for s in [old] * 1000 + [new] * 300:
        keep.add(s)
        forget.add(s)
    assert keep.rank(3.0) == pytest.approx(1000 / 1300)
    # the 1000 old steps weigh e^{-300/100} (1 - e^{-10}) / (1 - e^{-1/100}) against the 300 new ones' sum
    decay = math.exp(-1 / 100)
    w_new = (1 - decay**300) / (1 - decay)
    w_old = decay**300 * (1 - decay**1000) / (1 - decay)
    assert forget.rank(3.0) == pytest.approx(w_old / (w_old + w_new), rel=1e-3)
    assert forget.scored == keep.scored == 1300


def test_encode_decode_round_trips_and_stays_small():
    rng = np.random.default_rng(0)
    for memory in (0, 50):
        sketch = Sketch(memory)
        for s in rng.exponential(3.0, 2000):
            sketch.add(float(s))
        value = json.loads(json.dumps(sketch.encode()))
        back = Sketch.decode(value, memory)
        assert back.scored == sketch.scored
        for s in (0.1, 1.0, 4.0, 30.0):
            assert back.rank(s) == pytest.approx(sketch.rank(s), rel=1e-5)
        assert len(json.dumps(value, separators=(",", ":"))) < 4000
    full = Sketch()
    for e in (0.0, *EDGES):
        full.add(e * 1.0000001 + 1e-9)
        full.add(0.0)
    assert len(full.encode()["c"]) <= BINS and len(json.dumps(full.encode())) < 12000
    assert Sketch.decode(None).scored == 0  # a stream stored before the sketch existed


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"n": -1, "c": []},
        {"n": 1, "c": [[BINS, 1]]},
        {"n": 1, "c": [[3, 1], [2, 1]]},
        {"n": 1, "c": [[3, -1]]},
        {"n": 1, "c": [[3, float("inf")]]},
        {"n": 1, "c": [[i, 1] for i in range(BINS + 1)]},
        {"n": 1, "c": [], "x": 1},
        {"n": True, "c": []},
    ],
)
def test_decode_refuses_what_it_did_not_write(bad):
    with pytest.raises(ValueError):
        Sketch.decode(bad)


def test_surprise_is_the_bonferroni_combination_of_two_sided_p_values():
    assert anomaly.surprise(None, None) is None
    assert anomaly.surprise([None, None], [None, None]) is None
    z = 20.0
    s = anomaly.surprise([float(norm.logcdf(z))], [float(norm.logsf(z))])
    assert s == pytest.approx(-(math.log(2) + norm.logsf(z)))  # ≈ 203 nats
    assert 200 < s < 205
    assert anomaly.surprise([math.log(0.5)], [math.log(0.5)]) == 0.0  # the median of the predictive: p = 1
    # two entries: p = 2 · min_j p_j (capped at 1)
    lo, up = [math.log(0.001), math.log(0.4)], [math.log(0.999), math.log(0.6)]
    assert anomaly.surprise(lo, up) == pytest.approx(-math.log(2 * 2 * 0.001))
    assert anomaly.surprise([math.log(0.001), None], [math.log(0.999), None]) == pytest.approx(-math.log(0.002))


def observed(z: float) -> dict:
    """A one-entry per_step entry whose reading lies z sd from its Gaussian predictive's mean."""
    lo, up = [float(norm.logcdf(z))], [float(norm.logsf(z))]
    return {"log_tail_lower": lo, "log_tail_upper": up, "surprise": anomaly.surprise(lo, up)}


def with_surprise(s: float) -> dict:
    """A one-entry per_step entry of surprise s nats, in the upper tail."""
    return observed(float(norm.isf(0.5 * math.exp(-s))))


def test_score_ranks_within_the_request_after_the_warmup():
    sketch = Detector()
    steps = [with_surprise(s) for s in [0.1, 0.2, 0.3, 0.4, 5.0]] + [{"surprise": None}, {"step": 9}]
    anomaly.score(steps, sketch, warmup=3)
    scores = [e.get("anomaly_score", "absent") for e in steps]
    assert scores[:3] == [None, None, None]
    assert scores[3] == pytest.approx(1.0) and scores[4] == pytest.approx(1.0)
    assert scores[5] is None and scores[6] == "absent"
    assert sketch.scored == 5
    more = [with_surprise(0.25)]
    anomaly.score(more, sketch, warmup=3)
    assert more[0]["anomaly_score"] == pytest.approx(0.4, abs=0.05)  # 2 of 5 below, 0.25 within its own bin


def test_scored_reads_and_writes_the_stream_meta():
    meta: dict = {}  # a stream stored before the sketch existed: defaults
    steps = [observed(0.0) for _ in range(25)]  # the point mass at 0: ties, half
    fields = anomaly.scored(meta, steps)
    assert steps[19]["anomaly_score"] is None and steps[20]["anomaly_score"] == pytest.approx(0.5)
    assert fields[anomaly.STATE_FIELD]["surprise"]["n"] == 25
    assert anomaly.scored({**meta, **fields}, [{"surprise": None}]) == {}  # nothing scored: nothing to store
    garbage = {"anomaly_state": {"n": "x"}}
    assert anomaly.scored(garbage, [with_surprise(1.0)])[anomaly.STATE_FIELD]["surprise"]["n"] == 1


def test_a_level_shift_is_reported_at_its_onset_and_as_its_evidence_grows():
    """1000 N(0, 1) residuals, then 60 shifted by +1.5 sd: no single shifted step is a point anomaly (their surprises
    rank ~0.9 on average), but the upward CUSUM's rank reaches the top within a few steps of the shift and is
    reported only when it rises (0 in between), the downward and variance CUSUMs staying quiet."""
    rng = np.random.default_rng(3)
    z = np.r_[rng.standard_normal(1000), 1.5 + rng.standard_normal(60)]
    steps = [observed(float(v)) for v in z]
    detector = Detector()
    anomaly.score(steps, detector, warmup=20)
    change = np.array([e["change_score"] for e in steps[20:]])
    before, after = change[: 1000 - 20], change[1000 - 20 :]
    assert after.max() > 0.999 and int(np.argmax(after > 0.999)) < 15  # found within 15 steps of the shift
    assert (before > 0.999).mean() < 0.01  # a new record of the null CUSUM now and then, no more
    assert (after > 0).sum() < 30  # reported as it rises, not at every step of the run
    assert detector.changes["up"].w > 30 and detector.changes["down"].w == 0.0
    point = np.array([e["anomaly_score"] for e in steps[1000:]])
    assert np.mean([min(p, 0.999) for p in point]) > 0.5  # the combined score carries the change


def test_one_spike_is_a_point_anomaly_and_its_cusum_contribution_is_clipped():
    rng = np.random.default_rng(4)
    steps = [observed(float(v)) for v in rng.standard_normal(500)] + [observed(40.0)]
    detector = Detector()
    anomaly.score(steps, detector, warmup=20)
    assert steps[-1]["anomaly_score"] == pytest.approx(1.0, abs=1e-3) and steps[-1]["surprise"] > 800
    assert detector.changes["up"].w <= anomaly.DELTA * anomaly.Z_CAP + 20  # one step adds at most δ Z_CAP − δ²/2


def test_detector_state_round_trips_and_refuses_damage():
    rng = np.random.default_rng(5)
    detector = Detector(memory=50)
    anomaly.score([observed(float(v)) for v in rng.standard_normal(200)], detector, warmup=0)
    value = detector.encode()
    anomaly.check(value)
    back = Detector.decode(value, memory=50)
    assert back.encode() == value
    for bad in (
        {**value, "up": {"w": -1.0, "peak": 0.0, "sketch": value["up"]["sketch"]}},
        {"surprise": value["surprise"]},
    ):
        with pytest.raises(ValueError):
            Detector.decode(bad)
