"""The cost-aware policy (`specdec++cost`): the estimates it gives the step's budget
(specdec/budget.py, tested in tests/core/test_budget.py), its backoff, where its costs come from;
and SpecDec++'s timing with a `hidden+distribution` head."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.budget import StepBudget, StepPlan
from specdec.cost_profile import PROFILE_ENV, CostProfile, DEFAULT_PROFILES
from specdec.features import FEATURES_DISTRIBUTION, NUM_SCALAR_FEATURES, distribution_features
from specdec.head import AcceptanceHead, HeadConfig
from specdec.policies import Decision, DraftStep, PolicyConfig, SpecDecPP, SpecDecPPCost, make_policy, policy_traits
from specdec.workers import DraftWorker

CONTINUE, STOP, DROP_LAST = Decision.CONTINUE, Decision.STOP, Decision.DROP_LAST
HIDDEN = 4
# DESIGN.md §5's llama.cpp target curve with a cheap draft (5 ms): pass(k) = 35, 65, 87.5, 110 ms.
CHEAP_DRAFT = CostProfile(t_draft_ms=5.0, t_target_ms={1: 35.0, 2: 65.0, 4: 110.0, 8: 237.0, 16: 305.0})
FLAT = CostProfile(t_draft_ms=10.0, t_target_ms={1: 100.0})


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


def test_the_draft_plans_with_a_given_profile_then_the_callers_then_its_prior(tmp_path, monkeypatch):
    """SPECDEC_COST_PROFILE overrides everything; else the loop's measured costs sent with the call;
    else the head's profile, else the runtime's default."""
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    head = q_head()

    class Draft:
        kind, device = "llamacpp", torch.device("cpu")

    worker = DraftWorker(Draft(), head)
    assert worker.costs(StepPlan()) == DEFAULT_PROFILES["llamacpp"]
    assert worker.costs(StepPlan(FLAT)) == FLAT
    head.config.cost_profile = CHEAP_DRAFT
    assert DraftWorker(Draft(), head).costs(StepPlan()) == CHEAP_DRAFT
    path = tmp_path / "profile.json"
    path.write_text(CHEAP_DRAFT.model_dump_json())
    monkeypatch.setenv(PROFILE_ENV, str(path))
    assert worker.costs(StepPlan(FLAT)) == CHEAP_DRAFT
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


def test_after_a_dropped_first_candidate_rounds_skip_the_draft_with_backoff():
    """K = 0 at step 1 paid a draft pass for nothing: the next 1, 2, 4, ... MAX_ABSTAIN rounds decode
    without drafting (round_limit 0), and a round that keeps a candidate ends the backoff."""
    from specdec.policies.specdec_pp_cost import MAX_ABSTAIN

    policy = SpecDecPPCost(q_head())

    def drafted_round(acceptance: float) -> int:
        assert policy.round_limit() > 0
        k = run_round(policy, [acceptance] * 3)
        policy.end_round(k, 0)
        return k

    def skipped_rounds() -> int:
        count = 0
        while policy.round_limit() == 0:
            policy.end_round(0, 0)  # a round without the draft: start_round is never called
            count += 1
        return count

    lengths = []
    for _ in range(5):
        assert drafted_round(0.01) == 0  # y_1 does not pay
        lengths.append(skipped_rounds())
    assert lengths == [1, 2, 4, MAX_ABSTAIN, MAX_ABSTAIN]
    assert drafted_round(0.99) > 0  # drafting pays again: the backoff ends
    assert drafted_round(0.01) == 0 and skipped_rounds() == 1
