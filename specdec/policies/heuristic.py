from __future__ import annotations

from specdec.policies.base import Decision, DraftStep, StoppingPolicy, check_count


class Heuristic(StoppingPolicy):
    """HF transformers' `num_assistant_tokens_schedule="heuristic"`: K grows by 2 after a round
    whose candidates were all accepted and shrinks by 1 (to at least 1) otherwise; a round that
    verified no candidate leaves K as it was."""

    name = "heuristic"
    DEFAULT_INITIAL_K = 20  # HF's default num_assistant_tokens
    GROWTH, SHRINK, MIN_K = 2, 1, 1
    DEFAULT_MAX_K = 64  # HF has no cap; ours keeps a runaway schedule from drafting without bound

    def __init__(self, k: int = DEFAULT_INITIAL_K, max_candidates: int = DEFAULT_MAX_K):
        self.max_candidates = check_count("max candidates", max_candidates)
        self.k = min(check_count("k", k), self.max_candidates)

    def round_limit(self) -> int:
        return self.k

    def decide(self, step: DraftStep) -> Decision:
        return Decision.CONTINUE

    def end_round(self, num_candidates: int, num_accepted: int) -> None:
        # As HF (`num_matches == len(scores[0]) - 1`): all of the round's own candidates accepted, however
        # many it held. Not against self.k: a round drafted ahead (loop.py) was drafted before the previous
        # round's outcome moved K, and a suffix walk or the token budget may end a round short of K.
        if num_candidates == 0:  # nothing verified (a walk that matched nothing, a draft catching up)
            return
        if num_accepted == num_candidates:
            self.k = min(self.k + self.GROWTH, self.max_candidates)
        else:
            self.k = max(self.k - self.SHRINK, self.MIN_K)
