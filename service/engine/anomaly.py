"""A step's surprise and the stream's calibrated anomaly score (docs/API.md "Surprise and anomaly score").

**Surprise** (nats, ≥ 0; :func:`surprise`). From the step's log tails of each observed entry j (``per_step``'s
``log_tail_lower`` = log P(O_j ≤ o_j | o_<m) and ``log_tail_upper`` = log P(O_j ≥ o_j | o_<m), natural logs that do
not saturate where ``pit`` does), the two-sided p-value p_j = 2 min(P_lower, P_upper), in logs

    log p_j = min(0, ln 2 + min(log_tail_lower_j, log_tail_upper_j)),

and, over the k observed entries, their Bonferroni combination:

    surprise = −min(0, ln k + min_j log p_j).

It is null for a step with nothing observed. For a Gaussian predictive a reading z sd away has a surprise of about
z²/2 + ln z − ln √(2/π) nats: 20 sd is about 203 nats, where ``pit`` is 1.0 exactly.

**Anomaly score** (∈ [0, 1]; :meth:`Sketch.rank`). The fraction of the stream's earlier scored steps whose surprise
is below this step's, ties counting half — the empirical CDF of the stream's own surprise history at this step's
surprise, so that scores rank alike across streams whatever their models' calibration. The history is kept as a
fixed-size :class:`Sketch` in the stream's metadata (``anomaly_sketch``), so the score is computed in constant time
and memory; with ``anomaly_memory`` M > 0 (a creation option, steps) the counts decay by e^{−1/M} a step, so the
history is the last ~M steps; M = 0 (the default) keeps all of it. Each step is ranked against every earlier step,
the earlier steps of its own request included (:func:`score`), then added. The score is null until the stream has
scored ``anomaly_warmup`` steps (a creation option, :data:`DEFAULT_WARMUP`).

**Change score** (∈ [0, 1]; :class:`Cusum`). One surprising reading is a point anomaly; a run of moderately surprising
ones is a change — a level shift, a drift, a variance that grew — which no single step's surprise ranks high. Each
step's Gaussianised residual z = Φ⁻¹(P(O ≤ o | o_<m)) (signed by the more surprising tail, |z| from the surprise,
clipped to ±:data:`Z_CAP` so that one spike adds at most a bounded amount) feeds Page's (1954) CUSUMs, each the
log-likelihood ratio, maximised over the change's start, of "changed since then" against "no change" (nats):

    W⁺_m = max(0, W⁺_{m−1} + δ z_m − δ²/2),   W⁻_m = max(0, W⁻_{m−1} − δ z_m − δ²/2)   (the mean moved by ±δ sd),
    V_m  = max(0, V_{m−1} + ½ ((1 − 1/λ) z_m² − ln λ))                                   (the variance grew λ-fold),

δ = :data:`DELTA`, λ = :data:`LAMBDA`. Each statistic is ranked, as the surprise is, against its own history (a
:class:`Sketch` of its earlier values), and reported only when its rank rises above the highest it reached in the
current excursion (the run since the statistic was last 0), so that a change is reported at its onset and again
only as the evidence for it grows, not at every step until the statistic decays; ``change_score`` is the largest
such rank of the step (0 when none rose). The step's ``anomaly_score`` is max(the surprise's rank, change_score).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

#: linear bins of width :data:`LINEAR_WIDTH` nats from 0 to :data:`LINEAR_TOP` (200 bins: ≤ 1 % of the surprise
#: from 5 nats up, where the bulk of a stream's steps lie)
LINEAR_WIDTH = 0.05
LINEAR_TOP = 10.0
#: then geometric bins, each edge :data:`GROWTH` times the last (5 % relative resolution), up to :data:`TOP` (189
#: bins); 391 bins in all with the point mass at 0 and the overflow. Within a bin the rank interpolates linearly,
#: so steps of one bin still rank in order of their surprise against the steps of the others
GROWTH = 1.05
TOP = 1e5
#: the stream metadata field that keeps the detector's state (:meth:`Detector.encode`)
STATE_FIELD = "anomaly_state"
#: the residual's clip (sd) in the CUSUMs, the mean shift δ (sd) and the variance ratio λ they test for (module
#: docstring; chosen on the Numenta Anomaly Benchmark, docs/benchmarks.md "NAB")
Z_CAP = 5.0
DELTA = 1.0
LAMBDA = 5.0
#: the CUSUMs, by name (:class:`Detector`)
CHANGES = ("up", "down", "variance")
#: the steps a stream scores before its anomaly score is given (``anomaly_warmup``'s default)
DEFAULT_WARMUP = 20
#: the bounds of the creation options ``anomaly_memory`` (steps) and ``anomaly_warmup``
MAX_MEMORY = 10_000_000
MAX_WARMUP = 100_000
#: under forgetting, counts are stored rounded to this many decimals (keeps the metadata small)
DIGITS = 6
#: under forgetting, a bin whose count decays below this is dropped (its steps are ~14 memories old)
FORGOTTEN = 1e-6


def _edges() -> tuple[float, ...]:
    n_linear = round(LINEAR_TOP / LINEAR_WIDTH)
    edges = [i * LINEAR_WIDTH for i in range(n_linear + 1)]
    while edges[-1] < TOP:
        edges.append(edges[-1] * GROWTH)
    return tuple(edges)


#: the bin edges. Bin 0 holds the surprises of exactly 0 — a point mass: a step of k ≥ 2 entries whose p-values are
#: all at least 1/k, a fair share of a stream's steps, has surprise 0 —, bin i (1 … len(EDGES) − 1) the surprises in
#: (or, for bin 1, above 0 in) [EDGES[i − 1], EDGES[i]), and the last, len(EDGES), the overflow: surprises ≥
#: EDGES[-1] (about 1e5 nats). Within the point mass and the overflow, surprises rank as ties (half)
EDGES = _edges()
#: the number of bins, the point mass at 0 and the overflow included
BINS = len(EDGES) + 1


def surprise(lower: Sequence[float | None] | None, upper: Sequence[float | None] | None) -> float | None:
    """−min(0, ln k + min_j log p_j), log p_j = min(0, ln 2 + min(lower_j, upper_j)), over the k entries observed
    (both tails given); None when none is (module docstring)."""
    if not lower or not upper:
        return None
    pairs = [(lo, up) for lo, up in zip(lower, upper, strict=True) if lo is not None and up is not None]
    logs = [min(0.0, math.log(2.0) + min(lo, up)) for lo, up in pairs]
    if not logs:
        return None
    return -min(0.0, math.log(len(logs)) + min(logs))


def _bin(s: float) -> int:
    """The bin holding surprise ``s`` (≥ 0; :data:`EDGES`)."""
    if s <= 0.0:
        return 0
    if s < LINEAR_TOP:
        return 1 + min(int(s / LINEAR_WIDTH), round(LINEAR_TOP / LINEAR_WIDTH) - 1)
    return bisect.bisect_right(EDGES, s)


class Sketch:
    """A histogram of a stream's surprises over the fixed bins :data:`EDGES` (module docstring): ``counts`` per bin,
    ``total`` their sum, ``scored`` the number of steps ever added (what the warm-up counts), ``decay`` the factor
    e^{−1/M} applied to the counts before each addition (1.0: no forgetting)."""

    __slots__ = ("counts", "decay", "scored", "total")

    def __init__(self, memory: int = 0) -> None:
        self.counts: dict[int, float] = {}
        self.total = 0.0
        self.scored = 0
        self.decay = math.exp(-1.0 / memory) if memory and memory > 0 else 1.0

    def add(self, s: float) -> None:
        """Add one step's surprise (after forgetting: every count times ``decay``)."""
        if self.decay < 1.0:
            self.counts = {i: c * self.decay for i, c in self.counts.items() if c * self.decay >= FORGOTTEN}
            self.total = sum(self.counts.values())
        i = _bin(max(0.0, s))
        self.counts[i] = self.counts.get(i, 0.0) + 1.0
        self.total += 1.0
        self.scored += 1

    def rank(self, s: float) -> float | None:
        """The (weighted) fraction of the surprises added that are below ``s``, those in ``s``'s own bin split by
        linear interpolation within the bin (half of them in the point mass at 0 and in the overflow: ties): the
        empirical CDF, ties half, within a bin's resolution. None while nothing has been added."""
        if self.total <= 0.0:
            return None
        s = max(0.0, s)
        b = _bin(s)
        below = sum(c for i, c in self.counts.items() if i < b)
        own = self.counts.get(b, 0.0)
        if b in (0, BINS - 1):
            frac = 0.5
        else:
            lo, hi = EDGES[b - 1], EDGES[b]
            frac = min(1.0, max(0.0, (s - lo) / (hi - lo)))
        return min(1.0, max(0.0, (below + frac * own) / self.total))

    def encode(self) -> dict[str, Any]:
        """The JSON form kept in the stream's metadata: ``{"n": scored, "c": [[bin, count], ...]}`` (the non-empty
        bins in order, at most :data:`BINS` pairs; the counts whole numbers without forgetting, else rounded to
        :data:`DIGITS` decimals)."""
        items = sorted(self.counts.items())
        if self.decay == 1.0:  # every count a sum of ones: exact integers
            return {"n": self.scored, "c": [[i, int(c)] for i, c in items]}
        rounded = ((i, round(c, DIGITS)) for i, c in items)
        return {"n": self.scored, "c": [[i, c] for i, c in rounded if c > 0.0]}

    @classmethod
    def decode(cls, value: Any, memory: int = 0, checked: bool = True) -> Sketch:
        """:meth:`encode`'s form back (None, or a stream stored before the sketch existed: an empty sketch).
        ``ValueError`` for anything else (:func:`check`; ``checked=False``, for what this server wrote itself, skips
        the check but for the bins' range: the caller catches what a damaged value raises)."""
        sketch = cls(memory)
        if value is None:
            return sketch
        if checked:
            check_sketch(value)
        counts = {int(i): float(c) for i, c in value["c"] if c > 0}
        if counts and not (min(counts) >= 0 and max(counts) < BINS):
            raise ValueError(f"c: bin indices in [0, {BINS})")
        sketch.counts = counts
        sketch.total = sum(counts.values())
        sketch.scored = int(value["n"])
        return sketch


def check_sketch(value: Any) -> None:
    """``ValueError`` unless ``value`` is :meth:`Sketch.encode`'s form: ``n`` an integer ≥ 0, ``c`` at most
    :data:`BINS` pairs of a bin index in [0, BINS) (increasing) and a finite count ≥ 0."""
    if not (isinstance(value, dict) and set(value) == {"n", "c"}):
        raise ValueError('an object {"n": <steps scored>, "c": [[bin, count], ...]}')
    n, pairs = value["n"], value["c"]
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        raise ValueError("n: an integer ≥ 0 (the steps scored)")
    if not (isinstance(pairs, list) and len(pairs) <= BINS):
        raise ValueError(f"c: a list of at most {BINS} [bin, count] pairs")
    last = -1
    for pair in pairs:
        ok = isinstance(pair, list) and len(pair) == 2
        i, c = (pair[0], pair[1]) if ok else (None, None)
        ok = ok and isinstance(i, int) and not isinstance(i, bool) and last < i < BINS
        ok = ok and isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) and c >= 0
        if not ok:
            raise ValueError(f"c: each pair a bin index in [0, {BINS}), increasing, and a finite count ≥ 0")
        last = i


def signed_z(lower: Sequence[float | None], upper: Sequence[float | None], surprise_: float) -> float:
    """The step's Gaussianised residual (module docstring): |z| = Φ⁻¹(1 − p/2) for the combined two-sided p-value
    p = e^{−surprise}, signed + when the most surprising observed entry lies in its upper tail, clipped to
    ±:data:`Z_CAP`."""
    pairs = [(lo, up) for lo, up in zip(lower, upper, strict=True) if lo is not None and up is not None]
    lo, up = min(pairs, key=lambda pair: min(pair))
    p_half = 0.5 * math.exp(-surprise_)
    size = Z_CAP if p_half <= _HALF_TAIL_AT_CAP else min(Z_CAP, -_ndtri(p_half))
    return size if up < lo else -size


def _ndtri(p: float) -> float:
    """Φ⁻¹(p): the standard library's inverse normal CDF (Wichura's AS241)."""
    return _STANDARD_NORMAL.inv_cdf(p)


_STANDARD_NORMAL = NormalDist()


#: Φ(−Z_CAP): a half p-value at or below it is a residual at the clip
_HALF_TAIL_AT_CAP = 0.5 * math.erfc(Z_CAP / math.sqrt(2.0))


def increments(z: float) -> dict[str, float]:
    """Each CUSUM's log-likelihood-ratio increment for residual z (module docstring)."""
    return {
        "up": DELTA * z - 0.5 * DELTA**2,
        "down": -DELTA * z - 0.5 * DELTA**2,
        "variance": 0.5 * ((1.0 - 1.0 / LAMBDA) * z * z - math.log(LAMBDA)),
    }


class Cusum:
    """One of the change CUSUMs (module docstring): its value ``w`` (nats), the highest rank ``peak`` it reached in
    the current excursion, and the :class:`Sketch` of its earlier values that ranks it."""

    __slots__ = ("peak", "sketch", "w")

    def __init__(self, memory: int = 0) -> None:
        self.w = 0.0
        self.peak = 0.0
        self.sketch = Sketch(memory)

    def step(self, increment: float, ranked: bool) -> float:
        """Add a step's increment; the rank to report (0 unless it rose above the excursion's peak; 0 too when not
        ``ranked``, in the warm-up), the new value then joining the history."""
        self.w = max(0.0, self.w + increment)
        report = 0.0
        if self.w <= 0.0:
            self.peak = 0.0
        else:
            rank = self.sketch.rank(self.w)
            if ranked and rank is not None and rank > self.peak:
                report = self.peak = rank
        self.sketch.add(self.w)
        return report

    def encode(self) -> dict[str, Any]:
        return {"w": self.w, "peak": self.peak, "sketch": self.sketch.encode()}


class Detector:
    """A stream's anomaly state: the :class:`Sketch` of its surprises and its change :class:`Cusum` s (module
    docstring), kept as one metadata field (:data:`STATE_FIELD`, :meth:`encode`)."""

    def __init__(self, memory: int = 0) -> None:
        self.surprises = Sketch(memory)
        self.changes = {name: Cusum(memory) for name in CHANGES}

    def score(self, entry: dict[str, Any], warmup: int) -> None:
        """Set one ``per_step`` entry's ``anomaly_score`` and ``change_score`` (null without a surprise, and during
        the warm-up), then add the step to the histories."""
        s = entry["surprise"]
        if s is None:
            entry["anomaly_score"] = entry["change_score"] = None
            return
        warm = self.surprises.scored >= warmup
        point = self.surprises.rank(s) if warm else None
        self.surprises.add(s)
        z = signed_z(entry["log_tail_lower"], entry["log_tail_upper"], s)
        change = max(c.step(inc, warm) for c, inc in zip(self.changes.values(), increments(z).values(), strict=True))
        entry["change_score"] = change if warm else None
        entry["anomaly_score"] = None if point is None else max(point, change)

    @property
    def scored(self) -> int:
        return self.surprises.scored

    def encode(self) -> dict[str, Any]:
        """``{"surprise": <sketch>, "up": <cusum>, "down": <cusum>, "variance": <cusum>}``, each sketch in
        :meth:`Sketch.encode`'s form and each CUSUM ``{"w", "peak", "sketch"}``."""
        return {"surprise": self.surprises.encode(), **{name: c.encode() for name, c in self.changes.items()}}

    @classmethod
    def decode(cls, value: Any, memory: int = 0, checked: bool = True) -> Detector:
        """:meth:`encode`'s form back (None: a new detector); ``ValueError`` for anything else (:func:`check`;
        ``checked=False``, for what this server wrote itself, skips the check: the caller catches what a damaged
        value raises)."""
        detector = cls(memory)
        if value is None:
            return detector
        if checked:
            check(value)
        detector.surprises = Sketch.decode(value["surprise"], memory, checked=False)
        for name, c in detector.changes.items():
            c.w, c.peak = float(value[name]["w"]), float(value[name]["peak"])
            c.sketch = Sketch.decode(value[name]["sketch"], memory, checked=False)
        return detector


def check(value: Any) -> None:
    """``ValueError`` unless ``value`` is :meth:`Detector.encode`'s form (each sketch as :func:`check_sketch` reads
    it, each CUSUM's ``w`` a finite number ≥ 0 and ``peak`` one in [0, 1])."""
    if not (isinstance(value, dict) and set(value) == {"surprise", *CHANGES}):
        raise ValueError(f"an object with the keys surprise, {', '.join(CHANGES)}")
    try:
        check_sketch(value["surprise"])
    except ValueError as exc:
        raise ValueError(f"surprise: {exc}") from None
    for name in CHANGES:
        c = value[name]
        if not (isinstance(c, dict) and set(c) == {"w", "peak", "sketch"}):
            raise ValueError(f'{name}: an object {{"w": <nats>, "peak": <rank>, "sketch": <sketch>}}')
        w, peak = c["w"], c["peak"]
        if not (_number(w) and w >= 0 and _number(peak) and 0 <= peak <= 1):
            raise ValueError(f"{name}: w a finite number ≥ 0 and peak a number in [0, 1]")
        try:
            check_sketch(c["sketch"])
        except ValueError as exc:
            raise ValueError(f"{name}.sketch: {exc}") from None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def score(per_step: list[dict[str, Any]], detector: Detector, warmup: int) -> None:
    """Score each entry that has a ``surprise`` key, in order (:meth:`Detector.score`): each step against the steps
    added before it, the earlier steps of the same request included."""
    for entry in per_step:
        if "surprise" in entry:
            detector.score(entry, warmup)


def scored(meta: dict[str, Any], per_step: list[dict[str, Any]]) -> dict[str, Any]:
    """Score a request's ``per_step`` entries (:func:`score`) with the stream's detector (its metadata's
    ``anomaly_state``, ``anomaly_memory`` and ``anomaly_warmup``; a stream stored before these existed starts a
    new detector, all its history kept, the default warm-up): the metadata fields to store — the state, when some
    step was scored."""
    memory = int(meta.get("anomaly_memory") or 0)
    warmup = meta.get("anomaly_warmup")
    warmup = DEFAULT_WARMUP if warmup is None else int(warmup)
    try:  # written by this server (an import checks a snapshot's in full: :func:`check`)
        detector = Detector.decode(meta.get(STATE_FIELD), memory, checked=False)
    except (ValueError, TypeError, KeyError, AttributeError):  # damaged: start again rather than fail the updates
        detector = Detector(memory)
    before = detector.scored
    score(per_step, detector, warmup)
    return {STATE_FIELD: detector.encode()} if detector.scored != before else {}


__all__ = [
    "BINS",
    "CHANGES",
    "DEFAULT_WARMUP",
    "EDGES",
    "MAX_MEMORY",
    "MAX_WARMUP",
    "STATE_FIELD",
    "Cusum",
    "Detector",
    "Sketch",
    "check",
    "check_sketch",
    "increments",
    "score",
    "scored",
    "signed_z",
    "surprise",
]
