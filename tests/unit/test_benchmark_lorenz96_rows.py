"""``python -m benchmarks.lorenz96 --methods`` picks rows by method, method:N or method:N:inflation."""

from __future__ import annotations

from benchmarks.lorenz96 import row_names


def test_rows_are_named_by_method_size_and_inflation() -> None:
    letkf = ("enkf", 40, {"inflation": 1.05, "localisation": 4}, 1.0, "")
    assert row_names(letkf) == {"enkf", "enkf:40", "enkf:40:1.05"}
    assert "ukf:40:1" in row_names(("ukf", 40, {}, None, ""))
    assert not {"enkf:40:1.1", "enkf:100"} & row_names(letkf)
