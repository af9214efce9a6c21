from __future__ import annotations

from collections.abc import Sequence

from specdec.policies.base import Decision, DraftStep, PolicyTraits, StoppingPolicy, check_count


class Oracle(StoppingPolicy):
    """Greedy hindsight oracle (paper Lemma 2.1), for evaluation only.

    Given the target's greedy continuation X, it drops each candidate the target would reject,
    so every round ends just before a disagreement: N_discarded = 0 and N_target = |S| + 1.
    """

    name = "oracle"
    traits = PolicyTraits(greedy_only=True, needs_reference=True)
    DEFAULT_MAX_K = 256  # effectively unbounded: the oracle measures the limit

    def __init__(self, reference: Sequence[int], max_candidates: int = DEFAULT_MAX_K):
        self.reference = list(reference)
        self.max_candidates = check_count("k", max_candidates)

    def decide(self, step: DraftStep) -> Decision:
        position = step.num_generated + step.index - 1  # index of y_i in the generated sequence
        if position >= len(self.reference) or step.token != self.reference[position]:
            return Decision.DROP_LAST
        return Decision.CONTINUE
