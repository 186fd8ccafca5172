"""A small quadratic program over the probability simplex (FedPAC's classifier weights).

    minimize_alpha  alpha^T Q alpha    subject to  alpha >= 0,  sum_j alpha_j = 1

with Q (K, K) symmetric positive semi-definite. Solved by scipy's SLSQP (sequential
least squares; exact gradient 2 Q alpha, tolerance 1e-12) from the uniform point, then
polished on the support SLSQP found by the KKT system of the equality-constrained
problem (SLSQP alone stops ~1e-6 from the optimum: the objective is flat there), in
float64 on the CPU, so the answer is deterministic. For the sizes FedPAC needs (K = the
clients of a round) this takes milliseconds.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def simplex_qp(Q: np.ndarray, floor: float = 0.0) -> Optional[np.ndarray]:
    """The (K,) minimizer of alpha^T Q alpha over the simplex, or None if SLSQP fails.

    Q is symmetrized ((Q + Q^T) / 2) first. ``floor``: weights below it are set to 0 and
    the rest renormalized to sum 1 (FedPAC's code drops weights below 1e-3); the solver's
    own round-off leaves entries of order 1e-10 where the exact optimum has zeros.
    """
    Q = np.asarray(Q, dtype=np.float64)
    if Q.ndim != 2 or Q.shape[0] != Q.shape[1] or Q.shape[0] == 0:
        raise ValueError(f"simplex_qp: Q must be a non-empty square matrix, got shape {Q.shape}")
    if not np.all(np.isfinite(Q)):
        raise ValueError("simplex_qp: Q has non-finite entries")
    K = Q.shape[0]
    if K == 1:
        return np.ones(1)
    from scipy.optimize import minimize

    Q = (Q + Q.T) / 2.0
    scale = max(float(np.abs(Q).max()), 1e-300)  # the objective scaled to O(1): SLSQP's tolerance is absolute
    Qs = Q / scale
    res = minimize(lambda a: float(a @ Qs @ a), np.full(K, 1.0 / K), jac=lambda a: 2.0 * (Qs @ a),
                   method="SLSQP", bounds=[(0.0, 1.0)] * K,
                   constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
                   options={"ftol": 1e-12, "maxiter": 1000})
    if not res.success:
        return None
    alpha = polish(Qs, np.clip(res.x, 0.0, None))
    alpha[alpha < floor] = 0.0
    total = alpha.sum()
    return alpha / total if total > 0 else None


def polish(Q: np.ndarray, alpha: np.ndarray, tol: float = 1e-8) -> np.ndarray:
    """The exact minimizer of alpha^T Q alpha with sum 1 on the support S = {alpha_j > tol}
    (zero elsewhere): the KKT system [[2 Q_SS, 1], [1^T, 0]] [a; nu] = [0; 1], solved by least
    squares (Q_SS may be singular). Kept only if it stays >= 0 and does not raise the
    objective; otherwise ``alpha`` is returned unchanged."""
    S = np.flatnonzero(alpha > tol)
    n = len(S)
    if n == 0:
        return alpha
    kkt = np.zeros((n + 1, n + 1))
    kkt[:n, :n] = 2.0 * Q[np.ix_(S, S)]
    kkt[:n, n] = kkt[n, :n] = 1.0
    rhs = np.zeros(n + 1)
    rhs[n] = 1.0
    sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:n]
    exact = np.zeros_like(alpha)
    exact[S] = sol
    if np.all(sol >= 0) and abs(sol.sum() - 1.0) < 1e-9 and exact @ Q @ exact <= alpha @ Q @ alpha + 1e-12:
        return exact
    return alpha
