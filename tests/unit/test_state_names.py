"""``ModelFamily.state_names``: every family names its d dimensions (d distinct names) or leaves them unnamed
(``None``), and the families whose state has a meaning name it (the stream document's ``state_names``)."""

from __future__ import annotations

import pytest
from mpflow.operators.models import FAMILIES


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_names_each_dimension_once_or_none(family: str) -> None:
    cls = FAMILIES[family]
    d = cls.fixed_state_dim or max(3, cls.min_state_dim)
    names = cls.state_names(d)
    assert names is None or (len(names) == d and len(set(names)) == d and all(isinstance(n, str) and n for n in names))


def test_the_families_with_a_meaningful_state_name_it() -> None:
    assert FAMILIES["range_bearing"].state_names(4) == ["px", "py", "vx", "vy"]
    assert FAMILIES["stochastic_volatility"].state_names(3) == ["log-vol[0]", "log-vol[1]", "log-vol[2]"]
    assert FAMILIES["logistic"].state_names(2) == ["w[0]", "w[1]"]
    assert FAMILIES["lds"].state_names(4) is None  # any d-vector: constant velocity or not, lds cannot know
