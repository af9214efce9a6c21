from __future__ import annotations

from specdec.policies.base import Decision, DraftStep, StoppingPolicy, check_count


class FixedK(StoppingPolicy):
    """SpecDec baseline: always K candidates per round."""

    name = "fixed"
    DEFAULT_K = 4

    def __init__(self, k: int = DEFAULT_K):
        self.max_candidates = check_count("k", k)

    def decide(self, step: DraftStep) -> Decision:
        return Decision.CONTINUE
