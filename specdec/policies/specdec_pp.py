from __future__ import annotations

import torch

from specdec.features import MIN_PROB, distribution_features
from specdec.head import AcceptanceHead
from specdec.policies.base import Decision, DraftStep, PolicyTraits, StoppingPolicy, check_count, check_threshold


def rejection_probability(acceptance_probs: torch.Tensor) -> float:
    """P(at least one candidate is rejected) = 1 - prod_i P(y_i accepted | y_<i accepted)."""
    return 1.0 - float(torch.prod(acceptance_probs))


def judged_acceptance(head: AcceptanceHead, step: DraftStep) -> float | None:
    """The head's acceptance probability for the candidate it can judge at drafting step i.

    The paper's `hidden` head reads e_j, the state after the draft has read y_j, which only the
    next draft pass produces: at step i it judges y_{i-1} from `prev_hidden` (None at i = 1). A
    `hidden+distribution` head reads the state q_i came from and q_i at y_i, all known as soon as
    y_i is sampled: it judges y_i itself, before the next draft pass is paid for (features.py)."""
    if head.config.judges_current:
        if step.hidden is None:
            raise ValueError("a hidden+distribution head needs DraftStep.hidden")
        scalars = distribution_features(step.probs, torch.tensor(step.token), torch.tensor(step.index), step.greedy)
        return float(head.acceptance_probability(head.head_inputs(step.hidden.float(), scalars)))
    if step.prev_hidden is None:
        return None
    return float(head.acceptance_probability(step.prev_hidden))


# Candidates whose acceptance `expected_acceptance` evaluates; the rest of q's mass gets the value
# of the last one. A q-weighted mean over them needs one small batch through the head.
EXPECTATION_TOKENS = 8


def expected_acceptance(head: AcceptanceHead, step: DraftStep) -> float | None:
    """The head's acceptance for the candidate of step i, not knowing which token it is: what a
    decision about keeping y_i in the round may depend on without breaking losslessness
    (base.py). For the paper's head and for greedy requests that is `judged_acceptance` (the former
    never reads y_i, the latter's y_i is the argmax of q_i). For a `hidden+distribution` head and a
    sampled y_i it is E_{y ~ q_i} a(y), over the EXPECTATION_TOKENS likeliest tokens of q_i with
    the remaining mass at the last one's value: a function of q_i alone."""
    if not head.config.judges_current or step.greedy:
        return judged_acceptance(head, step)
    if step.hidden is None:
        raise ValueError("a hidden+distribution head needs DraftStep.hidden")
    probs = step.probs.float()
    top = probs.topk(min(EXPECTATION_TOKENS, probs.numel()))  # values, indices [m]
    m = len(top.values)
    # the m tokens share every feature but log q(y) (column 0): compute the rest once over [V]
    scalars = distribution_features(probs, top.indices[0], torch.tensor(step.index), step.greedy).expand(m, -1).clone()  # [m, S]
    scalars[:, 0] = torch.log(top.values.clamp_min(MIN_PROB))
    hidden = step.hidden.float().expand(m, -1)  # [m, H]
    acceptance = head.acceptance_probability(head.head_inputs(hidden, scalars)).double()  # [m]
    values = top.values.double()
    rest = max(0.0, 1.0 - float(values.sum()))
    return float((values * acceptance).sum()) + rest * float(acceptance[-1])


class SpecDecPP(StoppingPolicy):
    """SpecDec++ (Algorithm 2): the acceptance head predicts sigmoid(f(e_i)) for each candidate and
    the round stops once 1 - prod_i sigmoid(f(e_i)) > h (Theorem: the optimal policy of the MDP
    is such a threshold policy). The candidate whose prediction crosses h stays in the round, as in
    the paper; with the paper's head that is y_{i-1}, and y_i (already sampled) comes along; with a
    `hidden+distribution` head it is y_i (`judged_acceptance`)."""

    name = "specdec++"
    traits = PolicyTraits(needs_head=True)
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
        acceptance = judged_acceptance(self.head, step)
        if acceptance is not None:
            self._accept_all *= acceptance
        if 1.0 - self._accept_all > self.threshold:
            return Decision.STOP
        return Decision.CONTINUE
