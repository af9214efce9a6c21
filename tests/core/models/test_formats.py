"""Weight formats per role (specdec/models/formats.py) on tiny models."""

from __future__ import annotations

import pytest
import torch

from specdec.builder import EngineConfig, build_engine, load_model
from specdec.models.formats import apply_weight_format, resolve_format
from specdec.models.runtime import CausalLMRuntime, DraftRuntime, Feed
from specdec.params import build_params

PROMPT = "def add(a, b):"


def test_auto_is_int8_for_the_draft_and_exact_onednn_for_the_target():
    assert resolve_format("draft") == "int8"
    assert resolve_format("target") == "onednn"
    assert resolve_format("target", "int8") == "int8"


def test_an_unknown_format_is_refused(tiny_pair):
    model = load_model(tiny_pair[1], "target", "fp32", progress=False)
    with pytest.raises(ValueError, match="unknown weight format 'fp8'"):
        apply_weight_format(model, "target", "fp8")


def test_onednn_computes_the_fp32_model(tiny_pair):
    tokens = list(range(40, 60))
    logits = {}
    for fmt in ("fp32", "onednn"):
        runtime = CausalLMRuntime(load_model(tiny_pair[1], "target", fmt, progress=False))
        [(logits[fmt], _)] = runtime._forward([Feed(runtime.new_session(), tokens, len(tokens))])
    torch.testing.assert_close(logits["onednn"], logits["fp32"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["onednn", "int8"])
def test_draft_formats_hand_fp32_to_sampling_and_the_head(tiny_pair, fmt):
    draft = DraftRuntime(load_model(tiny_pair[0], "draft", fmt, progress=False))
    [out] = draft.start([draft.new_session()], [list(range(40, 60))])
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.float32
    assert out.logits.shape == (draft.vocab_size,) and out.hidden.shape == (draft.hidden_size,)


@pytest.mark.parametrize("fmt", ["onednn", "int8"])
def test_any_draft_format_keeps_greedy_output_the_targets(tiny_pair, fmt):
    draft, target = (str(path) for path in tiny_pair)
    exact = build_engine(EngineConfig(draft=draft, target=target, draft_format="fp32"), progress=False)
    lossy = build_engine(EngineConfig(draft=draft, target=target, draft_format=fmt), progress=False)
    params = build_params(policy="fixed", k=4, temperature=0.0, max_new_tokens=24)
    reference = exact.generate(PROMPT, build_params(policy="target-only", temperature=0.0, max_new_tokens=24))
    assert lossy.generate(PROMPT, params).completions[0].token_ids == reference.completions[0].token_ids


def test_int8_scales_weights_per_output_channel(tiny_pair):
    model = load_model(tiny_pair[0], "draft", "int8", progress=False)
    linear = model.model.layers[0].mlp.down_proj
    assert linear.weight().qscheme() == torch.per_channel_affine


@pytest.mark.parametrize("kv", ["slots", "reference"])
def test_int8_feeds_a_sessions_first_token_in_a_pass_of_its_own(tiny_pair, kv):
    """One activation scale per pass: the first token (the attention sink) must not set the scale of
    the rest of the prompt, nor of other sessions' tokens sharing the pass."""
    model = load_model(tiny_pair[0], "draft", "int8", progress=False)
    runtime = CausalLMRuntime(model, kv=kv)
    assert runtime.first_token_alone
    prompt = list(range(40, 60))
    session = runtime.new_session()
    [(logits, hidden)] = runtime._forward([Feed(session, prompt, 1)])
    assert runtime.forward_passes == 2 and session.tokens == prompt

    by_hand = CausalLMRuntime(model, kv=kv)
    by_hand.first_token_alone = False
    manual = by_hand.new_session()
    by_hand._forward([Feed(manual, prompt[:1], 1)])
    [(expected, _)] = by_hand._forward([Feed(manual, prompt[1:], 1)])
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert hidden.shape == (1, runtime.hidden_size)


def test_only_weights_with_a_per_pass_scale_split_the_first_token(tiny_pair):
    runtime = CausalLMRuntime(load_model(tiny_pair[0], "draft", "onednn", progress=False))
    assert not runtime.first_token_alone
    runtime._forward([Feed(runtime.new_session(), list(range(40, 60)), 1)])
    assert runtime.forward_passes == 1


def test_a_feed_that_needs_the_first_tokens_output_keeps_it(tiny_pair):
    runtime = CausalLMRuntime(load_model(tiny_pair[1], "target", "int8", progress=False))
    session = runtime.new_session()
    [(logits, _)] = runtime._forward([Feed(session, [40, 41], 2)])
    assert logits.shape[0] == 2 and runtime.forward_passes == 1
