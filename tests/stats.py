"""Goodness-of-fit helper shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

# Chi-squared needs expected counts of about 5 per category; rarer outcomes are pooled.
MIN_EXPECTED = 5.0


def chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-squared goodness of fit of counts against probabilities (same shape, any rank).

    Outcomes of probability 0 must never occur; every outcome expected fewer than MIN_EXPECTED
    times goes into one pool, with the next rarest while the pool is below it (pooling only until
    the pool reached it left a long tail of cells expected far below once, where a correct sampler
    got p = 4e-14).
    """
    observed, probs = observed.ravel().astype(float), probs.ravel() / probs.sum()
    impossible = probs <= 0
    assert observed[impossible].sum() == 0, "an outcome of probability 0 occurred"
    observed, expected = observed[~impossible], probs[~impossible] * observed.sum()
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    pooled = int((expected < MIN_EXPECTED).sum())  # (sorted: the rarest come first)
    while pooled < len(expected) - 1 and expected[:pooled].sum() < MIN_EXPECTED:
        pooled += 1
    if pooled > 1:
        observed = np.concatenate([[observed[:pooled].sum()], observed[pooled:]])
        expected = np.concatenate([[expected[:pooled].sum()], expected[pooled:]])
    assert len(expected) >= 2, "too few categories for a test"
    return float(chisquare(observed, expected).pvalue)
