from __future__ import annotations

import torch

from specdec.head import AcceptanceHead
from specdec.policies.base import Decision, DraftStep, StoppingPolicy, check_count, check_threshold


def rejection_probability(acceptance_probs: torch.Tensor) -> float:
    """P(at least one candidate is rejected) = 1 - prod_i P(y_i accepted | y_<i accepted)."""
    return 1.0 - float(torch.prod(acceptance_probs))


class SpecDecPP(StoppingPolicy):
    """SpecDec++ (Algorithm 2): the acceptance head predicts sigmoid(f(e_i)) for each candidate and
    the round stops once 1 - prod_i sigmoid(f(e_i)) > h (Theorem: the optimal policy of the MDP
    is such a threshold policy)."""

    name = "specdec++"
    DEFAULT_THRESHOLD = 0.7  # the paper's robust choice (D=3, w_rej=6, h=0.7), for a head without its own
    DEFAULT_MAX_K = 20  # the paper stops every round at 20 candidates

    def __init__(self, head: AcceptanceHead, threshold: float | None = None,
                 max_candidates: int = DEFAULT_MAX_K):
        self.head = head
        if threshold is None:  # the h chosen for this head on validation prompts, when it records one
            threshold = head.config.threshold if head.config.threshold is not None else self.DEFAULT_THRESHOLD
        self.threshold = check_threshold(self.name, threshold)
        self.max_candidates = check_count("--k", max_candidates)
        self._accept_all = 1.0  # p-hat: predicted probability that every candidate so far is accepted

    def start_round(self) -> None:
        self._accept_all = 1.0

    def decide(self, step: DraftStep) -> Decision:
        if step.prev_hidden is not None:  # e_{i-1} exists from step 2 on
            self._accept_all *= float(self.head.acceptance_probability(step.prev_hidden))
        if 1.0 - self._accept_all > self.threshold:
            return Decision.STOP
        return Decision.CONTINUE
