"""The checks of an imported snapshot (:mod:`mpflow.service.streams.snapshot_checks`), one by one, and the property the
"no unknown tensor" check relies on: a method's state never gains a tensor after step 0, so the step-0
*reference* state lists every tensor a genuine snapshot of that method can hold."""

from __future__ import annotations

import math

import pytest
import torch
from mpflow.operators.models import make_model
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import UPDATERS, get_updater
from mpflow.service.engine.catalogue import OperatorCatalogue
from mpflow.service.engine.methods import Methods
from mpflow.service.errors import ApiError
from mpflow.service.settings import Settings
from mpflow.service.streams import snapshot_checks as checks

PRIORS = {
    "gaussian": {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]},
    "mixture": {"type": "mixture", "weights": [0.5, 0.5], "means": [[0, 0], [1, 1]], "covs": [[[1, 0], [0, 1]]] * 2},
    "particles": {"type": "particles", "particles": [[float(i), float(i % 3)] for i in range(16)]},
}
DESCRIPTION = {
    "model": {"family": "linear_gaussian", "params": {}},
    "prior": PRIORS["gaussian"],
    "method": "smc",
    "operator": None,
    "operator_content_hash": None,
    "method_options": {},
    "method_reason": None,
    "operator_domain": None,
    "num_particles": 16,
    "state_dim": 2,
    "seed": 1,
    "ttl_seconds": 60,
    "step": 0,
    "log_evidence": 0.0,
    "state_names": None,
}


def _refusal(check, *args) -> str:
    with pytest.raises(ApiError) as refused:
        check(*args)
    return refused.value.message


@pytest.mark.parametrize("method", sorted(UPDATERS))
@pytest.mark.parametrize("prior_name", sorted(PRIORS))
def test_a_state_never_gains_a_tensor_after_step_0(method, prior_name):
    model = make_model("linear_gaussian", {}, 2)
    prior = prior_from_spec(PRIORS[prior_name], 2)
    updater = get_updater(method)
    try:
        updater.check_compatible(model, prior)
    except ValueError:
        pytest.skip(f"{method} does not run a {prior_name} prior")
    state = updater.init(prior, model, 16, 1)
    reference = {k: (v.dtype, v.shape) for k, v in state.fields().items()}
    for obs in (torch.tensor([[0.3, -0.2]]), model.missing_observation()[None], torch.tensor([[5.0, 1.0]])):
        state = updater.update(state, obs, model)
        state = state[0] if isinstance(state, tuple) else state
        for name, t in state.fields().items():
            assert reference.get(name) == (t.dtype, t.shape), (method, prior_name, name)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"step": 2**63 - 1}, "stream.step"),
        ({"step": -1}, "stream.step"),
        ({"step": 2**53}, "stream.step"),
        ({"seed": 2**63}, "stream.seed"),
        ({"ttl_seconds": True}, "stream.ttl_seconds"),
        ({"num_particles": 1.5}, "stream.num_particles"),
        ({"log_evidence": math.inf}, "stream.log_evidence"),
        ({"log_evidence": "0"}, "stream.log_evidence"),
        ({"state_names": ["x"]}, "stream.state_names"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_field(changes, field):
    settings = Settings(redis_url="redis://unused")
    checks.check_numbers(settings, DESCRIPTION)  # the genuine description passes
    assert _refusal(checks.check_numbers, settings, {**DESCRIPTION, **changes}).startswith(f"snapshot: {field}:")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"method": "nope"}, "stream.method"),
        ({"method_options": []}, "stream.method_options"),
        ({"method_reason": "x" * (checks.MAX_METHOD_REASON_LENGTH + 1)}, "stream.method_reason"),
        ({"method_reason": {"why": "x"}}, "stream.method_reason"),
        ({"operator_content_hash": "0" * 64}, "stream.operator_content_hash"),
        ({"operator_domain": {"inside": True, "outside": []}}, "stream.operator_content_hash"),
        ({"method": "mpf", "operator": "/etc", "operator_content_hash": "0" * 64}, "stream.operator"),
        ({"method": "smc", "operator": "lds-d2-v1", "operator_content_hash": "0" * 64}, "stream.operator"),
        ({"method": "mpf", "operator": "lds-d2-v1", "operator_content_hash": "x"}, "stream.operator_content_hash"),
    ],
)
def test_method_fields_out_of_shape_are_refused_naming_the_field(changes, field):
    checks.check_method(DESCRIPTION)
    assert _refusal(checks.check_method, {**DESCRIPTION, **changes}).startswith(f"snapshot: {field}:")


@pytest.mark.parametrize(
    "domain",
    [
        None,
        {"inside": True},
        {"inside": True, "outside": ["a"]},
        {"inside": False, "outside": []},
        {"inside": 1, "outside": []},
        {"inside": False, "outside": ["x" * (checks.MAX_DOMAIN_PHRASE_LENGTH + 1)]},
        {"inside": False, "outside": ["a"] * (checks.MAX_DOMAIN_PHRASES + 1)},
        {"inside": True, "outside": [], "extra": 1},
    ],
)
def test_an_operator_domain_of_another_shape_is_refused(domain):
    checks.check_domain({"inside": False, "outside": ["prior scale 9 outside the trained [0.1, 4]"]})
    checks.check_domain({"inside": True, "outside": []})
    assert _refusal(checks.check_domain, domain).startswith("snapshot: stream.operator_domain:")


PIT = {"step": 5, "pit_alert": 0.05, "pit": [0.31, None], "pit_step": 4}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"pit_alert": 1.0}, "stream.pit_alert"),
        ({"pit_alert": 0}, "stream.pit_alert"),
        ({"pit_alert": True}, "stream.pit_alert"),
        ({"pit_step": None}, "stream.pit_step"),
        ({"pit_step": 6}, "stream.pit_step"),
        ({"pit_step": 0}, "stream.pit_step"),
        ({"pit": None}, "stream.pit"),
        ({"pit": [0.5]}, "stream.pit"),
        ({"pit": [0.5, 0.5, 0.5]}, "stream.pit"),
        ({"pit": [0.5, 1.01]}, "stream.pit"),
        ({"pit": [-1e-9, 0.5]}, "stream.pit"),
        ({"pit": [0.5, "0.5"]}, "stream.pit"),
        ({"pit": {"0": 0.5, "1": 0.5}}, "stream.pit"),
    ],
)
def test_predictive_p_values_out_of_shape_are_refused_naming_the_field(changes, field):
    """A stream's ``pit_alert`` in (0, 1), and its latest p-values: both null, or one probability (or null) per entry
    of the family's observation at a step from 1 to the stream's."""
    model = make_model("linear_gaussian", {}, 2)
    for genuine in ({**PIT, "pit": [0.0, 1.0]}, {**PIT, "pit": None, "pit_step": None, "pit_alert": None}):
        checks.check_pit({**DESCRIPTION, **genuine}, model)
    logistic = make_model("logistic", {}, 2)  # M labels a step, as many p-values
    checks.check_pit({**DESCRIPTION, **PIT, "pit": [0.2] * 7}, logistic)
    assert _refusal(checks.check_pit, {**DESCRIPTION, **PIT, "pit": []}, logistic).startswith("snapshot: stream.pit:")
    message = _refusal(checks.check_pit, {**DESCRIPTION, **PIT, **changes}, model)
    assert message.startswith(f"snapshot: {field}:"), message


def _state():
    model = make_model("linear_gaussian", {}, 2)
    return get_updater("gpf").init(prior_from_spec(PRIORS["gaussian"], 2), model, 16, 1)


@pytest.mark.parametrize(
    ("method", "options"), [("gpf", {}), ("kalman", {}), ("smc", {}), ("ukf", {}), ("mpf", {"track_density": True})]
)
@pytest.mark.parametrize("n", [5, 11, 200])
def test_small_references_predict_the_full_size_state(method, options, n):
    """:func:`reference_fields` from states of a few particles gives each tensor's shape at any N (d = 3: the
    per-particle dimensions found by comparing two small sizes), tracking the density a method keeps too."""
    d = 3
    model = make_model("linear_gaussian", {}, d)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0] * d, "cov": torch.eye(d).tolist()}, d)
    updater = get_updater(method, **options)
    full = updater.init(prior, model, n, 1)
    assert ("log_density" in full.fields()) == bool(options)
    expected = checks.reference_fields(lambda m: updater.init(prior, model, m, 0), n, d)
    assert expected == {k: (t.dtype, tuple(t.shape)) for k, t in full.fields().items()}


def test_the_state_must_have_the_reference_tensors_only_and_normalised_weights():
    reference = _state()
    expected = {k: (t.dtype, tuple(t.shape)) for k, t in reference.fields().items()}
    stream = {**DESCRIPTION, "method": "gpf"}
    checks.check_core(stream, reference)
    checks.check_fields(reference, expected)
    junk = reference.replace(extras={**reference.extras, "junk": torch.zeros(1, 4)})
    assert _refusal(checks.check_fields, junk, expected).startswith("snapshot: state.extras.junk: not a tensor")
    wide = reference.replace(extras={**reference.extras, "prior_means": torch.zeros(1, 1, 3)})
    assert _refusal(checks.check_fields, wide, expected).startswith("snapshot: state.extras.prior_means:")
    heavy = reference.replace(log_weights=reference.log_weights + 1.0)
    assert _refusal(checks.check_core, stream, heavy).startswith("snapshot: state.log_weights:")
    mixed = reference.replace(extras={**reference.extras, "prior_weights": torch.tensor([[2.0]])})
    assert _refusal(checks.check_core, stream, mixed).startswith("snapshot: state.extras.prior_weights:")
    later = reference.replace(step=torch.tensor([3]))
    assert _refusal(checks.check_core, stream, later).startswith("snapshot: state.step:")
    doubles = reference.replace(particles=reference.particles.double())
    assert _refusal(checks.check_core, stream, doubles).startswith("snapshot: state.particles:")


def test_model_and_prior_follow_the_creation_schema():
    methods = Methods(Settings(redis_url="redis://unused"), OperatorCatalogue([]))
    model, prior = checks.model_and_prior(methods, DESCRIPTION)
    assert model.state_dim == 2 and prior is not None
    kept = {"type": "particles", "num_particles": 16, "state_dim": 2}
    assert checks.model_and_prior(methods, {**DESCRIPTION, "prior": kept})[1] is None
    cases = [
        ({"model": {"family": "linear_gaussian", "params": {}, "junk": "x" * 100}}, "stream.model"),
        ({"model": {"family": "nope"}}, "stream.model"),
        ({"prior": {**kept, "num_particles": 17}}, "stream.prior"),
        ({"prior": {**kept, "junk": 1}}, "stream.prior"),
        ({"prior": {**PRIORS["gaussian"], "cov": [[1.0, 2.0], [2.0, 1.0]]}}, "stream.prior.cov"),
        ({"prior": {**PRIORS["gaussian"], "mean": [0.0, 3e39]}}, "stream.prior"),
        ({"prior": {"type": "sampler", "name": "/etc"}}, "stream.prior.name"),
        ({"prior": "x" * 1000}, "stream.prior"),
    ]
    for changes, field in cases:
        message = _refusal(checks.model_and_prior, methods, {**DESCRIPTION, **changes})
        assert message.startswith(f"snapshot: {field}"), (changes, message)
        assert len(message) < 600  # names the field; does not echo a large value
