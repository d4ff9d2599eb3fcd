"""The default method is the measured best: ``service/engine/default_methods.json`` is what ``python -m
benchmarks.equal_compute`` (full run) wrote, and the service follows it for a request that names no method."""

from __future__ import annotations

import pytest
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.updaters import UPDATERS
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.default_methods import default_method, table
from mpflow.service.engine.methods import Methods
from mpflow.service.schemas import CreateStreamRequest
from mpflow.service.settings import Settings

ENTRIES = table()


def _request(family: str, d: int, **fields) -> CreateStreamRequest:
    prior = {"type": "gaussian", "mean": [0.0] * d, "cov": [[float(i == j) for j in range(d)] for i in range(d)]}
    return CreateStreamRequest.model_validate({"model": {"family": family}, "prior": prior, **fields})


def _model(family: str, d: int, params: dict | None = None):
    return make_model(family, params or {}, d)


def test_the_table_is_a_full_benchmark_run_within_the_cost_cap() -> None:
    assert ENTRIES, "service/engine/default_methods.json is missing: run python -m benchmarks.equal_compute"
    for e in ENTRIES:
        assert e["family"] in FAMILIES and e["method"] in UPDATERS, e
        assert e["ms_batched"] <= 10 * e["budget_ms"] + 1e-9, e  # never more than 10x mpf's cost at N = 256
        assert e["reason"].startswith("measured most accurate"), e
        if FAMILIES[e["family"]].linear_gaussian:
            assert e["method"] == "kalman", e  # exact, and the cheapest


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e['family']}-d{e['state_dim']}")
def test_the_service_follows_the_table(entry) -> None:
    methods = Methods(Settings(), OperatorCatalogue())
    methods.operators.load()
    family, d = entry["family"], entry["state_dim"]
    if family == "lds":
        pytest.skip("lds has required parameters: checked through the API in tests/integration")
    model = _model(family, d, entry.get("params"))  # the setting it was measured in (lorenz96: sakov2008, …)
    choice = methods.choose(_request(family, d), model)
    assert choice.method == entry["method"]
    assert choice.num_particles == entry["num_particles"]
    want = dict(entry["options"])
    assert choice.operator == want.pop("operator", None)
    assert choice.options == want
    assert choice.reason == entry["reason"]
    # a request that names its method gets it, without a reason
    named = methods.choose(_request(family, d, method="smc"), model)
    assert (named.method, named.reason, named.options) == ("smc", None, {})


def test_a_dimension_not_measured_takes_the_nearest_one() -> None:
    entries = [
        {"family": "gmm", "state_dim": 2, "method": "smc", "options": {}, "num_particles": 4096, "reason": "r2"},
        {"family": "gmm", "state_dim": 10, "method": "mpf", "options": {"substeps": 4}, "num_particles": 256,
         "reason": "r10"},
    ]  # fmt: skip
    near = default_method("gmm", 8, False, entries)
    assert (near.method, near.options, near.num_particles) == ("mpf", {"substeps": 4}, 256)
    assert near.reason == "as measured at d = 10, the nearest benchmarked d: r10"
    assert default_method("gmm", 2, False, entries).reason == "r2"
    assert default_method("gmm", 6, False, entries).method == "smc"  # a tie goes to the smaller d
    unknown = default_method("my_family", 3, False, entries)
    assert unknown.method == "smc" and "not benchmarked" in unknown.reason
    assert default_method("my_linear_family", 3, True, entries).method == "kalman"


def test_a_family_measured_in_several_regimes_takes_the_nearest_regime() -> None:
    """lorenz96 at d = 40 is measured at Δ = 0.05 with every variable observed (sakov2008) and at Δ = 0.4 with every
    second one (spantini2019): a stream takes the entry of its own regime, or the nearest in log-distance."""
    entries = [
        {"family": "lorenz96", "state_dim": 40, "regime": {"delta": 0.05, "obs_every": 1.0}, "method": "ukf",
         "options": {}, "num_particles": 40, "reason": "sakov"},
        {"family": "lorenz96", "state_dim": 40, "regime": {"delta": 0.4, "obs_every": 2.0}, "method": "enkf",
         "options": {"localisation": 4}, "num_particles": 100, "reason": "spantini"},
    ]  # fmt: skip
    sakov = default_method("lorenz96", 40, False, entries, {"delta": 0.05, "obs_every": 1.0})
    assert (sakov.method, sakov.reason) == ("ukf", "sakov")
    spantini = default_method("lorenz96", 40, False, entries, {"delta": 0.4, "obs_every": 2.0})
    assert (spantini.method, spantini.options, spantini.num_particles) == ("enkf", {"localisation": 4}, 100)
    assert spantini.reason == "spantini"
    near = default_method("lorenz96", 40, False, entries, {"delta": 0.3, "obs_every": 2.0})
    assert near.method == "enkf"
    assert near.reason == "as measured at delta = 0.4, obs_every = 2, the nearest benchmarked regime: spantini"
    # a regime between the two goes to the nearer in log-distance: Δ = 0.1, every variable is sakov2008's side
    assert default_method("lorenz96", 40, False, entries, {"delta": 0.1, "obs_every": 1.0}).method == "ukf"
    # another d: the nearest d first, then its nearest regime
    other = default_method("lorenz96", 20, False, entries, {"delta": 0.4, "obs_every": 2.0})
    assert other.method == "enkf" and other.reason.startswith("as measured at d = 40")
    # no parameters (a caller that does not know them): the first entry of the nearest d, as before
    assert default_method("lorenz96", 40, False, entries).method == "ukf"


def test_lorenz96_defaults_cover_the_spantini_regime() -> None:
    """The table holds a measured entry per benchmarked Lorenz-96 setting, keyed by (Δ, obs_every)."""
    settings = {e["setting"]: e for e in ENTRIES if e["family"] == "lorenz96"}
    assert {"sakov2008", "bocquet2010", "spantini2019"} <= set(settings)
    assert settings["spantini2019"]["regime"] == {"delta": 0.4, "obs_every": 2.0}
    assert "spantini2019" in settings["spantini2019"]["reason"]
