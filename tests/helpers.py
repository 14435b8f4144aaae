"""Monte Carlo error bounds for statistical tests, from ArviZ's effective sample size."""

import arviz as az
import numpy as np

Z = 4.5  # MCSE multiples: a false alarm has probability ~1e-5 per check


def mcse_mean(draws):
    """MCSE of the mean of each column of ``draws`` (n, k), from ArviZ's bulk ESS."""
    draws = np.asarray(draws, dtype=float).reshape(len(draws), -1)
    ess = np.array([az.ess(draws[None, :, j]) for j in range(draws.shape[1])])
    return draws.std(0) / np.sqrt(ess)


def assert_mean(draws, expected, z=Z):
    draws = np.asarray(draws, dtype=float).reshape(len(draws), -1)
    expected = np.broadcast_to(np.asarray(expected, dtype=float).reshape(-1), draws.shape[1:])
    err = np.abs(draws.mean(0) - expected)
    bound = z * mcse_mean(draws)
    assert (err <= bound).all(), f"mean error {err} exceeds {z} MCSE {bound}"


def assert_variance(draws, expected, z=Z):
    """Compare the variance of each column, using the MCSE of the squared deviations."""
    draws = np.asarray(draws, dtype=float).reshape(len(draws), -1)
    expected = np.broadcast_to(np.asarray(expected, dtype=float).reshape(-1), draws.shape[1:])
    sq = (draws - draws.mean(0)) ** 2
    err = np.abs(sq.mean(0) - expected)
    bound = z * mcse_mean(sq)
    assert (err <= bound).all(), f"variance error {err} exceeds {z} MCSE {bound}"
