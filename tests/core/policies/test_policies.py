"""Each stopping policy's decisions on hand-made draft steps, and the errors of bad policy flags."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.head import AcceptanceHead, HeadConfig
from specdec.policies import (
    POLICY_NAMES, SVIP, Confidence, Decision, DraftStep, FixedK, Heuristic, Oracle, PolicyConfig, SpecDecPP,
    TargetOnly, make_policy, policy_traits, resolve_policy,
)
from specdec.policies.specdec_pp_cost import SpecDecPPCost
from specdec.policies.svip import entropy

HIDDEN = 8
CONTINUE, STOP, DROP_LAST = Decision.CONTINUE, Decision.STOP, Decision.DROP_LAST
UNIFORM_4 = torch.full((4,), 0.25)  # H = ln 4 = 1.386 nats
PEAKED_4 = torch.tensor([0.97, 0.01, 0.01, 0.01])  # H = 0.168 nats


def step(index: int, probs: torch.Tensor = UNIFORM_4, token: int = 0, hidden: torch.Tensor | None = None,
         num_generated: int = 0) -> DraftStep:
    if hidden is None and index > 1:
        hidden = torch.zeros(HIDDEN)
    return DraftStep(index=index, token=token, probs=probs, prev_hidden=hidden, num_generated=num_generated)


def constant_head(acceptance: float) -> AcceptanceHead:
    """A linear probe (depth 0) predicting `acceptance` for every hidden state."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="test"))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(acceptance / (1 - acceptance)))
    return head.eval()


# ------------------------------------------------------------------------------------------------
# fixed, heuristic, target-only


def test_fixed_always_continues_up_to_k():
    policy = FixedK(k=3)
    assert policy.round_limit() == 3
    for i in range(1, 6):
        assert policy.decide(step(i, PEAKED_4 if i % 2 else UNIFORM_4)) is CONTINUE
    policy.end_round(3, 0)
    assert policy.round_limit() == 3


def test_heuristic_schedule_grows_by_two_and_shrinks_by_one():
    policy = Heuristic(k=3, max_candidates=8)
    limits = []
    for num_accepted_of_limit in (1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0):
        limit = policy.round_limit()
        limits.append(limit)
        assert policy.decide(step(1)) is CONTINUE
        policy.end_round(limit, int(limit * num_accepted_of_limit))
    # 3 -> 5 -> 7 -> 8 (capped) -> 7 -> 6 ... -> 1 (floor) -> 1 -> 3
    assert limits == [3, 5, 7, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    assert policy.round_limit() == 3


def test_heuristic_initial_k_is_capped():
    assert Heuristic(k=30, max_candidates=10).round_limit() == 10


def test_target_only_never_drafts():
    policy = TargetOnly()
    assert not policy.uses_draft and policy.round_limit() == 0


# ------------------------------------------------------------------------------------------------
# svip, confidence


def test_entropy_in_nats_ignores_zero_probabilities():
    assert entropy(UNIFORM_4) == pytest.approx(math.log(4), rel=1e-6)
    assert entropy(torch.tensor([0.5, 0.5, 0.0, 0.0])) == pytest.approx(math.log(2), rel=1e-6)
    assert entropy(torch.tensor([1.0, 0.0])) == 0.0


def test_svip_stops_on_uniform_and_continues_on_peaked():
    policy = SVIP()  # gamma 0.15, threshold 0.3: stop iff H > 0.6 nats
    assert policy.decide(step(1, UNIFORM_4)) is STOP
    assert policy.decide(step(2, PEAKED_4)) is CONTINUE
    assert policy.decide(step(3, torch.full((8,), 0.125))) is STOP


@pytest.mark.parametrize("threshold,expected", [(0.45, STOP), (0.46, CONTINUE)])
def test_svip_threshold_on_sqrt_gamma_entropy(threshold, expected):
    # sqrt(0.15 * ln 4) = 0.4560
    assert SVIP(threshold=threshold).decide(step(1, UNIFORM_4)) is expected


def test_svip_gamma_scales_the_entropy():
    assert SVIP(threshold=0.3, gamma=0.05).decide(step(1, UNIFORM_4)) is CONTINUE  # sqrt(0.069) = 0.263
    assert SVIP(threshold=0.3, gamma=0.15).decide(step(1, UNIFORM_4)) is STOP


def test_confidence_stops_iff_top_probability_below_threshold():
    policy = Confidence()  # threshold 0.4
    assert policy.decide(step(1, torch.tensor([0.39, 0.31, 0.3]))) is STOP
    assert policy.decide(step(2, torch.tensor([0.41, 0.3, 0.29]))) is CONTINUE
    assert Confidence(threshold=0.5).decide(step(1, torch.tensor([0.5, 0.25, 0.25]))) is CONTINUE  # not below
    assert Confidence(threshold=0.3).decide(step(1, UNIFORM_4)) is STOP
    assert Confidence(threshold=0.2).decide(step(1, UNIFORM_4)) is CONTINUE
    assert Confidence(threshold=0.3, max_candidates=7).round_limit() == 7


# ------------------------------------------------------------------------------------------------
# specdec++


def test_specdec_pp_stops_once_predicted_rejection_exceeds_threshold():
    """Each candidate is accepted with probability 0.9: after i - 1 hidden states the predicted
    rejection is 1 - 0.9^(i-1) = 0, 0.1, 0.19, 0.271, 0.344: the round stops at step 5 for h = 0.3."""
    policy = SpecDecPP(constant_head(0.9), threshold=0.3)
    for _ in range(2):  # the product restarts every round
        policy.start_round()
        decisions = [policy.decide(step(i)) for i in range(1, 6)]
        assert decisions == [CONTINUE] * 4 + [STOP]


def test_specdec_pp_first_step_never_stops():
    """Step 1 has no hidden state (e_0 does not exist): even a head predicting 1% acceptance cannot
    stop it; step 2 reads e_1 and stops."""
    policy = SpecDecPP(constant_head(0.01), threshold=0.05)
    policy.start_round()
    assert policy.decide(step(1, hidden=None)) is CONTINUE
    assert policy.decide(step(2)) is STOP


def test_specdec_pp_reads_the_hidden_state():
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="test"))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.weight[0, 0] = 1.0  # logit = e[0]
        head.out.bias.zero_()
    policy = SpecDecPP(head.eval(), threshold=0.5)
    confident, doubtful = torch.zeros(HIDDEN), torch.zeros(HIDDEN)
    confident[0], doubtful[0] = math.log(0.9 / 0.1), math.log(0.4 / 0.6)
    policy.start_round()
    assert policy.decide(step(1)) is CONTINUE
    assert policy.decide(step(2, hidden=confident)) is CONTINUE  # 1 - 0.9 = 0.1
    assert policy.decide(step(3, hidden=confident)) is CONTINUE  # 1 - 0.81 = 0.19
    assert policy.decide(step(4, hidden=doubtful)) is STOP  # 1 - 0.81 * 0.4 = 0.676


# ------------------------------------------------------------------------------------------------
# oracle


def test_oracle_drops_the_first_disagreement():
    policy = Oracle(reference=[5, 6, 7, 8, 9])
    # two tokens generated already: candidate i is reference position 2 + i - 1
    assert policy.decide(step(1, token=7, num_generated=2)) is CONTINUE
    assert policy.decide(step(2, token=8, num_generated=2)) is CONTINUE
    assert policy.decide(step(3, token=1, num_generated=2)) is DROP_LAST
    assert policy.decide(step(1, token=5, num_generated=0)) is CONTINUE
    assert policy.decide(step(1, token=6, num_generated=0)) is DROP_LAST


def test_oracle_drops_candidates_past_the_reference():
    policy = Oracle(reference=[5, 6, 7])
    assert policy.decide(step(1, token=7, num_generated=2)) is CONTINUE
    assert policy.decide(step(2, token=7, num_generated=2)) is DROP_LAST
    assert policy.decide(step(1, token=5, num_generated=3)) is DROP_LAST


# ------------------------------------------------------------------------------------------------
# make_policy / resolve_policy


def test_make_policy_builds_each_policy_with_its_flags():
    head = constant_head(0.5)
    built = {name: make_policy(PolicyConfig(name=name), head=head, reference=[1, 2]) for name in POLICY_NAMES}
    assert {name: policy.name for name, policy in built.items()} == {name: name for name in POLICY_NAMES}
    assert make_policy(PolicyConfig(name="fixed", k=6)).round_limit() == 6
    assert make_policy(PolicyConfig(name="heuristic", k=2)).round_limit() == 2
    svip = make_policy(PolicyConfig(name="svip", k=7, threshold=0.2))
    assert (svip.max_candidates, svip.threshold) == (7, 0.2)
    confidence = make_policy(PolicyConfig(name="confidence", k=5, threshold=0.6))
    assert (confidence.max_candidates, confidence.threshold) == (5, 0.6)
    specdec = make_policy(PolicyConfig(name="specdec++", k=9, threshold=0.3), head=head)
    assert (specdec.max_candidates, specdec.threshold, specdec.head) == (9, 0.3, head)
    assert make_policy(PolicyConfig(name="oracle", k=4), reference=[1]).round_limit() == 4


def test_make_policy_returns_a_fresh_instance_per_sequence():
    config = PolicyConfig(name="heuristic", k=3)
    first = make_policy(config)
    first.end_round(3, 3)
    assert make_policy(config).round_limit() == 3


BAD_CONFIGS = [
    (PolicyConfig(name="medusa"), "unknown policy 'medusa'"),
    (PolicyConfig(name="svip", threshold=0.0), "threshold"),
    (PolicyConfig(name="svip", threshold=1.0), "threshold"),
    (PolicyConfig(name="confidence", threshold=1.5), "threshold"),
    (PolicyConfig(name="specdec++", threshold=-0.2), "threshold"),
    (PolicyConfig(name="fixed", k=0), "k must be at least 1"),
    (PolicyConfig(name="svip", k=-3), "k must be at least 1"),
    (PolicyConfig(name="heuristic", k=0), "k must be at least 1"),
    (PolicyConfig(name="target-only", k=5), "policy 'target-only' drafts nothing: k does not apply"),
    (PolicyConfig(name="fixed", threshold=0.5), "policy 'fixed' reads no threshold (those that do: specdec++, svip"),
    (PolicyConfig(threshold=0.3), "policy 'specdec++cost' (the default) reads no threshold"),  # (it was ignored)
]


def test_resolve_policy_accepts_good_configs():
    for name in POLICY_NAMES:
        traits = policy_traits(name)
        resolve_policy(PolicyConfig(name=name, k=3 if traits.uses_draft else None,
                                    threshold=0.5 if traits.reads_threshold else None), has_head=True)
    assert [name for name in POLICY_NAMES if policy_traits(name).reads_threshold] == ["specdec++", "svip", "confidence"]
    resolve_policy(PolicyConfig(), has_head=False)


@pytest.mark.parametrize("config,fragment", BAD_CONFIGS)
def test_resolve_policy_errors_are_one_line(config, fragment):
    with pytest.raises(InvalidRequestError) as info:
        resolve_policy(config, has_head=True)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_resolve_policy_needs_a_head_for_specdec_pp():
    with pytest.raises(InvalidRequestError, match="needs an acceptance head") as info:
        resolve_policy(PolicyConfig(name="specdec++"), has_head=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config,fragment", BAD_CONFIGS)
def test_make_policy_errors_are_one_line(config, fragment):
    with pytest.raises(InvalidRequestError) as info:
        make_policy(config, head=constant_head(0.5), reference=[1, 2])
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config,fragment", [
    (PolicyConfig(name="specdec++"), "head"),
    (PolicyConfig(name="oracle"), "greedy continuation"),
])
def test_make_policy_needs_head_or_reference(config, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        make_policy(config)
    assert "\n" not in str(info.value)


def test_policy_constructors_validate_directly():
    with pytest.raises(InvalidRequestError):
        Heuristic(k=3, max_candidates=0)
    with pytest.raises(InvalidRequestError):
        Oracle(reference=[1], max_candidates=0)
    with pytest.raises(InvalidRequestError):
        SpecDecPP(constant_head(0.5), threshold=1.0)


def test_a_request_without_a_policy_gets_specdecpp_cost_with_a_head_and_svip_without():
    assert resolve_policy(PolicyConfig(), has_head=True).name == "specdec++cost"
    assert resolve_policy(PolicyConfig(), has_head=False).name == "svip"
    assert resolve_policy(PolicyConfig(name="fixed", k=3), has_head=True) == PolicyConfig(name="fixed", k=3)
    assert isinstance(make_policy(PolicyConfig(), head=constant_head(0.9)), SpecDecPPCost)
    assert isinstance(make_policy(PolicyConfig()), SVIP)


def test_specdecpp_takes_the_threshold_its_head_records():
    head = constant_head(0.9)
    assert make_policy(PolicyConfig(name="specdec++"), head=head).threshold == SpecDecPP.DEFAULT_THRESHOLD
    head.config.threshold = 0.3
    assert make_policy(PolicyConfig(name="specdec++"), head=head).threshold == 0.3
    assert make_policy(PolicyConfig(name="specdec++", threshold=0.5), head=head).threshold == 0.5  # the request wins


@pytest.mark.parametrize("gamma", [0.0, -0.15, math.nan, math.inf])
def test_svip_built_directly_refuses_a_gamma_it_cannot_stop_on(gamma):
    """No request sets gamma, but the engine as a library builds SVIP itself: a negative gamma raised
    ValueError mid-round (the square root of a negative), 0 and NaN never stopped on the entropy."""
    with pytest.raises(InvalidRequestError, match=rf"^gamma must be positive and finite, got {gamma}$") as info:
        SVIP(gamma=gamma)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config,build", [
    (PolicyConfig(name="svip", threshold=1.5), lambda: SVIP(threshold=1.5)),
    (PolicyConfig(name="confidence", threshold=0.0), lambda: Confidence(threshold=0.0)),
    (PolicyConfig(name="specdec++", threshold=math.nan), lambda: SpecDecPP(constant_head(0.5), threshold=math.nan)),
    (PolicyConfig(name="fixed", k=0), lambda: FixedK(0)),
    (PolicyConfig(name="svip", k=-3), lambda: SVIP(max_candidates=-3)),
])
def test_a_request_and_a_policy_built_directly_are_refused_by_one_rule(config, build):
    """A request's flags (resolve_policy) and a policy built as a library (its constructor) are checked
    by the same rule (policies/base.py), so they are refused in the same words."""
    with pytest.raises(InvalidRequestError) as request:
        resolve_policy(config, has_head=True)
    with pytest.raises(InvalidRequestError) as built:
        build()
    assert str(request.value) == str(built.value)
