from __future__ import annotations

import math

import torch

from specdec.errors import InvalidRequestError
from specdec.policies.base import Decision, DraftStep, PolicyTraits, StoppingPolicy, check_count, check_threshold


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy H(q) in nats of a distribution [V]."""
    positive = probs[probs > 0]
    return float(-(positive * torch.log(positive)).sum())


class SVIP(StoppingPolicy):
    """SVIP (Zhang et al. 2024): the acceptance rate of y_i is bounded below by a decreasing
    function of the draft entropy; stop once sqrt(gamma * H(q_i)) > threshold."""

    name = "svip"
    traits = PolicyTraits(reads_distribution=True, stops_on_q=True, reads_threshold=True)
    DEFAULT_GAMMA, DEFAULT_THRESHOLD, DEFAULT_MAX_K = 0.15, 0.3, 40  # the official defaults

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, gamma: float = DEFAULT_GAMMA,
                 max_candidates: int = DEFAULT_MAX_K):
        self.threshold = check_threshold(threshold)
        # no request sets gamma, but the engine as a library may: a negative one raised mid-round (the
        # square root of a negative), 0 or NaN never stopped on the entropy
        if not 0.0 < gamma < math.inf:
            raise InvalidRequestError(f"gamma must be positive and finite, got {gamma}")
        self.gamma = gamma
        self.max_candidates = check_count("k", max_candidates)

    def decide(self, step: DraftStep) -> Decision:
        if math.sqrt(self.gamma * entropy(step.probs)) > self.threshold:
            return Decision.STOP
        return Decision.CONTINUE
