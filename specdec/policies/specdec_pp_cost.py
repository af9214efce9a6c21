"""Cost-aware SpecDec++ (`specdec++cost`, the default policy): the round length comes from the
measured forward costs instead of a hand-picked h, decided for the whole batch at once.

The policy is budgeted (policies/base.py `PolicyTraits`): it supplies, for each drafted candidate
y_i, the head's (calibrated) acceptance estimates, and the step's verification budget
(specdec/budget.py) decides from them and the live cost profile whether y_i is verified and whether
the session drafts on. With the paper's threshold rule the round stops at 1 - prod a_j > h, optimal
when t_target does not grow with k; here a candidate must pay for itself in the batch's pass.

Estimates (`estimate`): a `hidden+distribution` head judges y_i itself at step i. The keep decision
may not read which token a sampled y_i is (losslessness, policies/base.py), so its `blind` estimate is
a_i = E_{y ~ q_i} a(y) (`expected_acceptance`); greedy, y_i is the argmax and a(y_i) is that. The
decision to draft on reads a(y_i) (`known`). The paper's `hidden` head judges y_{i-1} at step i: a_i
is estimated by the last judged value (by 1 at i = 1: nothing is known yet), and the judged value
revises y_{i-1}'s (`previous`).

A K = 0 decided at step 1 has already paid for y_1's draft pass; the step planner rests a session
after such rounds and keeps the draft off where no round can pay at all (specdec/planner.py): the
policy itself keeps no backoff.
"""

from __future__ import annotations

from specdec.head import AcceptanceHead
from specdec.policies.base import (PAPER_MAX_CANDIDATES, Decision, DraftStep, Estimate, PolicyTraits, StoppingPolicy,
                                   check_count)
from specdec.policies.specdec_pp import _by_head, expected_acceptances, judged_acceptances

UNKNOWN_ACCEPTANCE = 1.0  # a_1 before the paper's head has seen anything: keep y_1, decide at step 2


class SpecDecPPCost(StoppingPolicy):
    name = "specdec++cost"
    traits = PolicyTraits(needs_head=True, budgeted=True, reads_distribution=True)
    DEFAULT_MAX_K = PAPER_MAX_CANDIDATES

    def __init__(self, head: AcceptanceHead, max_candidates: int = DEFAULT_MAX_K):
        self.head = head
        self.max_candidates = check_count("k", max_candidates)
        self._last: float | None = None  # the paper's head: the last judged a_j this round

    def start_round(self) -> None:
        self._last = None

    def estimate(self, step: DraftStep) -> Estimate:
        return self.estimate_many([self], [step])[0]

    @classmethod
    def estimate_many(cls, policies: list[SpecDecPPCost], steps: list[DraftStep]) -> list[Estimate]:
        """Every session's estimates with one head call per kind of estimate (judged, blind)."""
        judged = _by_head(policies, steps, judged_acceptances)
        blind = list(judged)  # the judged value where the keep decision may read it (`expected_acceptances`)
        sampled = [b for b, (p, s) in enumerate(zip(policies, steps)) if p.head.config.judges_current and not s.greedy]
        if sampled:
            for b, value in zip(sampled, _by_head([policies[b] for b in sampled], [steps[b] for b in sampled],
                                                  expected_acceptances)):
                blind[b] = value
        return [p._estimate(j, bl) for p, j, bl in zip(policies, judged, blind)]

    def _estimate(self, judged: float | None, blind: float | None) -> Estimate:
        if self.head.config.judges_current:  # judged: a(y_i), which the keep decision must not read
            return Estimate(blind=blind, known=judged)
        previous = judged  # judged: a_{i-1}; a_i (unknown) is estimated by it
        if judged is not None:
            self._last = judged
        a = self._last if self._last is not None else UNKNOWN_ACCEPTANCE
        return Estimate(blind=a, known=a, previous=previous)

    def decide(self, step: DraftStep) -> Decision:
        raise NotImplementedError("specdec++cost is budgeted: the step's budget decides (specdec/budget.py)")
