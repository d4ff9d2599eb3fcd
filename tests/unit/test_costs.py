"""The cost model (:mod:`mpflow.service.streams.costs`) and the bounded integration loops it relies on: sub-steps
counted by the family, the loop refusing more than its ceiling, estimates that grow as the methods do, and 413s that
name the field, the limit and the largest value that fits."""

from __future__ import annotations

import time

import pytest
import torch
from mpflow.operators import mixture_evidence
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import GaussianMixture
from mpflow.operators.mpf import marginal
from mpflow.operators.rng import StreamRNG, rand, randn
from mpflow.operators.smoothing import backward_simulation
from mpflow.operators.updaters import base, get_updater, gpf, nvgd, svgd
from mpflow.service.errors import ApiError
from mpflow.service.settings import Settings
from mpflow.service.streams import costs

SETTINGS = Settings()


def lds(d: int):
    eye = torch.eye(d)
    return make_model("lds", {"A": (0.9 * eye).tolist(), "B": eye.tolist()}, d)


def gaussian(d: int) -> GaussianMixture:
    return GaussianMixture.gaussian(torch.zeros(1, d), torch.eye(d)[None])


# ----------------------------------------------------------------- integration sub-steps


def test_lorenz96_counts_its_substeps_in_float64():
    assert make_model("lorenz96", {}, 8).integration_substeps() == 1.0
    fine = make_model("lorenz96", {"delta": 0.1, "rk4_step": 0.001}, 8)
    assert fine.integration_substeps() == 100.0
    assert fine.integration_substeps(2.5) == 250.0
    assert fine.at_step(2.5).integration_substeps() == 250.0  # the step's model says the same
    huge = make_model("lorenz96", {"delta": 1e38}, 8).integration_substeps(1e38)
    assert huge == pytest.approx(2e77, rel=1e-6)  # an honest count, not inf or an overflow
    tiny = make_model("lorenz96", {"rk4_step": 1e-38}, 8).integration_substeps()
    assert tiny == pytest.approx(5e36, rel=1e-3)


def test_closed_form_families_take_one_substep_whatever_dt():
    assert lds(2).integration_substeps(1e30) == 1.0
    assert make_model("linear_gaussian", {}, 2).integration_substeps(1e30) == 1.0


def test_lorenz96_loop_refuses_beyond_its_ceiling_before_any_step():
    model = make_model("lorenz96", {"delta": 1e38}, 8)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"model.params.delta, model.params.rk4_step: .* more than the 1000000"):
        model.transition_mean(torch.zeros(1, 4, 8))
    assert time.perf_counter() - t0 < 0.5


def test_check_substeps_names_the_field_and_the_longest_dt():
    model = make_model("lorenz96", {"delta": 0.05, "rk4_step": 0.005}, 8)  # 10 sub-steps per observation
    costs.check_substeps(SETTINGS, model, 99.0, "observations[0]")  # 990 sub-steps: under the limit
    with pytest.raises(ApiError) as err:
        costs.check_substeps(SETTINGS, model, 1e38, "observations[3]")
    assert err.value.status == 413 and err.value.code == "limit_exceeded"
    assert err.value.message.startswith("observations[3].dt: ")
    assert "MPFLOW_MAX_INTEGRATION_SUBSTEPS" in err.value.message and "dt at most about 100" in err.value.message
    with pytest.raises(ApiError) as err:
        costs.check_substeps(SETTINGS, model, 1e38, "")  # a query parameter
    assert err.value.message.startswith("dt: ")
    with pytest.raises(ApiError) as err:
        costs.check_substeps(SETTINGS, make_model("lorenz96", {"rk4_step": 1e-38}, 8), 1.0, None)
    assert err.value.message.startswith("model.params.delta, model.params.rk4_step: ")


def test_requested_steps_read_dt_and_entries_and_refuse_bad_dt():
    steps = costs.requested_steps([[1.0, 2.0], {"value": [[1, 2], [3, None]], "dt": 0.5}, None])
    assert steps == [(1.0, 2), (0.5, 4), (1.0, 1)]
    with pytest.raises(ApiError) as err:
        costs.requested_steps([[1.0], {"value": [1.0], "dt": -1}])
    assert err.value.status == 422 and err.value.message.startswith("observations[1].dt: ")


# ----------------------------------------------------------------- estimates


#: each iterative solver's fixed cost per iteration (whatever N): gpf's and svgd's iteration, nvgd's outer iteration
#: and its ``inner_steps`` Adam steps
ITERATION_CONSTANTS = {
    "gpf": ((gpf, "ITERATION_FLOPS"),),
    "svgd": ((svgd, "ITERATION_FLOPS"),),
    "nvgd": ((nvgd, "ITERATION_FLOPS"), (nvgd, "ADAM_STEP_FLOPS")),
}


@pytest.mark.parametrize("method", ["gpf", "svgd", "nvgd"])
def test_an_iterative_solver_is_priced_its_iterations_fixed_cost(monkeypatch, method):
    """max_iters · (the iteration's fixed cost + inner_steps · an Adam step's) on top of the arithmetic, whatever N:
    at N = 16 the fixed cost is nearly the whole price (the solvers' time at small N, benchmarks/price_audit.py)."""
    m = lds(2)
    updater = get_updater(method)
    opts = updater.options
    fixed = opts["max_iters"] * (
        updater_module(method).ITERATION_FLOPS + opts.get("inner_steps", 0) * nvgd.ADAM_STEP_FLOPS
    )
    priced = {n: updater.step_work(m, n).flops for n in (16, 256)}
    with monkeypatch.context() as patched:
        for module, name in ITERATION_CONSTANTS[method]:
            patched.setattr(module, name, 0.0)
        arithmetic = {n: updater.step_work(m, n).flops for n in (16, 256)}
    for n in (16, 256):
        assert priced[n] - arithmetic[n] == pytest.approx(fixed)
    assert fixed > 10 * arithmetic[16]
    # an iteration at small N takes a few tenths of a millisecond at least: 5e6 operations at 25 Gflop/s
    assert fixed / opts["max_iters"] >= 5e6
    # fewer iterations (the server's MPFLOW_METHOD_OPTIONS) price proportionally less
    fewer = get_updater(method, max_iters=opts["max_iters"] // 10).step_work(m, 16).flops
    assert fewer < priced[16] / 5


def updater_module(method: str):
    return {"gpf": gpf, "svgd": svgd, "nvgd": nvgd}[method]


def test_nvgd_is_priced_per_launch_of_its_network():
    """``nvgd``'s price at small N is its network's launches: each of ``max_iters`` outer iterations runs up to
    ``inner_steps`` Adam steps (the witness's forward pass with its tangents, autograd's backward pass, the update:
    ``ADAM_STEP_FLOPS`` each, measured by ``benchmarks/price_audit.py``) besides its own ``ITERATION_FLOPS`` — so
    five more Adam steps in each of 10 iterations add 50 launches, 10 more iterations of 5 add 50 launches and 10
    iterations' fixed cost, the arithmetic at N = 16 under 2 % of either."""
    m = lds(2)

    def price(max_iters: int, inner_steps: int) -> float:
        return get_updater("nvgd", max_iters=max_iters, inner_steps=inner_steps).step_work(m, 16).flops

    launches = price(10, 10) - price(10, 5)
    assert launches == pytest.approx(50 * nvgd.ADAM_STEP_FLOPS, rel=0.02)
    iterations = price(20, 5) - price(10, 5)
    assert iterations == pytest.approx(50 * nvgd.ADAM_STEP_FLOPS + 10 * nvgd.ITERATION_FLOPS, rel=0.02)


def test_small_iterative_streams_take_few_steps_a_request(monkeypatch):
    """At their iterations' fixed cost, a default ``gpf`` stream of 16 particles takes a few observations a request
    (its 500 iterations a step could take about 0.5 s), where the arithmetic alone let it take all 1000; a default
    ``nvgd`` step (50 × 10 Adam steps, up to about a second) takes a request of its own, and the plain solver's
    60 × 20 does not fit one at all."""
    m, prior = lds(2), gaussian(2)

    def steps(method: str) -> int:
        updater = get_updater(method)
        return costs.largest(SETTINGS, 1000, lambda k: costs.observations_cost(m, updater, 16, [(1.0, None)] * k, 0))

    now = {method: steps(method) for method in ("gpf", "svgd", "nvgd")}
    with monkeypatch.context() as patched:
        for pairs in ITERATION_CONSTANTS.values():
            for module, name in pairs:
                patched.setattr(module, name, 0.0)
        before = {method: steps(method) for method in ("gpf", "svgd", "nvgd")}
    assert before["gpf"] == 1000 and 1 <= now["gpf"] <= 5
    assert before["svgd"] == 1000 and 1 <= now["svgd"] < 100
    assert before["nvgd"] > 20 and now["nvgd"] == 1
    n = costs.largest(SETTINGS, SETTINGS.max_particles, lambda k: costs.creation_cost(m, get_updater("nvgd"), prior, k))
    assert 256 <= n < 1000
    heavy = get_updater("nvgd", max_iters=60, inner_steps=20)
    assert costs.largest(SETTINGS, SETTINGS.max_particles, lambda k: costs.creation_cost(m, heavy, prior, k)) == 0


def test_estimates_grow_as_the_methods_do():
    m = lds(8)
    smc, svgd, kalman = (get_updater(name) for name in ("smc", "svgd", "kalman"))
    # smc is linear in N, svgd quadratic (its kernel), kalman's algebra does not grow with N beyond its draws
    assert smc.step_work(m, 2000).flops / smc.step_work(m, 1000).flops == pytest.approx(2.0, rel=0.05)
    assert svgd.step_work(m, 2000).flops / svgd.step_work(m, 1000).flops == pytest.approx(4.0, rel=0.1)
    assert svgd.step_work(m, 4096).bytes >= 8 * 4096**2  # two float32 n × n buffers
    big = lds(256)
    assert kalman.step_work(big, 16).flops >= 30 * 256**3
    # lorenz96's work grows with its sub-steps: 99 more RK4 steps of every particle, and their launches
    l96 = make_model("lorenz96", {}, 40)
    extra = smc.step_work(l96, 100, dt=100.0).flops - smc.step_work(l96, 100).flops
    assert extra == pytest.approx(99 * (100 * l96.RK4_FLOPS_PER_VARIABLE * 40 + l96.substep_overhead_flops))


def test_smc_prices_sqmc_sorts_only_where_its_steps_run_them():
    """Sequential quasi-Monte Carlo's sorts (about 40 n log₂ n) are priced where the stream runs it — ``qmc`` on
    (``"auto"``) for a dynamic d = 1 family with Q > 0 — and not for ``qmc: false``, whose steps are the bootstrap
    filter's."""
    n = 4096
    on, off = get_updater("smc"), get_updater("smc", qmc=False)
    sv = make_model("stochastic_volatility", {}, 1)
    assert on.uses_qmc(sv) and not off.uses_qmc(sv)
    assert off.step_work(sv, n).flops < on.step_work(sv, n).flops
    assert on.step_work(sv, n).flops - off.step_work(sv, n).flops == pytest.approx(40.0 * n * 12)


def test_smc_prices_smoothing_by_the_walk_its_read_runs():
    """``smc``'s ``/smoothed`` (docs/API.md "Limits"): a static family's read walks the genealogy (N links a step,
    ``GENEALOGY_FLOPS`` each) and is priced far below a dynamic family's at the same N and L — FFBSm's N² kernel
    terms up to N = 512, backward simulation's worst case above; and backward simulation's price at N = 513 is
    within the range its worst case's time takes against FFBSm's at 512 (measured at L = 100 in five runs of
    ``benchmarks/smoothing_price.py`` on 2026-11-28: 1.35 to 2.75 times, FFBSm 0.26 to 0.43 s CPU)."""
    smc = get_updater("smc")
    static, dynamic = make_model("linear_gaussian", {}, 2), lds(2)
    for n in (256, 512, 513, 4096):
        assert costs.smoothing_cost(static, smc, n, 100).flops * 10 < costs.smoothing_cost(dynamic, smc, n, 100).flops
    ffbsm, ffbsi = (costs.smoothing_cost(dynamic, smc, n, 100).flops for n in (512, 513))
    assert 1.35 < ffbsi / ffbsm < 2.75


def test_forecast_memory_grows_with_steps_and_is_small_for_kalman():
    m = lds(64)
    smc, kalman = get_updater("smc"), get_updater("kalman")
    ten = costs.forecast_cost(m, smc, 65536, 10, 1.0, 0)
    assert ten.bytes > 10 * costs.forecast_cost(m, smc, 65536, 1, 1.0, 0).bytes / 2
    assert ten.bytes > 2e9  # what the issue measured: +2.25 GB
    assert costs.forecast_cost(m, kalman, 65536, 10, 1.0, 0).bytes < 0.01 * ten.bytes


def test_share_and_heavy():
    light = costs.Cost(SETTINGS.max_request_flops * 0.01, 1e6)
    full = costs.Cost(SETTINGS.max_request_flops, SETTINGS.max_request_bytes * 0.5)
    assert costs.share(SETTINGS, full) == 1.0 and costs.heavy(SETTINGS, full)
    assert not costs.heavy(SETTINGS, light)
    assert costs.Cost(1, 5).then(costs.Cost(2, 3)) == costs.Cost(3, 5)


# ----------------------------------------------------------------- refusals


def test_a_batch_shares_one_budget():
    budget = costs.Budget(SETTINGS)
    first, second = object(), object()
    most = costs.Cost(0.6 * SETTINGS.max_request_flops, 0.0)
    budget.spend(first, most)
    budget.spend(first, most)  # a retried check of the same update replaces its share
    with pytest.raises(ApiError) as err:
        budget.spend(second, most)
    assert err.value.status == 413 and err.value.message.startswith("updates: ")
    budget.spend(second, costs.Cost(0.3 * SETTINGS.max_request_flops, 0.0))


def test_check_answers_the_largest_value_that_fits():
    m, smc, prior = lds(128), get_updater("smc"), gaussian(128)
    cost = costs.check(SETTINGS, "num_particles", 1024, lambda n: costs.creation_cost(m, smc, prior, n), "creating")
    assert costs.share(SETTINGS, cost) <= 1.0
    with pytest.raises(ApiError) as err:
        costs.check(SETTINGS, "num_particles", 65536, lambda n: costs.creation_cost(m, smc, prior, n), "creating")
    assert err.value.status == 413 and err.value.code == "limit_exceeded"
    message = err.value.message
    assert message.startswith("num_particles: creating needs about ") and "MPFLOW_MAX_REQUEST_BYTES" in message
    fits = int(message.rsplit("at most ", 1)[1].split(" ")[0])
    assert costs.share(SETTINGS, costs.creation_cost(m, smc, prior, fits)) <= 1.0
    assert costs.share(SETTINGS, costs.creation_cost(m, smc, prior, fits + 1)) > 1.0


def test_check_says_when_even_one_is_over():
    with pytest.raises(ApiError, match="even 1 is over the budget"):
        costs.check(SETTINGS, "steps", 3, lambda k: costs.Cost(SETTINGS.max_request_flops * 2, 0.0), "x")


# ----------------------------------------------------------------- O(d²) per component, not per draw


def _gathered_draws(prior: GaussianMixture, n: int, gens) -> torch.Tensor:
    """The draws as they were computed before: a Cholesky factor gathered per draw ([B, n, d, d])."""
    B, K, d = prior.means.shape
    u = rand(gens, [n], prior.means.dtype)
    k = torch.searchsorted(torch.cumsum(prior.weights, -1), u.contiguous()).clamp_max(K - 1)
    xi = randn(gens, [n, d], prior.means.dtype)
    chol, bidx = prior._chol(), torch.arange(B)[:, None]
    return prior.means[bidx, k] + (chol[bidx, k] @ xi[..., None]).squeeze(-1)


@pytest.mark.parametrize("components", [1, 3])
def test_mixture_draws_are_the_same_with_one_factor_per_component(components):
    g = torch.Generator().manual_seed(0)
    d = 5
    A = torch.randn(2, components, d, d, generator=g, dtype=torch.float64)
    covs = A @ A.transpose(-1, -2) + torch.eye(d, dtype=torch.float64)
    weights = torch.softmax(torch.randn(2, components, generator=g, dtype=torch.float64), -1)
    prior = GaussianMixture(weights, torch.randn(2, components, d, generator=g, dtype=torch.float64), covs)
    got = prior.sample(300, StreamRNG.from_seeds([1, 2]))
    want = _gathered_draws(prior, 300, StreamRNG.from_seeds([1, 2]))
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------- prices measured by benchmarks/price_audit.py


def test_a_summary_prices_its_quantiles_sort_as_measured():
    """A summary of d = 64, N = 16384 took 2.7 times its ``smc`` step's time (its quantiles' sort along a strided
    dimension); priced at 20 flops a number per log₂ N it cost less than the step."""
    summary = costs.summary_cost(16384, 64).flops
    step = get_updater("smc").step_work(lds(64), 16384).flops
    assert summary > 1.5 * step
    assert summary >= base.QUANTILE_FLOPS * 16384 * 64 * 14


def test_particle_steps_price_their_memory_bound_share():
    """At d = 1 a particle step counts a few hundred flops a particle and takes about 4000 flops' worth."""
    n, model = 65536, lds(1)
    for method in ("smc", "mpf", "enkf"):
        assert get_updater(method).step_work(model, n).flops >= n * base.PARTICLE_STEP_FLOPS, method
    assert get_updater("enkf").pit_work(model, n).flops >= n * base.PARTICLE_STEP_FLOPS  # its second predict
    assert base.PARTICLE_STEP_FLOPS >= 3500


def test_p_values_price_each_entrys_cdf():
    l96, n = make_model("lorenz96", {}, 40), 65536
    k = l96.observation_size()
    assert get_updater("enkf").pit_work(l96, n).flops >= n * k * base.CDF_FLOPS
    ukf = get_updater("ukf")
    assert ukf.pit_work(l96, n).flops >= ukf.step_work(l96, n).flops + n * k * base.CDF_FLOPS
    kalman = get_updater("kalman")  # a linear-Gaussian family's p-values are closed-form: no CDF per particle
    assert kalman.pit_work(lds(4), n).flops == kalman.step_work(lds(4), n).flops


def test_an_smc2_forecast_is_priced_as_a_particle_filters():
    """Its (θ, x) pairs move as one model of a row per pair, the noise of all drawn in one call, and each draws its
    observation under its own θ: a particle filter's forecast's price covers it (47 horizons at N = 65536 took 0.93
    to 0.95 s of CPU, priced 0.99 s at 25 Gflop/s; benchmarks/price_audit.py). Moved one pair at a time they took
    18 s for 63 horizons, and were priced 120000 flops a pair and horizon: the budget took 2."""
    learned = {"A": [[0.9]], "B": [[1.0]], "R": {"prior": {"type": "lognormal", "mean": 0.0, "sd": 1.0}}}
    model, n = make_model("lds", learned, 1), 65536
    assert get_updater("smc2").forecast_work(model, n, 4) == get_updater("smc").forecast_work(model, n, 4)
    steps = costs.largest(SETTINGS, 1000, lambda k: costs.forecast_cost(model, get_updater("smc2"), n, k, 1.0, 0))
    assert 40 <= steps <= 63


def test_mixture_evidence_and_marginal_price_their_pairs_as_measured():
    """The mixture evidence's M × K transition densities are the smoothers' kernel terms (they were priced 2 d + 20,
    an eighth of their time); the marginal filter's float32 pairs are :data:`marginal.PAIR_FLOPS` each."""
    for n in (1024, 65536):  # M, K ≤ 1024
        flops, _ = mixture_evidence.work(lds(8), n)
        assert flops >= 1024 * 1024 * backward_simulation.KERNEL_TERM_FLOPS
    flops, peak = marginal.work(1, 4096)
    assert flops >= 2 * 4096**2 * marginal.PAIR_FLOPS
    assert marginal.PAIR_FLOPS >= 90
    # its peak bytes: one step at N = 6000 grew the process by 549 MB (issue 54: priced 275 MiB, it ran over budget)
    assert marginal.work(1, 6000)[1] >= 549e6 and peak == marginal.PAIR_COPIES * 4 * 4096**2


def test_the_marginal_filters_largest_stream_fits_the_memory_budget():
    """The largest N the defaults accept for ``mpf`` on ``stochastic_volatility`` d = 1 (its marginal filter, N²
    pairs): a one-step update's priced bytes within ``MPFLOW_MAX_REQUEST_BYTES``, N = 6000 refused."""
    model, updater = make_model("stochastic_volatility", {}, 1), get_updater("mpf")
    n = costs.largest(SETTINGS, 6000, lambda m: costs.observations_cost(model, updater, m, [(1.0, None)], 0))
    assert 4000 <= n < 6000


def test_the_quantile_levels_and_covariances_a_request_asks_for_are_priced():
    """Issue 58: a request's own ``levels`` cost a second quantile pass per step and their numbers in the answer, and
    ``per_step_cov`` a d × d covariance per entry; the defaults cost what they did."""
    m, updater, steps = lds(2), get_updater("smc"), [(1.0, None)] * 10
    plain = costs.observations_cost(m, updater, 256, steps, 0)
    assert costs.observations_cost(m, updater, 256, steps, 0, 0, None, False) == plain
    nine = costs.observations_cost(m, updater, 256, steps, 0, 0, 9)
    cov = costs.observations_cost(m, updater, 256, steps, 0, 0, None, True)
    assert nine.flops > plain.flops and nine.bytes > plain.bytes
    assert cov.flops > plain.flops and cov.bytes > plain.bytes
    assert costs.summary_cost(256, 2, 9).bytes > costs.summary_cost(256, 2).bytes > costs.summary_cost(256, 2, 1).bytes
