"""Updaters by name: the registry the service and benchmarks use (cf. torchdiffeq's ``SOLVERS``).

A new method is one module here plus one line in ``UPDATERS``. ``mpf`` takes a trained operator
(``get_updater("mpf", operator="lds-d2-v1")``, see :func:`mpflow.operators.trained_operators.find_operator`);
without one it is the exact Daum–Huang filter (the operator's untrained base flow). ``enkf`` and ``ukf`` are the
ensemble and unscented Kalman filters, the baselines of families with an explicit observation function and additive
Gaussian noise (``ModelFamily.gaussian_observation``); ``smc``, ``enkf`` and ``ukf`` also run nonlinear transitions
(``Updater.nonlinear_transition``). What each method can do (weighted cloud, exact, forecasts, controls, ...) is
declared on its class and published from there (:data:`CAPABILITIES`, :meth:`Updater.capabilities_with`).
``smc2`` learns unknown static model parameters with the state (a model whose parameters are given as priors,
``Updater.unknown_params``).
"""

from __future__ import annotations

from typing import Any

from mpflow.operators.updaters.base import CAPABILITIES, NonFiniteError, Updater
from mpflow.operators.updaters.enkf import EnKFUpdater
from mpflow.operators.updaters.gpf import GPFUpdater
from mpflow.operators.updaters.ienkf import IEnKFUpdater
from mpflow.operators.updaters.kalman import KalmanUpdater
from mpflow.operators.updaters.mpf import MPFUpdater
from mpflow.operators.updaters.nvgd import NVGDUpdater
from mpflow.operators.updaters.smc import SMCUpdater
from mpflow.operators.updaters.smc2 import SMC2Updater
from mpflow.operators.updaters.svgd import SVGDUpdater
from mpflow.operators.updaters.ukf import UKFUpdater

UPDATERS: dict[str, type[Updater]] = {
    cls.name: cls
    for cls in (
        KalmanUpdater,
        SMCUpdater,
        GPFUpdater,
        SVGDUpdater,
        NVGDUpdater,
        MPFUpdater,
        EnKFUpdater,
        IEnKFUpdater,
        UKFUpdater,
        SMC2Updater,
    )
}


def get_updater(name: str, **options: Any) -> Updater:
    """An updater instance by method name (``options`` override its ``defaults``)."""
    try:
        cls = UPDATERS[name]
    except KeyError:
        raise ValueError(f"method: unknown method {name!r}; choose one of {sorted(UPDATERS)}") from None
    return cls(**options)


__all__ = ["CAPABILITIES", "UPDATERS", "NonFiniteError", "Updater", "get_updater"]
