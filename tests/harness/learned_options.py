"""Checks shared by the tests of ``ienkf``'s learned options (``correction``, ``relock``): each takes the registered
name of a Lorenz-96 ring network, never a path, and serves ``lorenz96`` with a linear observation only."""

from __future__ import annotations

import pytest
from mpflow.operators.models import make_model
from mpflow.operators.updaters import get_updater


def refuses_what_it_cannot_serve(option: str, name: str, bad_names: list) -> None:
    """``ienkf`` with ``option`` refuses each of ``bad_names`` and, with the good ``name``, an ``arctan`` Lorenz-96
    and another family — every refusal naming ``options.<option>``."""
    for bad in bad_names:
        with pytest.raises(ValueError, match=rf"options\.{option}"):
            get_updater("ienkf", **{option: bad})
    u = get_updater("ienkf", **{option: name})
    for model in (make_model("lorenz96", {"arctan": True}, 12), make_model("linear_gaussian", {}, 2)):
        with pytest.raises(ValueError, match=rf"options\.{option}"):
            u.check_compatible(model)
