"""The cost-aware rule (`specdec++cost`) on hand-computed rounds, and SpecDec++'s timing with a
`hidden+distribution` head."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.cost_profile import PROFILE_ENV, CostProfile
from specdec.features import FEATURES_DISTRIBUTION, NUM_SCALAR_FEATURES, distribution_features
from specdec.head import AcceptanceHead, HeadConfig
from specdec.policies import Decision, DraftStep, PolicyConfig, SpecDecPP, SpecDecPPCost, make_policy
from specdec.policies.specdec_pp_cost import expected_tokens

CONTINUE, STOP, DROP_LAST = Decision.CONTINUE, Decision.STOP, Decision.DROP_LAST
HIDDEN = 4
# DESIGN.md §5's llama.cpp target curve with a cheap draft (5 ms): pass(k) = 35, 65, 87.5, 110 ms.
CHEAP_DRAFT = CostProfile(t_draft_ms=5.0, t_target_ms={1: 35.0, 2: 65.0, 4: 110.0, 8: 237.0, 16: 305.0})
LLAMA_CPP = CHEAP_DRAFT.model_copy(update={"t_draft_ms": 22.0})  # the measured draft: 22 ms a token
FLAT = CostProfile(t_draft_ms=10.0, t_target_ms={1: 100.0})


def q_head() -> AcceptanceHead:
    """A `hidden+distribution` head whose acceptance is exactly q(y_i) (a stand-in for a trained,
    calibrated head): it reads the features as the policy builds them and returns exp(log q(y))."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="x", features=FEATURES_DISTRIBUTION))
    head.acceptance_probability = lambda inputs: inputs[..., HIDDEN].exp()  # column HIDDEN: log q(y)
    return head.eval()


def step(index: int, acceptance: float, greedy: bool = True, token: int = 0) -> DraftStep:
    """Step i whose candidate (token 0) has q(y_i) = acceptance; greedy unless said (then the keep
    test may read a(y_i): the hand-computed rounds below)."""
    probs = torch.tensor([acceptance, 1.0 - acceptance])
    return DraftStep(index=index, token=token, probs=probs, prev_hidden=torch.zeros(HIDDEN) if index > 1 else None,
                     num_generated=0, hidden=torch.zeros(HIDDEN), greedy=greedy)


def run_round(policy, acceptances: list[float]) -> tuple[int, list[Decision]]:
    """Drives one round like rounds._Drafting.take: -> (K, the decisions)."""
    policy.start_round()
    decisions, k = [], 0
    for i, a in enumerate(acceptances, start=1):
        if k >= policy.round_limit():
            break
        decision = policy.decide(step(i, a))
        decisions.append(decision)
        if decision is DROP_LAST:
            break
        k += 1
        if decision is STOP:
            break
    return k, decisions


def test_expected_tokens():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_a_candidate_that_does_not_pay_is_dropped():
    """The module docstring's example: a_1 = 0.95 keeps y_1 (1.95 / 70 > 1 / 40) and drafts on
    ((1.95 + 0.9025) / 97.5 > 1.95 / 70); a_2 = 0.3 is dropped ((1.95 + 0.285) / 97.5 < 1.95 / 75)."""
    policy = SpecDecPPCost(q_head(), CHEAP_DRAFT)
    assert run_round(policy, [0.95, 0.3, 0.9]) == (1, [CONTINUE, DROP_LAST])


def test_k_zero_when_even_the_first_candidate_does_not_pay():
    """a_1 = 0.1: keeping y_1 makes 1.1 tokens in 5 + 65 ms against 1 in 5 + 35: DROP_LAST at i = 1."""
    policy = SpecDecPPCost(q_head(), CHEAP_DRAFT)
    assert run_round(policy, [0.1, 0.9]) == (0, [DROP_LAST])
    # a_1 = 0.8: 1.8 / 70 = 0.0257 > 1 / 40, kept; another at the same a: 2.44 / 97.5 = 0.0250, stop
    assert run_round(policy, [0.8, 0.9, 0.9]) == (1, [STOP])


def test_stops_where_the_next_candidate_stops_paying():
    """Flat 100 ms verification, 10 ms a draft step, a = 0.9 throughout. E(9) / T(9) = 6.513 / 190 =
    0.03428 < E(10) / T(10) = 6.862 / 200 = 0.03431 > E(11) / T(11) = 7.176 / 210 = 0.03417: K = 10."""
    k, decisions = run_round(SpecDecPPCost(q_head(), FLAT), [0.9] * 20)
    assert k == 10 and decisions == [CONTINUE] * 9 + [STOP]


def test_free_drafting_on_a_flat_curve_continues_to_the_cap():
    """The paper's setting (a pass costs the same for any K, drafting ~free): every candidate pays."""
    free = CostProfile(t_draft_ms=0.0, t_target_ms={1: 100.0, 16: 100.0})
    k, decisions = run_round(SpecDecPPCost(q_head(), free, max_candidates=7), [0.3] * 20)
    assert k == 7 and set(decisions) == {CONTINUE}


def test_no_drafting_when_speculation_can_never_pay():
    """llama.cpp's measured curve: 2 tokens for 22 + 65 ms even if y_1 is accepted, against 1 token
    in 35 ms, and no longer round does better: the draft does not run (round_limit 0)."""
    assert not LLAMA_CPP.can_pay(20) and CHEAP_DRAFT.can_pay(20)
    assert SpecDecPPCost(q_head(), LLAMA_CPP).round_limit() == 0
    assert SpecDecPPCost(q_head(), CHEAP_DRAFT).round_limit() == SpecDecPPCost.DEFAULT_MAX_K


def test_with_the_papers_head_the_unjudged_candidate_is_estimated_by_the_last_judged():
    """The `hidden` head judges y_{i-1} at step i: y_1 is kept unseen (a_1 estimated 1), and at step 2
    a_1 = 0.1 is known while a_2 is estimated 0.1 too: y_2 is dropped."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="x"))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(0.1 / 0.9))
    policy = SpecDecPPCost(head.eval(), CHEAP_DRAFT)
    assert run_round(policy, [0.5, 0.5, 0.5]) == (1, [CONTINUE, DROP_LAST])


def test_the_profile_comes_from_the_environment_then_the_head(tmp_path, monkeypatch):
    head = q_head()
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    policy = make_policy(PolicyConfig(name="specdec++cost", k=5), head=head)
    assert isinstance(policy, SpecDecPPCost) and policy.max_candidates == 5
    head.config.cost_profile = FLAT
    assert make_policy(PolicyConfig(name="specdec++cost"), head=head).profile == FLAT
    path = tmp_path / "profile.json"
    path.write_text(CHEAP_DRAFT.model_dump_json())
    monkeypatch.setenv(PROFILE_ENV, str(path))
    assert make_policy(PolicyConfig(name="specdec++cost"), head=head).profile == CHEAP_DRAFT


def test_sampled_candidates_are_kept_or_dropped_whatever_token_was_drawn():
    """Losslessness: for a sampled y_i the keep test reads E_{y ~ q_i} a(y), the same for every
    token q_i could have produced. Keeping y_1 pays when a_1 > 0.75 (1.75 / 70 = 1 / 40). q_1 =
    [0.9, 0.1]: E a = 0.81 + 0.01 = 0.82, kept whether y_1 is token 0 (a = 0.9) or token 1 (a = 0.1);
    q_1 = [0.85, 0.15]: E a = 0.745, dropped either way, although token 0's own 0.85 would pay."""
    policy = SpecDecPPCost(q_head(), CHEAP_DRAFT)
    for token in (0, 1):
        policy.start_round()
        assert policy.decide(step(1, 0.9, greedy=False, token=token)) is not DROP_LAST
        policy.start_round()
        assert policy.decide(step(1, 0.85, greedy=False, token=token)) is DROP_LAST
    policy.start_round()
    assert policy.decide(step(1, 0.85, greedy=True)) is not DROP_LAST  # greedy: y_1 is the argmax, a = 0.85


# ------------------------------------------------------------------------------------------------
# SpecDec++'s threshold rule with a head that judges y_i at step i


def test_rich_head_judges_the_current_candidate():
    """At h = 0.5: a_1 = 0.9 (P(reject) 0.1, on), a_2 = 0.4 (1 - 0.36 = 0.64 > h): STOP at step 2
    with y_2 in the round; the paper's head would only see y_2 at step 3."""
    policy = SpecDecPP(q_head(), threshold=0.5)
    assert run_round(policy, [0.9, 0.4, 0.9]) == (2, [CONTINUE, STOP])


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

    policy = SpecDecPPCost(q_head(), profile=LLAMA_CPP.model_copy(update={"t_draft_ms": 5.0}))

    def drafted_round(acceptance: float) -> int:
        assert policy.round_limit() > 0
        k, _ = run_round(policy, [acceptance] * 3)
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
