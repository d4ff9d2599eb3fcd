"""The streams and server settings that tests and benchmarks share (the load, fault and bad-input scenarios)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
TENANT = "default"  # the tenant of an open server (no API keys)
STATE_DIM = 2

_ROT = [[math.cos(0.1), -math.sin(0.1)], [math.sin(0.1), math.cos(0.1)]]
#: the load and fault scenarios' model: ``lds`` d = 2, x_m = A x_{m−1} + N(0, Q), o_m = x_m + N(0, R) with
#: A = 0.95·rot(0.1 rad), Q = 0.1 I, R = 0.5 I
LDS_MODEL = {
    "family": "lds",
    "params": {
        "A": [[0.95 * a for a in row] for row in _ROT],
        "Q": [[0.1, 0.0], [0.0, 0.1]],
        "B": [[1.0, 0.0], [0.0, 1.0]],
        "R": [[0.5, 0.0], [0.0, 0.5]],
    },
}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}

#: the bad-input scenarios' server settings: small limits and short iterative methods keep generated streams cheap
SERVER_ENV = {
    "MPFLOW_MAX_PARTICLES": "64",
    "MPFLOW_MAX_STATE_DIM": "4",
    "MPFLOW_MAX_SAMPLES_PER_REQUEST": "200",
    "MPFLOW_MAX_OBSERVATIONS_PER_REQUEST": "5",
    "MPFLOW_METHOD_OPTIONS": json.dumps(
        {"nvgd": {"max_iters": 3, "inner_steps": 3}, "gpf": {"max_iters": 60}, "svgd": {"max_iters": 10}}
    ),
}
#: server method options for tests that send several steps a request to the iterative methods: each step is priced
#: at its ``max_iters`` iterations' fixed cost (docs/API.md "Limits"), so at the defaults a request takes 2 ``gpf``
#: steps (500 iterations each), 20 ``svgd`` steps at N = 64 and one ``nvgd`` step (50 × 10 Adam steps); at these a
#: ``gpf`` step is priced 1e9, an ``svgd`` one 6e8 and an ``nvgd`` one 1.1e9 (22 or more steps a request up to
#: N = 64), and the ``gpf`` streams of these tests converge within them (in about 20 iterations)
SHORT_SOLVERS = {"gpf": {"max_iters": 50}, "svgd": {"max_iters": 50}, "nvgd": {"max_iters": 6, "inner_steps": 4}}
#: a cheap stream to send hostile bodies to
LINEAR_STREAM = {
    "model": {"family": "linear_gaussian"},
    "prior": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "method": "smc",
    "num_particles": 16,
    "seed": 1,
}

GAUSS2 = {"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 0.8]]}
#: every family, d = 2: its ``model.params`` and one step's observation built from a number v
FAMILIES: dict[str, tuple[dict[str, Any], Callable[[float], Any]]] = {
    "linear_gaussian": ({}, lambda v: [v, -v]),
    "lds": ({"A": [[0.9, 0.1], [0.0, 0.8]], "B": [[1.0, 0.0]], "R": [[0.5]]}, lambda v: [v]),
    "gmm": ({"s": 1.0}, lambda v: v),
    "logistic": ({}, lambda v: {"x": [[v, 1.0], [1.0, -v], [0.5, 0.5]], "y": [1, 0, 1]}),
    "stochastic_volatility": ({"phi": 0.9}, lambda v: [v, -v]),
}
