"""Exact references in float64: the conjugate Gaussian posterior and the Kalman filter."""

from mpflow.operators.references.conjugate import conjugate_update
from mpflow.operators.references.exact_kalman import kalman_filter, kalman_predict

__all__ = ["conjugate_update", "kalman_filter", "kalman_predict"]
