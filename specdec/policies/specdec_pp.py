from __future__ import annotations

import torch

from specdec.features import MIN_PROB, distribution_features
from specdec.head import AcceptanceHead
from specdec.policies.base import (PAPER_MAX_CANDIDATES, Decision, DraftStep, PolicyTraits, StoppingPolicy, check_count,
                                   check_threshold)


def head_acceptances(head: AcceptanceHead, hidden: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor,
                     positions: torch.Tensor, greedy: torch.Tensor | bool) -> torch.Tensor:
    """The head's acceptance probability of B candidates at once, [B] on the head's device. A
    `hidden+distribution` head reads the state q_i came from, hidden [B, H], and q_i at y_i (probs
    [B, V], tokens [B], positions [B], greedy [B] or one flag): it judges y_i. The paper's `hidden`
    head reads hidden alone, as e_{i-1}: it judges y_{i-1}."""
    if not head.config.judges_current:
        return head.acceptance_probability(hidden)
    scalars = distribution_features(probs, tokens, positions, greedy)  # [B, S]
    return head.acceptance_probability(head.head_inputs(hidden.float(), scalars))


def judged_acceptances(head: AcceptanceHead, steps: list[DraftStep]) -> list[float | None]:
    """The head's acceptance probability for the candidate it can judge at each step, every
    session's in one head call (a step drafted in a chain carries it already: `DraftStep.judged`).

    The paper's `hidden` head reads e_j, the state after the draft has read y_j, which only the
    next draft pass produces: at step i it judges y_{i-1} from `prev_hidden` (None at i = 1). A
    `hidden+distribution` head reads the state q_i came from and q_i at y_i, all known as soon as
    y_i is sampled: it judges y_i itself, before the next draft pass is paid for (features.py)."""
    judged: list[float | None] = [s.judged for s in steps]
    rows = [b for b, s in enumerate(steps) if s.judged is None
            and (head.config.judges_current or s.prev_hidden is not None)]
    if not rows:
        return judged
    if head.config.judges_current:
        if any(steps[b].hidden is None or steps[b].probs is None for b in rows):
            raise ValueError("a hidden+distribution head needs DraftStep.hidden and DraftStep.probs")
        probs = torch.stack([steps[b].probs for b in rows])  # [R, V], on the draft's device
        tokens, positions, greedy = torch.tensor([[steps[b].token, steps[b].index, steps[b].greedy] for b in rows],
                                                 device=probs.device).T
        values = head_acceptances(head, torch.stack([steps[b].hidden for b in rows]), probs, tokens, positions, greedy)
    else:
        values = head_acceptances(head, torch.stack([steps[b].prev_hidden for b in rows]), None, None, None, False)
    for b, value in zip(rows, values.tolist()):
        judged[b] = value
    return judged


def judged_acceptance(head: AcceptanceHead, step: DraftStep) -> float | None:
    """`judged_acceptances` for one step."""
    return judged_acceptances(head, [step])[0]


# Candidates whose acceptance `expected_acceptances` evaluates; the rest of q's mass gets the value
# of the last one. A q-weighted mean over them needs one small batch through the head.
EXPECTATION_TOKENS = 8


def expected_acceptances(head: AcceptanceHead, steps: list[DraftStep]) -> list[float | None]:
    """The head's acceptance for the candidate of each step, not knowing which token it is: what a
    decision about keeping y_i in the round may depend on without breaking losslessness
    (base.py). For the paper's head and for greedy requests that is `judged_acceptances` (the
    former never reads y_i, the latter's y_i is the argmax of q_i). For a `hidden+distribution` head and a sampled y_i it is
    E_{y ~ q_i} a(y), over the EXPECTATION_TOKENS likeliest tokens of q_i with the remaining mass at
    the last one's value: a function of q_i alone. Every session's in one head call."""
    blind = [None] * len(steps)
    sampled = [b for b, s in enumerate(steps) if head.config.judges_current and not s.greedy]
    plain = sorted(set(range(len(steps))) - set(sampled))
    if plain:
        for b, value in zip(plain, judged_acceptances(head, [steps[b] for b in plain])):
            blind[b] = value
    if not sampled:
        return blind
    if any(steps[b].hidden is None for b in sampled):
        raise ValueError("a hidden+distribution head needs DraftStep.hidden")
    probs = torch.stack([steps[b].probs for b in sampled]).float()  # [R, V]
    top = probs.topk(min(EXPECTATION_TOKENS, probs.shape[-1]), dim=-1)  # values, indices [R, m]
    m = top.values.shape[-1]
    # the m tokens share every feature but log q(y) (column 0): compute the rest once over [V]
    positions = torch.tensor([steps[b].index for b in sampled], device=probs.device)
    scalars = distribution_features(probs, top.indices[:, 0], positions, False)[:, None, :].expand(-1, m, -1).clone()  # [R, m, S]
    scalars[..., 0] = torch.log(top.values.clamp_min(MIN_PROB))
    hidden = torch.stack([steps[b].hidden for b in sampled]).float()[:, None, :].expand(-1, m, -1)  # [R, m, H]
    acceptance = head.acceptance_probability(head.head_inputs(hidden, scalars)).double()  # [R, m]
    values = top.values.double()
    rest = (1.0 - values.sum(-1)).clamp_min(0.0)  # [R]
    expected = (values * acceptance).sum(-1) + rest * acceptance[:, -1]  # [R]
    for b, value in zip(sampled, expected.tolist()):
        blind[b] = value
    return blind


def expected_acceptance(head: AcceptanceHead, step: DraftStep) -> float | None:
    """`expected_acceptances` for one step."""
    return expected_acceptances(head, [step])[0]


class SpecDecPP(StoppingPolicy):
    """SpecDec++ (Algorithm 2): the acceptance head predicts sigmoid(f(e_i)) for each candidate and
    the round stops once 1 - prod_i sigmoid(f(e_i)) > h (Theorem: the optimal policy of the MDP
    is such a threshold policy). The candidate whose prediction crosses h stays in the round, as in
    the paper; with the paper's head that is y_{i-1}, and y_i (already sampled) comes along; with a
    `hidden+distribution` head it is y_i (`judged_acceptance`)."""

    name = "specdec++"
    traits = PolicyTraits(needs_head=True, reads_distribution=True, reads_threshold=True)
    DEFAULT_THRESHOLD = 0.7  # the paper's robust choice (D=3, w_rej=6, h=0.7), for a head without its own
    DEFAULT_MAX_K = PAPER_MAX_CANDIDATES

    def __init__(self, head: AcceptanceHead, threshold: float | None = None,
                 max_candidates: int = DEFAULT_MAX_K):
        self.head = head
        if threshold is None:  # the h chosen for this head on validation prompts, when it records one
            threshold = head.config.threshold if head.config.threshold is not None else self.DEFAULT_THRESHOLD
        self.threshold = check_threshold(threshold)
        self.max_candidates = check_count("k", max_candidates)
        self._accept_all = 1.0  # p-hat: predicted probability that every candidate so far is accepted

    def start_round(self) -> None:
        self._accept_all = 1.0

    def decide(self, step: DraftStep) -> Decision:
        return self._decide(judged_acceptance(self.head, step))

    @classmethod
    def decide_many(cls, policies: list[SpecDecPP], steps: list[DraftStep]) -> list[Decision]:
        """One head call for every session sharing a head."""
        return [p._decide(a) for p, a in zip(policies, _by_head(policies, steps, judged_acceptances))]

    def _decide(self, acceptance: float | None) -> Decision:
        if acceptance is not None:
            self._accept_all *= acceptance
        if 1.0 - self._accept_all > self.threshold:
            return Decision.STOP
        return Decision.CONTINUE


def _by_head(policies: list, steps: list[DraftStep], estimate) -> list:
    """`estimate(head, steps)` for the policies' steps, one call per head they hold (usually one)."""
    out: list = [None] * len(steps)
    groups: dict[int, list[int]] = {}
    for b, policy in enumerate(policies):
        groups.setdefault(id(policy.head), []).append(b)
    for rows in groups.values():
        for b, value in zip(rows, estimate(policies[rows[0]].head, [steps[b] for b in rows])):
            out[b] = value
    return out
