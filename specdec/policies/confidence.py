from __future__ import annotations

from specdec.policies.base import Decision, DraftStep, PolicyTraits, StoppingPolicy, check_count, check_threshold


class Confidence(StoppingPolicy):
    """HF transformers' dynamic default (`assistant_confidence_threshold`): stop the round after a
    token drafted while the draft's top probability was below the threshold (DESIGN.md's rule).
    Greedy, that is HF's `ConfidenceCriteria`; sampled, HF reads the probability of the token it
    drew instead, which is the top one only where the draw took it."""

    name = "confidence"
    traits = PolicyTraits(reads_distribution=True, stops_on_q=True, reads_threshold=True)
    DEFAULT_THRESHOLD, DEFAULT_MAX_K = 0.4, 20  # HF's defaults

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_candidates: int = DEFAULT_MAX_K):
        self.threshold = check_threshold(threshold)
        self.max_candidates = check_count("k", max_candidates)

    def decide(self, step: DraftStep) -> Decision:
        if float(step.probs.max()) < self.threshold:
            return Decision.STOP
        return Decision.CONTINUE
