"""``linear_gaussian``: a static state x ∈ R^d seen through o ~ N(H x, R), H = I, R = 3I by default
(the MPF paper's Gaussian experiment, §5.1). The exact posterior is conjugate Gaussian
(:mod:`operators.references.conjugate`)."""

from __future__ import annotations

from operators.models.base import identity, parse_cov, parse_matrix
from operators.models.linear_observation import LinearObservationFamily


class LinearGaussian(LinearObservationFamily):
    name = "linear_gaussian"
    dynamic = False
    param_specs = (("H", parse_matrix, identity()), ("R", parse_cov, identity(3.0)))
