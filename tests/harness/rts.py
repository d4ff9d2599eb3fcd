"""A plain-numpy Kalman filter and Rauch–Tung–Striebel smoother, written independently of
:mod:`mpflow.operators.smoothing`, and the data the smoothing tests and ``benchmarks/smoothing.py`` share.

The model: a 2-D rotation x_m = A x_{m−1} + N(0, Q) of which only x[0] is observed, noisily (o_m = x_m[0] +
N(0, R), R = 4): x[1] is learned from later steps, so the smoothed and the filtered estimates differ by up to
~0.9 sd on :func:`data` — a "smoother" answering the filter fails any comparison against :func:`numpy_rts`.
"""

from __future__ import annotations

import numpy as np

A = np.array([[0.9, 0.2], [-0.2, 0.9]])
H = np.array([[1.0, 0.0]])
Q = 0.5 * np.eye(2)
R = np.array([[4.0]])
PARAMS = {"A": A.tolist(), "B": H.tolist(), "Q": Q.tolist(), "R": R.tolist()}
PRIOR = {"type": "gaussian", "mean": [0.0, 0.0], "cov": [[1.0, 0.0], [0.0, 1.0]]}
LAG, T = 10, 30


def data(T: int = T, seed: int = 1) -> list[list[float] | None]:
    """A simulated trajectory's observations [[o_1], …, [o_T]] (module docstring)."""
    rng = np.random.default_rng(seed)
    x, ys = np.zeros(2), []
    for _ in range(T):
        x = A @ x + rng.multivariate_normal(np.zeros(2), Q)
        ys.append([float(x[0] + rng.normal() * np.sqrt(R[0, 0]))])
    return ys


def kalman_pass(ys: list[list[float] | None]) -> tuple[list, list, list, list]:
    """The Kalman filter from the prior N(0, I): (filtered means, covs, predicted means, covs), one per step. A None
    observation is a step without a measurement: the predict alone."""
    m, P = np.zeros(2), np.eye(2)
    ms, Ps, mps, Pps = [], [], [], []
    for y in ys:
        mp, Pp = A @ m, A @ P @ A.T + Q
        m, P = mp, Pp
        if y is not None:
            K = Pp @ H.T @ np.linalg.inv(H @ Pp @ H.T + R)
            m, P = mp + K @ (np.array(y) - H @ mp), (np.eye(2) - K @ H) @ Pp
        ms.append(m), Ps.append(P), mps.append(mp), Pps.append(Pp)
    return ms, Ps, mps, Pps


def numpy_rts(ys: list[list[float] | None], lag: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(filtered means [T, d], smoothed means [lag, d] and covs [lag, d, d]) of p(x_s | y_1..T), s = T−lag+1 … T:
    :func:`kalman_pass`, then the RTS backward pass over the last ``lag`` steps (Särkkä 2013, Thm 8.2)."""
    ms, Ps, mps, Pps = kalman_pass(ys)
    sm, sP = [ms[-1]], [Ps[-1]]
    for s in range(len(ys) - 2, len(ys) - lag - 1, -1):
        G = Ps[s] @ A.T @ np.linalg.inv(Pps[s + 1])
        sm.insert(0, ms[s] + G @ (sm[0] - mps[s + 1]))
        sP.insert(0, Ps[s] + G @ (sP[0] - Pps[s + 1]) @ G.T)
    return np.array(ms), np.array(sm), np.array(sP)


def exact_draws(ys: list[list[float] | None], lag: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent draws [n, lag, d] of the exact smoothed window p(x_{T−lag+1..T} | y_1..T), by backward
    sampling (x_T ~ N(m_T, P_T), x_s | x_{s+1} ~ N(m_s + G_s (x_{s+1} − m⁻_{s+1}), P_s − G_s P⁻_{s+1} G_sᵀ);
    Särkkä 2013, §11.1): the best any N-particle smoother could be, the floor of its Monte Carlo error."""
    ms, Ps, mps, Pps = kalman_pass(ys)
    x = rng.multivariate_normal(ms[-1], Ps[-1], size=n)
    out = [x]
    for s in range(len(ys) - 2, len(ys) - lag - 1, -1):
        G = Ps[s] @ A.T @ np.linalg.inv(Pps[s + 1])
        cov = Ps[s] - G @ Pps[s + 1] @ G.T
        x = ms[s] + (x - mps[s + 1]) @ G.T + rng.multivariate_normal(np.zeros(2), 0.5 * (cov + cov.T), size=n)
        out.insert(0, x)
    return np.stack(out, 1)


__all__ = ["LAG", "PARAMS", "PRIOR", "A", "Q", "T", "data", "numpy_rts"]
