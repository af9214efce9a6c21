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
