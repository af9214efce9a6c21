"""Cost-aware SpecDec++ (`specdec++cost`, issue 19): the round length comes from the measured
forward costs instead of a hand-picked h.

With a_j the head's (calibrated) P(y_j accepted | y_<j accepted) and P_j = a_1 ... a_j, a round of
k candidates is expected to commit

    E(k) = 1 + P_1 + ... + P_k          (the accepted prefix plus the correction or bonus token)

in T(k) = k * t_draft + t_target(k) (specdec/cost_profile.py: t_target(k) is a pass over k + 1
tokens, interpolated from measured curves; on CPU they are far from flat). The paper's threshold
rule is optimal when t_target does not grow with k; here a candidate must pay for itself.

At drafting step i (y_i sampled; i draft passes spent, so they cost the same either way):

1. keep y_i only if E(i) / (i t_draft + t_target(i)) > E(i-1) / (i t_draft + t_target(i-1)),
   else DROP_LAST (at i = 1 the round verifies no candidate: plain decoding, K = 0). Losslessness
   forbids this test to read which token y_i is (policies/base.py): for a sampled y_i it uses
   a_i = E_{y ~ q_i} a(y) (`expected_acceptance`); greedy, y_i is the argmax and a(y_i) is that;
2. draft another only if the round's expected rate improves with it:
   E(i+1) / T(i+1) > E(i) / T(i), now with the kept y_i's own a(y_i) and the unknown a_{i+1}
   estimated by a_i (acceptance runs in streaks, and the estimate only gets used once); else STOP.

Worked example (the llama.cpp curve of DESIGN.md §5 but t_draft = 5 ms: pass(k) = 35, 65, 87.5,
110 ms for k = 1, 2, 3, 4 tokens). a_1 = 0.95: keep, 1.95 / 70 = 0.0279 > 1 / 40 = 0.025;
draft on? (1.95 + 0.9025) / 97.5 = 0.0293 > 1.95 / 70 = 0.0279: yes. a_2 = 0.3: keep y_2?
(1.95 + 0.285) / 97.5 = 0.0229 against 1.95 / 75 = 0.026: no, DROP_LAST, the round is y_1.

A `hidden+distribution` head judges y_i at step i; the paper's head judges y_{i-1} then, so for it
a_i is estimated by a_{i-1} (by 1 at i = 1: nothing is known yet, and y_1 is never dropped).
When the profile says no round can beat plain decoding even if every candidate were accepted,
`round_limit` is 0 and the draft does not run at all.

A K = 0 decided at step 1 has already paid for y_1's draft pass; where drafting does not pay (on
llama.cpp a draft pass costs over half a target pass), paying it every round would make the
policy slower than plain decoding. So after a round that dropped y_1 the next rounds decode
plainly without drafting, 1, 2, 4, then at most MAX_ABSTAIN rounds in a row, before the draft
probes again (the draft catches up on the skipped tokens in its next pass, which costs about one
pass); any round that keeps a candidate ends the backoff.
"""

from __future__ import annotations

from specdec.cost_profile import CostProfile, resolve_profile
from specdec.head import AcceptanceHead
from specdec.policies.base import Decision, DraftStep, StoppingPolicy, check_count
from specdec.policies.specdec_pp import expected_acceptance, judged_acceptance

UNKNOWN_ACCEPTANCE = 1.0  # a_1 before the paper's head has seen anything: keep y_1, decide at step 2
MAX_ABSTAIN = 8  # rounds decoded without drafting, at most, after a round that dropped y_1


def expected_tokens(acceptance: list[float]) -> float:
    """E(k) = 1 + sum_j prod_{l <= j} a_l for a round whose candidates have acceptance [a_1..a_k]."""
    total, survive = 1.0, 1.0
    for a in acceptance:
        survive *= a
        total += survive
    return total


class SpecDecPPCost(StoppingPolicy):
    name = "specdec++cost"
    DEFAULT_MAX_K = 20  # the paper's cap on a round

    def __init__(self, head: AcceptanceHead, profile: CostProfile | None = None,
                 max_candidates: int = DEFAULT_MAX_K, runtime: str = "torch"):
        self.head = head
        self.profile = profile if profile is not None else resolve_profile(head.config.cost_profile, runtime)
        self.max_candidates = check_count("--k", max_candidates)
        self._pays = self.profile.can_pay(self.max_candidates)
        self._judged: list[float] = []  # the head's a_j for the candidates judged so far this round
        self._drafted = False  # this round ran the draft
        self._abstain = 0  # rounds left to decode without drafting
        self._backoff = 0  # length of the next abstention

    def round_limit(self) -> int:
        return self.max_candidates if self._pays and self._abstain == 0 else 0

    def start_round(self) -> None:
        self._judged = []
        self._drafted = True

    def end_round(self, num_candidates: int, num_accepted: int) -> None:
        if self._drafted and num_candidates == 0:  # y_1 drafted and dropped: drafting does not pay here
            self._backoff = min(max(1, 2 * self._backoff), MAX_ABSTAIN)
            self._abstain = self._backoff
        elif self._drafted:
            self._backoff = 0
        elif self._abstain > 0:
            self._abstain -= 1
        self._drafted = False

    def decide(self, step: DraftStep) -> Decision:
        judged = judged_acceptance(self.head, step)
        if self.head.config.judges_current:  # judged: a(y_i), which the keep test must not read (base.py)
            blind = self._judged + [judged if step.greedy else expected_acceptance(self.head, step)]
            if self.keep_rate(blind) <= self.drop_rate(blind):
                return Decision.DROP_LAST
            self._judged.append(judged)
            a = self._judged  # a_1..a_i
        else:  # judged: a_{i-1}; a_i (unknown) is estimated by the last judged
            if judged is not None:
                self._judged.append(judged)
            last = self._judged[-1] if self._judged else UNKNOWN_ACCEPTANCE
            a = (self._judged + [last] * step.index)[:step.index]
            if self.keep_rate(a) <= self.drop_rate(a):
                return Decision.DROP_LAST
        return Decision.CONTINUE if self.next_rate(a) > self.keep_rate(a) else Decision.STOP

    # The three rates of the module docstring, for candidates with acceptance a = [a_1..a_i].
    def keep_rate(self, a: list[float]) -> float:
        return expected_tokens(a) / self.profile.round_ms(len(a))

    def drop_rate(self, a: list[float]) -> float:
        return expected_tokens(a[:-1]) / self.profile.round_ms(len(a) - 1, draft_steps=len(a))

    def next_rate(self, a: list[float]) -> float:
        return expected_tokens(a + a[-1:]) / self.profile.round_ms(len(a) + 1)
