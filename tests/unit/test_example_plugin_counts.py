"""The example plugin family refuses what is not a count (issue 38): 2.5 or −1 is a ValueError naming the entry,
which the service answers with 422 (``tests/e2e/test_family_plugin.py`` checks that against a real server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "plugin_family"))
from mpflow_example_family import PoissonCounts


@pytest.mark.parametrize(("value", "message"), [([3, 2.5], r"\[1\]: .* got 2.5"), ([-1, 0], r"\[0\]: .* got -1")])
def test_a_count_is_a_whole_number_not_below_zero(value, message):
    model = PoissonCounts.from_params({}, 2)
    assert model.parse_observation([3, 0]).tolist() == [3.0, 0.0]
    with pytest.raises(ValueError, match=r"observations\[0\]" + message):
        model.parse_observation(value, "observations[0]")
