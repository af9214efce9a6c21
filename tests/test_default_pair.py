"""The real default pair (Qwen2.5-Coder 0.5B -> 1.5B) on HumanEval prompts, on both runtimes.
Minutes on CPU; run with `python -m pytest -m slow --run-slow`.

On llama.cpp a token's logits depend slightly on how many tokens share its pass (its kernels differ
by batch size; docs/performance.md), so a verification pass can pick another token than one-token
decoding where the target's top two are nearly tied. There, speculative output must equal
target-only output up to its first difference, and that difference must sit at a near-tie of the
target-only pass."""

import pytest

from specdec.bench.runner import first_divergence
from specdec.builder import DEFAULT_DRAFT_QUANT
from specdec.cost_profile import CostProfile
from specdec.params import build_params
from specdec.policies import policy_traits, resolve_policy
from specdec.prompts import humaneval_prompts

pytestmark = pytest.mark.slow

NUM_PROMPTS, NEW_TOKENS = 3, 48


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def default_engine(request):
    from specdec.builder import EngineConfig, build_engine

    return build_engine(EngineConfig(runtime=request.param), progress=False)


def assert_equals_target_only(engine, prompt_ids: list[int], got: list[int], expected: list[int], what=""):
    if got == expected or engine.target.kind != "llamacpp":
        assert got == expected, what
        return
    divergence = first_divergence(engine.target, list(prompt_ids), expected, got)  # what `specdec bench` reports
    assert divergence["near_tie"], f"{what}: differs at token {divergence['position']}, not a near-tie: {divergence}"


@pytest.fixture(scope="module")
def target_greedy(default_engine):
    params = build_params(policy="target-only", max_new_tokens=NEW_TOKENS)
    return [default_engine.generate(p, params).completions[0].token_ids for p in humaneval_prompts(NUM_PROMPTS)]


# Costs under which drafting clearly pays (a GPU's shape: a draft step 5% of a target pass, 8 tokens
# verified for 1.2 passes): a budgeted policy given it drafts, so its drafting path runs on the pair.
DRAFTING_PAYS = CostProfile(t_draft_ms=5.0, t_target_ms={1: 100.0, 2: 104.0, 8: 120.0, 21: 160.0})


@pytest.mark.parametrize("flags", [{"policy": "fixed", "k": 4}, {"policy": "svip"}, {"policy": "confidence"},
                                   {"policy": "heuristic"}, {"policy": "oracle"}, {"policy": "specdec++"},
                                   {"policy": "specdec++cost"}, {}],
                         ids=lambda f: f.get("policy", "default"))
def test_greedy_equals_target_only(default_engine, target_greedy, flags, monkeypatch, tmp_path):
    """Budgeted policies (the default) plan with DRAFTING_PAYS given by hand: with the costs this
    CPU measures they may rightly keep the draft off (test_budgeted_policy_on_measured_costs)."""
    params = build_params(max_new_tokens=NEW_TOKENS, **flags)
    if policy_traits(resolve_policy(params.policy, default_engine.rules.drafts["default"].has_head).name).budgeted:
        for planner in default_engine.loop.planners:
            monkeypatch.setattr(planner, "given", DRAFTING_PAYS)
    for prompt, expected in zip(humaneval_prompts(NUM_PROMPTS), target_greedy):
        result = default_engine.generate(prompt, params)
        assert_equals_target_only(default_engine, default_engine.encode_prompt(prompt), result.completions[0].token_ids,
                                  expected, str(flags))
        assert result.stats.accepted_tokens > 0  # the pair agrees often: speculation does something


def test_budgeted_policy_on_measured_costs(default_engine, target_greedy, monkeypatch):
    """The default policy planning with the costs the loop measures on this machine (it drafts or
    not, as they say: on llama.cpp on the AMD EPYC it does not) decodes as target-only does, and
    its loop has measured both roles."""
    assert all(planner.given is None for planner in default_engine.loop.planners)
    params = build_params(max_new_tokens=NEW_TOKENS)
    for prompt, expected in zip(humaneval_prompts(NUM_PROMPTS), target_greedy):
        result = default_engine.generate(prompt, params)
        assert_equals_target_only(default_engine, default_engine.encode_prompt(prompt), result.completions[0].token_ids,
                                  expected, "measured costs")
    profile = default_engine.cost_profile()
    assert profile is not None and profile.t_draft_ms > 0 and profile.pass_ms(1) > 0


def test_default_engine_loads_the_shipped_head_and_defaults_to_specdecpp_cost(default_engine):
    head = default_engine.head
    assert head is not None and head.config.threshold is not None  # --head auto: specdec/heads/default-pair
    assert resolve_policy(build_params(max_new_tokens=1).policy, default_engine.rules.drafts["default"].has_head).name == "specdec++cost"
    if default_engine.draft.kind == "llamacpp":  # the draft requantized for the fast kernels, which the head serves
        assert default_engine.draft.identity.endswith(f"+{DEFAULT_DRAFT_QUANT}")
        assert default_engine.draft.identity != head.config.draft_identity and head.config.serves(default_engine.draft.identity)


def test_default_pair_shares_vocabulary(default_engine):
    assert default_engine.draft.vocab_size == default_engine.target.vocab_size == 151936
    assert default_engine.eos_token_ids


def test_batched_sessions_equal_target_only_whatever_shares_the_batch(default_engine, target_greedy):
    """Every prompt under three policies, and target-only itself, all in one batch: nine sessions of
    different K share every draft step and verification pass, three more decode alone-style beside
    them. Each equals target-only greedy decoding of its prompt, one session at a time."""
    prompts = [default_engine.encode_prompt(p) for p in humaneval_prompts(NUM_PROMPTS)]
    policies = [{"policy": "fixed", "k": 4}, {"policy": "svip"}, {"policy": "specdec++"}, {"policy": "target-only"}]
    requests = [(ids, build_params(max_new_tokens=NEW_TOKENS, **flags)) for flags in policies for ids in prompts]
    passes = default_engine.target.forward_passes
    results = default_engine.generate_many([ids for ids, _ in requests], [params for _, params in requests])
    rounds = sum(r.stats.rounds for r in results)
    assert default_engine.target.forward_passes - passes < rounds / 4  # the sessions shared passes
    for i, result in enumerate(results):
        assert_equals_target_only(default_engine, requests[i][0], result.completions[0].token_ids,
                                  target_greedy[i % NUM_PROMPTS], str(requests[i][1].policy))


@pytest.fixture(scope="module")
def feature_engine():
    """The feature draft shipped in the package (specdec/drafts/default-feature) on the default target."""
    from specdec.builder import EngineConfig, build_engine

    return build_engine(EngineConfig(draft="default-feature"), progress=False)


@pytest.mark.parametrize("flags", [{"policy": "fixed", "k": 4}, {"policy": "svip"}, {}],
                         ids=lambda f: f.get("policy", "default"))
def test_the_shipped_feature_draft_equals_target_only(feature_engine, flags, monkeypatch):
    """The shipped feature draft reads the torch target's states and drafts what it predicts: greedy
    output equal to target-only's, with candidates accepted (the default policy plans with
    DRAFTING_PAYS, as above)."""
    assert feature_engine.draft.reads_features and feature_engine.target.kind == "torch"
    params = build_params(max_new_tokens=NEW_TOKENS, **flags)
    if policy_traits(resolve_policy(params.policy, feature_engine.rules.drafts["default"].has_head).name).budgeted:
        for planner in feature_engine.loop.planners:
            monkeypatch.setattr(planner, "given", DRAFTING_PAYS)
    target_only = build_params(policy="target-only", max_new_tokens=NEW_TOKENS)
    for prompt in humaneval_prompts(NUM_PROMPTS):
        expected = feature_engine.generate(prompt, target_only).completions[0].token_ids
        result = feature_engine.generate(prompt, params)
        assert result.completions[0].token_ids == expected, str(flags)
        assert result.stats.accepted_tokens > 0
