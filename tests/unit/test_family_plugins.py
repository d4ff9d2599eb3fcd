"""Model families as entry-point plugins (``mpflow.families``): the built-ins register that way, a plugin package is
admitted after its check, and a broken one is left out with a message naming it and what is wrong.

The plugin packages here are a module and a ``*.dist-info`` folder on a temporary path entry — what an installed
distribution is to :func:`importlib.metadata.entry_points` — so no install is needed.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch
from mpflow.operators.models import FAMILIES, FAMILY_ERRORS, family
from mpflow.operators.models.plugins import (
    CATALOGUE_ORDER,
    FAMILY_LOSSES,
    GROUP,
    FamilyWarning,
    builtin_entry_points,
    family_losses,
    family_problem,
    load_families,
)
from mpflow.operators.models.priors import prior_from_spec
from mpflow.operators.updaters import UPDATERS

from tests.unit.test_updaters_common import make_updater

ROOT = Path(__file__).resolve().parents[2]

PLUGINS = """
import torch
from mpflow.operators.models.base import ModelFamily


class Counts(ModelFamily):
    name = "counts"

    @property
    def obs_shape(self):
        return (self.state_dim,)

    def log_likelihood(self, obs, x):
        return -((obs[:, None] - x) ** 2).sum(-1)

    def sample_observation(self, x, gens):
        return x.clone()


class WrongScore(Counts):
    name = "wrong_score"

    def score(self, obs, x):
        return x[..., 0]


class NoLikelihood(ModelFamily):
    name = "no_likelihood"

    @property
    def obs_shape(self):
        return (1,)

    def sample_observation(self, x, gens):
        return x[:, :1]


class Misnamed(Counts):
    name = "something_else"


class Stealer(Counts):
    name = "lds"


class Dynamic(Counts):
    name = "no_transition"
    dynamic = True


NOT_A_CLASS = 3
"""

ENTRY_POINTS = {
    "counts": "fake_plugins:Counts",
    "wrong_score": "fake_plugins:WrongScore",
    "no_likelihood": "fake_plugins:NoLikelihood",
    "misnamed": "fake_plugins:Misnamed",
    "lds": "fake_plugins:Stealer",
    "no_transition": "fake_plugins:Dynamic",
    "not_a_class": "fake_plugins:NOT_A_CLASS",
    "unimportable": "fake_plugins_missing_module:Thing",
}


def install_fake(root: Path) -> None:
    """The module and the dist-info of a distribution ``fake-plugins`` under ``root``."""
    (root / "fake_plugins.py").write_text(PLUGINS)
    info = root / "fake_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in ENTRY_POINTS.items()))


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    install_fake(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_plugins", None)


def test_the_builtins_are_the_packages_own_entry_points_in_catalogue_order():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    assert set(CATALOGUE_ORDER) == set(declared)  # the order names every built-in, and only those
    assert list(FAMILIES)[: len(declared)] == list(CATALOGUE_ORDER)
    assert all(FAMILIES[name].__module__ == value.split(":")[0] for name, value in declared.items())
    assert not {k: v for k, v in FAMILY_ERRORS.items() if k in declared}
    for name, cls in FAMILIES.items():
        assert family_problem(name, cls) is None


def test_without_the_packages_metadata_the_builtins_come_from_pyproject():
    """A source tree without an install: the built-ins are read from pyproject.toml, in catalogue order."""
    eps = builtin_entry_points([])
    assert [ep.name for ep in eps] == list(CATALOGUE_ORDER) and all(ep.dist is None for ep in eps)


def test_a_good_plugin_is_admitted_and_broken_ones_are_named_with_what_is_wrong(fake_plugins):
    families, problems = load_families()
    assert list(families)[: len(CATALOGUE_ORDER)] == list(CATALOGUE_ORDER)
    assert "counts" in families and families["counts"].__name__ == "Counts"
    assert families["lds"].__module__ == "mpflow.operators.models.lds"  # a built-in cannot be replaced
    expected = {
        "wrong_score": "score gives [1, 5], expected a tensor of shape [1, 5, 2]",
        "no_likelihood": "does not implement log_likelihood",
        "misnamed": "the class's name is 'something_else', not the entry point's name 'misnamed'",
        "lds": "a family named 'lds' is already loaded",
        "no_transition": "does not implement transition_affine (or transition)",
        "not_a_class": "is not a subclass of mpflow.operators.models.base.ModelFamily",
        "unimportable": "cannot be imported (ModuleNotFoundError",
    }
    assert set(problems) == set(expected)
    for name, what in expected.items():
        assert problems[name].startswith(f"model family plugin {name!r} (")
        assert "from fake-plugins 0.1" in problems[name]
        assert what in problems[name], problems[name]
    assert not set(expected) - {"lds"} & set(families)


def test_a_plugin_without_p_values_or_observation_forecasts_is_told_at_registration(fake_plugins):
    """Issue 58, item 6: ``observation_cdf`` and ``observation_draws`` are optional, and a family without them loses
    predictive p-values and observation forecasts: the plugin admitted without them gets a FamilyWarning naming it,
    each missing method and what it loses; one with both gets none, and so do the built-ins."""
    with pytest.warns(FamilyWarning) as caught:
        families, _ = load_families()
    told = [str(w.message) for w in caught if issubclass(w.category, FamilyWarning)]
    assert "counts" in families  # admitted all the same
    about = [m for m in told if m.startswith("model family plugin 'counts' (")]
    assert len(about) == 1 and about[0] == FAMILY_LOSSES["counts"]
    for what in ("observation_cdf", "no predictive p-values", "pit", "observation_draws", "no observation forecasts"):
        assert what in about[0], about[0]

    class Complete(families["counts"]):  # both optional methods: p-values and observation forecasts
        def observation_cdf(self, obs, x, gens):
            return torch.special.ndtr((obs[:, None] - x).double())

        def observation_draws(self, x, gen):
            return x + torch.randn(x.shape, generator=gen, dtype=x.dtype)

    class Raising(families["counts"]):  # an optional method that fails is as good as missing
        def observation_cdf(self, obs, x, gens):
            raise RuntimeError("boom")

    assert family_losses(Complete) == []
    raising = family_losses(Raising)
    assert raising[0].startswith("observation_cdf — no predictive p-values") and "RuntimeError: boom" in raising[0]
    assert not any(m.startswith(f"model family plugin {n!r}") for m in told for n in CATALOGUE_ORDER)
    assert [m.split(" — ")[0] for m in family_losses(FAMILIES["logistic"])] == ["observation_draws"]  # by design
    assert all(family_losses(FAMILIES[n]) == [] for n in ("lds", "gmm", "stochastic_volatility", "lorenz96"))


def test_an_unknown_family_names_the_plugin_left_out(monkeypatch):
    monkeypatch.setitem(FAMILY_ERRORS, "mine", "model family plugin 'mine' (pkg:Mine): does not implement obs_shape")
    with pytest.raises(ValueError, match=r"^model.family: unknown family 'mine'.*does not implement obs_shape"):
        family("mine")


def test_every_method_that_admits_a_plugin_family_runs_it(fake_plugins):
    """The admitted plugin ``counts`` (static, Gaussian-shaped likelihood, autograd score) through every method whose
    refusal lets it in — all but those needing a linear-Gaussian or explicit-h family."""
    cls = load_families()[0]["counts"]
    model = cls.from_params({}, 2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0.0, 0.5], "cov": [[1.0, 0.2], [0.2, 1.0]]}, 2)
    ran = []
    for name, updater_cls in sorted(UPDATERS.items()):
        if updater_cls.refusal(cls) is not None:
            continue
        u = make_updater(name)
        state = u.init(prior, model, 32, seed=0)
        for o in ([[0.3, -0.2]], [[0.5, 0.1]]):
            state, info = u.update(state, torch.tensor(o), model)
        assert int(state.step[0]) == 2 and torch.isfinite(state.particles).all(), name
        ran.append(name)
    assert {"smc", "gpf", "svgd", "nvgd", "mpf"} <= set(ran)
