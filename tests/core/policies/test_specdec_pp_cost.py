"""The cost-aware policy (`specdec++cost`): the estimates it gives the step's budget
(specdec/budget.py, tested in tests/core/test_budget.py), where its costs come from;
and SpecDec++'s timing with a `hidden+distribution` head."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.budget import StepBudget
from specdec.cost_profile import CostProfile
from specdec.features import FEATURES_DISTRIBUTION, NUM_SCALAR_FEATURES, distribution_features
from specdec.head import AcceptanceHead, HeadConfig
from specdec.policies import Decision, DraftStep, PolicyConfig, SpecDecPP, SpecDecPPCost, make_policy, policy_traits
from specdec.workers import DraftWorker

CONTINUE, STOP, DROP_LAST = Decision.CONTINUE, Decision.STOP, Decision.DROP_LAST
HIDDEN = 4
# a llama.cpp target curve (2-core Intel CPU) with a cheap draft (5 ms): pass(k) = 35, 65, 87.5, 110 ms.
CHEAP_DRAFT = CostProfile(t_draft_ms=5.0, t_target_ms={1: 35.0, 2: 65.0, 4: 110.0, 8: 237.0, 16: 305.0})


def q_head() -> AcceptanceHead:
    """A `hidden+distribution` head whose acceptance is exactly q(y_i) (a stand-in for a trained,
    calibrated head): it reads the features as the policy builds them and returns exp(log q(y))."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="x", features=FEATURES_DISTRIBUTION))
    head.acceptance_probability = lambda inputs: inputs[..., HIDDEN].exp()  # column HIDDEN: log q(y)
    return head.eval()


def step(index: int, acceptance: float, greedy: bool = True, token: int = 0) -> DraftStep:
    """Step i whose candidate (token 0) has q(y_i) = acceptance; greedy unless said."""
    probs = torch.tensor([acceptance, 1.0 - acceptance])
    return DraftStep(index=index, token=token, probs=probs, prev_hidden=torch.zeros(HIDDEN) if index > 1 else None,
                     num_generated=0, hidden=torch.zeros(HIDDEN), greedy=greedy)


def run_round(policy, acceptances: list[float]) -> int:
    """Drives one round of one session as rounds.propose does (estimate, then the budget) -> K."""
    policy.start_round()
    budget, kept = StepBudget(CHEAP_DRAFT, expected=1.0, tokens=1), []
    for i, a in enumerate(acceptances[:policy.round_limit()], start=1):
        budget.spent_ms += CHEAP_DRAFT.draft_ms(1)
        estimate = policy.estimate(step(i, a))
        if estimate.previous is not None and kept:
            kept[-1] = estimate.previous
        if not budget.keep([math.prod(kept) * estimate.blind])[0]:
            break
        kept.append(estimate.known)
        budget.add(math.prod(kept))
        if not budget.draft_on([math.prod(kept)], [estimate.known], [policy.round_limit() - i])[0]:
            break
    return len(kept)


def test_the_policy_is_budgeted_and_needs_a_head():
    traits = policy_traits("specdec++cost")
    assert traits.budgeted and traits.needs_head and traits.servable
    with pytest.raises(NotImplementedError, match="budget"):
        SpecDecPPCost(q_head()).decide(step(1, 0.5))


def test_greedy_estimates_read_the_candidate():
    estimate = SpecDecPPCost(q_head()).estimate(step(1, 0.8))
    assert estimate.blind == pytest.approx(0.8) and estimate.known == pytest.approx(0.8) and estimate.previous is None


def test_with_the_papers_head_the_unjudged_candidate_is_estimated_by_the_last_judged():
    """The `hidden` head judges y_{i-1} at step i: y_1 is kept unseen (a_1 estimated 1), and at step 2
    a_1 = 0.1 is known (it revises y_1's estimate) while a_2 is estimated 0.1 too: y_2 is dropped."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="x"))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(0.1 / 0.9))
    policy = SpecDecPPCost(head.eval())
    policy.start_round()
    first = policy.estimate(step(1, 0.5))
    assert (first.blind, first.known, first.previous) == (1.0, 1.0, None)
    second = policy.estimate(step(2, 0.5))
    assert second.previous == pytest.approx(0.1) and second.blind == pytest.approx(0.1)
    assert run_round(policy, [0.5, 0.5, 0.5]) == 1


def test_sampled_candidates_are_kept_or_dropped_whatever_token_was_drawn():
    """Losslessness: for a sampled y_i the keep decision reads E_{y ~ q_i} a(y), the same for every
    token q_i could have produced. Keeping y_1 pays when a_1 > 0.75 (1.75 / 70 = 1 / 40). q_1 =
    [0.9, 0.1]: E a = 0.81 + 0.01 = 0.82, kept whether y_1 is token 0 (a = 0.9) or token 1 (a = 0.1);
    q_1 = [0.85, 0.15]: E a = 0.745, dropped either way, although token 0's own 0.85 would pay."""
    policy = SpecDecPPCost(q_head())
    budget = StepBudget(CHEAP_DRAFT, expected=1.0, tokens=1, spent_ms=5.0)
    for token in (0, 1):
        policy.start_round()
        high = policy.estimate(step(1, 0.9, greedy=False, token=token))
        assert high.blind == pytest.approx(0.82) and budget.keep([high.blind]) == [True]
        low = policy.estimate(step(1, 0.85, greedy=False, token=token))
        assert low.blind == pytest.approx(0.745) and budget.keep([low.blind]) == [False]
    assert budget.keep([policy.estimate(step(1, 0.85, greedy=True)).blind]) == [True]  # greedy: a(argmax) = 0.85


def test_a_budgeted_round_is_spent_with_the_plans_costs_and_without_them_drafts_nothing(tiny_engine):
    """The draft side decides nothing on its own: with the plan's costs a budgeted session drafts as
    they say; a plan without costs (nothing priced the step) drafts nothing for it, and a fixed-K
    session beside it drafts as its policy says."""
    from specdec.protocol import HistoryDelta, ProposeItem, RoundSeed, StepPlan
    from specdec.sampling import SamplingParams

    head = AcceptanceHead(HeadConfig(hidden_size=tiny_engine.draft.hidden_size, depth=0, draft_identity="x",
                                     features=FEATURES_DISTRIBUTION)).eval()
    with torch.no_grad():  # every candidate judged likely: a = sigmoid(3) = 0.95
        head.out.weight.zero_()
        head.out.bias.fill_(3.0)
    worker = DraftWorker(tiny_engine.draft, head)

    def item(name: str, policy: PolicyConfig) -> ProposeItem:
        return ProposeItem(f"{name}-{policy.name}", HistoryDelta(3, [5, 6, 7], True), policy, SamplingParams(), 4, 0,
                           [], RoundSeed(1, 0, 0))

    cost, fixed = PolicyConfig(name="specdec++cost", k=4), PolicyConfig(name="fixed", k=2)
    unpriced = worker.propose([item("a", cost), item("a", fixed)], StepPlan())
    assert [len(p.candidates) for p in unpriced] == [0, 2] and unpriced[0].forward_passes == 0
    priced = worker.propose([item("b", cost)], StepPlan(costs=CostProfile(t_draft_ms=0.01, t_target_ms={1: 100.0})))
    assert len(priced[0].candidates) == 4  # a nearly free draft and a flat target: every candidate pays
    assert make_policy(PolicyConfig(name="specdec++cost", k=5), head=head).max_candidates == 5


# ------------------------------------------------------------------------------------------------
# SpecDec++'s threshold rule with a head that judges y_i at step i


def test_rich_head_judges_the_current_candidate():
    """At h = 0.5: a_1 = 0.9 (P(reject) 0.1, on), a_2 = 0.4 (1 - 0.36 = 0.64 > h): STOP at step 2
    with y_2 in the round; the paper's head would only see y_2 at step 3."""
    policy = SpecDecPP(q_head(), threshold=0.5)
    policy.start_round()
    assert [policy.decide(step(i, a)) for i, a in enumerate([0.9, 0.4], start=1)] == [CONTINUE, STOP]


def test_rich_head_reads_the_distribution_features():
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=1, draft_identity="x",
                                     features=FEATURES_DISTRIBUTION)).eval()
    assert head.config.input_size == HIDDEN + NUM_SCALAR_FEATURES
    hidden, probs = torch.randn(HIDDEN), torch.softmax(torch.randn(9), -1)
    scalars = distribution_features(probs, torch.tensor(3), torch.tensor(2))
    expected = float(head.acceptance_probability(torch.cat([hidden, scalars])))
    from specdec.policies.specdec_pp import judged_acceptance
    got = judged_acceptance(head, DraftStep(index=2, token=3, probs=probs, prev_hidden=None, num_generated=0,
                                            hidden=hidden))
    assert got == pytest.approx(expected)


def test_expected_acceptance_is_the_q_weighted_mean_over_the_likeliest_tokens():
    from specdec.policies.specdec_pp import EXPECTATION_TOKENS, expected_acceptance, judged_acceptance

    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=1, draft_identity="x",
                                     features=FEATURES_DISTRIBUTION)).eval()
    hidden = torch.randn(HIDDEN)
    probs = torch.softmax(torch.randn(5), -1)  # fewer tokens than EXPECTATION_TOKENS: exact
    assert len(probs) < EXPECTATION_TOKENS

    def at(token, greedy=False):
        return DraftStep(index=3, token=token, probs=probs, prev_hidden=None, num_generated=0, hidden=hidden,
                         greedy=greedy)

    exact = sum(float(probs[t]) * judged_acceptance(head, at(t)) for t in range(5))
    assert expected_acceptance(head, at(0)) == pytest.approx(exact, rel=1e-5)
    assert expected_acceptance(head, at(4)) == expected_acceptance(head, at(0))  # not the drawn token
    top = int(probs.argmax())
    assert expected_acceptance(head, at(top, greedy=True)) == judged_acceptance(head, at(top, greedy=True))
