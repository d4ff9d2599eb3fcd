"""A family's declarative spec (mpflow.operators.models.spec): the one table of its parameters and catalogue text,
with each parser's kind set by the ``kind`` mark; and the one home of trained-operator lookup's folders."""

from __future__ import annotations

import pytest
import torch
from mpflow.operators import registry
from mpflow.operators.models import FAMILIES, make_model
from mpflow.operators.models.lorenz96 import Lorenz96
from mpflow.operators.models.spec import FamilySpec, Param, catalogue_entry, kind, learnable, read_params
from mpflow.operators.trained_operators import operator_dirs


def test_a_spec_reads_tuples_as_params_and_names_them():
    spec = FamilySpec(description="d", observation="o", params=(("a", lambda *_: torch.zeros(()), None),))
    assert spec.params[0] == Param("a", spec.params[0].parse) and spec.names == ["a"]
    assert spec.param("a").required and spec.param("a").kind == "value"  # unmarked parser: "value"


def test_the_kind_mark_says_what_a_parser_accepts_and_whether_it_may_be_a_prior():
    @kind("a widget", (0.0, 1.0))
    def parse_widget(name, value, d, dtype):
        return torch.tensor(float(value), dtype=dtype)

    assert parse_widget.kind == "a widget" and parse_widget.learnable and parse_widget.domain == (0.0, 1.0)
    # lorenz96's parsers carry their kinds by the mark (they were set by hand)
    kinds = {p.name: p.kind for p in Lorenz96.spec.params}
    assert kinds["F"] == "number" and kinds["Q"] == "non-negative number"
    assert kinds["obs_every"] == "positive integer ≤ d" and kinds["arctan"] == "true or false (1 or 0)"
    assert learnable(Lorenz96, "F") and learnable(Lorenz96, "Q") and not learnable(Lorenz96, "obs_every")
    assert not learnable(Lorenz96, "delta")  # a sub-step parameter is never a prior


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_catalogue_entry_is_the_spec(name):
    cls = FAMILIES[name]
    entry = catalogue_entry(cls, 16)
    assert entry["description"] == cls.spec.description and entry["observation"] == cls.spec.observation
    assert [p["name"] for p in entry["parameters"]] == cls.spec.names
    assert [p["required"] for p in entry["parameters"]] == [p.default is None for p in cls.spec.params]


def test_read_params_names_the_field_it_refuses():
    with pytest.raises(ValueError, match=r"model\.params: unknown parameter\(s\) \['nope'\]"):
        read_params(FAMILIES["linear_gaussian"], {"nope": 1}, 2, torch.float32)
    with pytest.raises(ValueError, match=r"model\.params\.B: required for the lds family"):
        read_params(FAMILIES["lds"], {"A": [[1.0]]}, 1, torch.float32)
    assert make_model("linear_gaussian", {"R": [[2.0, 0.0], [0.0, 2.0]]}, 2).params["R"][0, 0, 0] == 2.0


def test_operator_dirs_lists_each_root_once_in_order(tmp_path):
    defaults = registry.default_dirs()
    assert operator_dirs() == defaults
    assert operator_dirs([str(tmp_path), str(defaults[0]), str(tmp_path)]) == [*defaults, tmp_path]
