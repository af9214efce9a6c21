"""The feature draft's model: training's unrolled steps are what a session computes when it drafts,
chain attention is the cache a drafting session holds, and the files round-trip on the target."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.models.feature_draft import (FUSED, OUTPUT_STATE, DraftFeed, FeatureDraft, FeatureDraftConfig,
                                          chain_attention, layer_config_of)
from specdec.models.feature_files import load_feature_draft, read_config, save_feature_draft, target_tensors

HIDDEN, VOCAB = 32, 50


def tiny_draft(inputs=FUSED, seed=0) -> FeatureDraft:
    target = Qwen2Config(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0)
    config = FeatureDraftConfig(target_identity="tiny", inputs=inputs, layers=[0, 1, 2] if inputs == FUSED else [],
                                layer_config=layer_config_of(target, 48), vocab_size=VOCAB)
    torch.manual_seed(seed)
    vocab_ids = torch.arange(0, VOCAB, 2)
    return FeatureDraft(config, torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)[vocab_ids], vocab_ids).eval()


@pytest.mark.parametrize("inputs", [FUSED, OUTPUT_STATE])
def test_unrolled_steps_are_what_a_drafting_session_computes(inputs):
    """Step 1 at t from the target's features 0..t in a session's cache, then steps 2..4 feeding the
    draft's own state and the next token, one position at a time: equal to `unroll` at every t."""
    model = tiny_draft(inputs)
    B, T, steps = 2, 10, 4
    states = torch.randn(B, T, model.config.reads, HIDDEN)
    tokens = torch.randint(0, VOCAB, (B, T))
    with torch.no_grad():
        outs = model.unroll(states, tokens, steps)
        for b in range(B):
            for t in range(T - steps + 1):
                session = model.new_session()
                state = model.forward_feeds([DraftFeed(session, model.feature(states[b, :t + 1]),
                                                       tokens[b, :t + 1].tolist())])[-1]
                torch.testing.assert_close(state, outs[0][b, t], atol=1e-4, rtol=1e-4)
                for j in range(2, steps + 1):
                    p = t + j - 1
                    state = model.forward_feeds([DraftFeed(session, state[None], [int(tokens[b, p])])])[-1]
                    torch.testing.assert_close(state, outs[j - 1][b, p], atol=1e-4, rtol=1e-4)


def test_a_ragged_pass_serves_sessions_as_one_pass_each():
    model = tiny_draft()
    g = torch.randn(7, HIDDEN)
    with torch.no_grad():
        alone = [model.forward_feeds([DraftFeed(model.new_session(), g[:4], [1, 2, 3, 4])]),
                 model.forward_feeds([DraftFeed(model.new_session(), g[4:], [5, 6, 7])])]
        together = model.forward_feeds([DraftFeed(model.new_session(), g[:4], [1, 2, 3, 4]),
                                        DraftFeed(model.new_session(), g[4:], [5, 6, 7])])
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_rollback_forgets_drafted_positions():
    model = tiny_draft()
    g = torch.randn(6, HIDDEN)
    with torch.no_grad():
        session = model.new_session()
        model.forward_feeds([DraftFeed(session, g[:3], [1, 2, 3])])
        model.forward_feeds([DraftFeed(session, g[3:5], [9, 9])])  # drafted, then rejected
        model.rollback(session, 3)
        again = model.forward_feeds([DraftFeed(session, g[5:], [4])])
        fresh = model.forward_feeds([DraftFeed(model.new_session(), torch.cat([g[:3], g[5:]]), [1, 2, 3, 4])])
    torch.testing.assert_close(again[-1], fresh[-1], atol=1e-5, rtol=1e-5)


def test_chain_attention_against_its_definition():
    """Step j's query at p: softmax over step-1 keys 0..p-j+1 and step i's key at p-j+i, written out."""
    torch.manual_seed(3)
    B, heads, kv, T, D, j = 1, 4, 2, 6, 8, 3
    q = torch.randn(B, heads, T, D)
    keys = [torch.randn(B, kv, T, D) for _ in range(j)]
    values = [torch.randn(B, kv, T, D) for _ in range(j)]
    out = chain_attention(q, keys, values, 0.5)
    for p in range(j - 1, T):
        for h in range(heads):
            g = h // (heads // kv)
            ks = [keys[0][0, g, s] for s in range(p - j + 2)] + [keys[i - 1][0, g, p - j + i] for i in range(2, j + 1)]
            vs = [values[0][0, g, s] for s in range(p - j + 2)] + [values[i - 1][0, g, p - j + i] for i in range(2, j + 1)]
            w = torch.softmax(torch.stack([q[0, h, p] @ k for k in ks]) * 0.5, dim=0)
            torch.testing.assert_close(out[0, h, p], sum(wi * v for wi, v in zip(w, vs)), atol=1e-5, rtol=1e-5)


def test_ids_outside_the_trimmed_vocabulary_get_no_mass():
    model = tiny_draft()
    with torch.no_grad():
        probs = torch.softmax(model.full_logits(torch.randn(3, HIDDEN)), dim=-1)
    assert probs.shape == (3, VOCAB)
    assert torch.all(probs[:, 1::2] == 0) and torch.allclose(probs.sum(-1), torch.ones(3))


def test_saved_draft_loads_on_its_target_only(tiny_pair, tmp_path):
    """The files hold the draft's own weights and the vocabulary; the embeddings and head rows come
    back from the target's files; another target is refused with one line."""
    from transformers import AutoConfig

    _, target_dir = tiny_pair
    target = AutoConfig.from_pretrained(target_dir)
    vocab_ids = torch.tensor([3, 5, 8, 100, 200])
    embed, head = target_tensors(target_dir, vocab_ids)
    config = FeatureDraftConfig(target_identity="tiny-target", layers=[0, 1], vocab_size=target.vocab_size,
                                layer_config=layer_config_of(target))
    model = FeatureDraft(config, embed, head, vocab_ids).eval()
    save_feature_draft(model, tmp_path / "draft", dtype=torch.float32)
    saved = set(__import__("safetensors").safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt").keys())
    assert "vocab_ids" in saved and "lm_head.weight" not in saved and "embed" not in saved
    loaded = load_feature_draft(tmp_path / "draft", target_dir, "tiny-target")
    assert read_config(tmp_path / "draft").layers == [0, 1]
    states, tokens = torch.randn(1, 5, 2, target.hidden_size), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded.unroll(states, tokens, 2)[1], model.unroll(states, tokens, 2)[1])
    with pytest.raises(IncompatibleModelsError, match="trained on another target"):
        load_feature_draft(tmp_path / "draft", target_dir, "another")
    with pytest.raises(ModelSourceError, match="no feature draft"):
        read_config(tmp_path / "nothing")


def test_the_runtime_times_probes_of_scratch_sessions():
    """The workers' probes run on scratch sessions without the target's states (zeros stand in), a
    history of one token included (an off-probe's): every size gets a timing; a real session
    without states does not draft (`can_draft`)."""
    from specdec.models.feature_runtime import FeatureDraftRuntime
    from specdec.policies import PolicyConfig, make_policy
    from specdec.workers import probe_catch_up, probe_drafting

    runtime = FeatureDraftRuntime(tiny_draft())
    policy = lambda: make_policy(PolicyConfig(name="fixed", k=1))  # noqa: E731
    for context in (0, 2):
        timings = probe_drafting(runtime, (1, 2), policy, context=context)
        assert [t.tokens for t in timings] == [1, 2] and all(t.ms > 0 for t in timings)
    assert probe_catch_up(runtime, tokens=8)
    session = runtime.new_session()
    assert not runtime.can_draft(session, [1, 2, 3])
    runtime.add_features(session, torch.randn(2, runtime.model.config.reads, HIDDEN), 0)
    assert runtime.can_draft(session, [1, 2, 3]) and not runtime.can_draft(session, [1, 2, 3, 4])


def test_on_cuda_the_probes_run_each_size_once_untimed_first(monkeypatch):
    """A pass of a new size on CUDA pays set-up (kernels loaded, cuBLAS choosing) many times its
    cost: the workers' probes run each size once untimed first where the runtime says so, the
    feature draft's as the target's."""
    from specdec.models.feature_runtime import FeatureDraftRuntime

    runtime = FeatureDraftRuntime(tiny_draft())
    assert not runtime.sets_up_per_shape
    monkeypatch.setattr(FeatureDraftRuntime, "device", property(lambda self: torch.device("cuda")))
    assert runtime.sets_up_per_shape


def test_the_runtimes_scores_carry_no_autograd_graph():
    """A drafting step's scores and states are plain numbers to the policies: serving builds no
    graph behind them (the trainable norms would otherwise record one every step)."""
    from specdec.models.feature_runtime import FeatureDraftRuntime

    runtime = FeatureDraftRuntime(tiny_draft())
    session = runtime.new_session()
    runtime.add_features(session, torch.randn(3, runtime.model.config.reads, HIDDEN), 0)
    outputs = runtime.start([session], [[1, 2, 3, 4]])
    assert not outputs.logits.requires_grad and not outputs.hidden.requires_grad
    assert not runtime.step([session], [5]).logits.requires_grad


def test_a_bfloat16_draft_takes_the_targets_states_in_its_own_dtype():
    """On a GPU both models run in bfloat16 (`--dtype auto`): the states every verification hands the
    draft are taken in the draft's dtype, and its rounds draft (cast to float32 instead, every
    Propose that carried states failed there: 'expected mat1 and mat2 to have the same dtype')."""
    from specdec.engine import SpecDecEngine
    from specdec.models.feature_runtime import FeatureDraftRuntime
    from specdec.models.runtime import TargetRuntime
    from specdec.params import GenerationParams
    from specdec.policies import PolicyConfig
    from tiny import tiny_feature_draft, tiny_model

    target = tiny_model(8, hidden_size=16, layers=2, seed=3, init_range=0.5).to(torch.bfloat16)
    draft = tiny_feature_draft(target, seed=1).to(torch.bfloat16)
    engine = SpecDecEngine(FeatureDraftRuntime(draft), TargetRuntime(target))
    params = GenerationParams(max_new_tokens=12, chat_template=False, policy=PolicyConfig(name="fixed", k=3))
    result = engine.generate_ids([1, 2, 3, 4], params)
    assert result.completions[0].finish_reason == "length" and result.stats.draft_tokens > 0


def _edited_copy(source, target, edit):
    import shutil

    shutil.copytree(source, target)
    edit(target)
    return target


def _edit_config(**changes):
    import json

    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if key == "hidden_size":
                config["layer_config"]["hidden_size"] = value
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def _drop_vocab_ids(directory):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    weights.pop("vocab_ids")
    save_file(weights, str(directory / "model.safetensors"))


BROKEN_FEATURE_DRAFTS = {  # found by a bug hunt: each was a traceback (or a misleading reason) after the target loaded
    "no weights": (lambda d: (d / "model.safetensors").unlink(), ModelSourceError, "cannot load the feature draft's weights"),
    "weights cut short": (lambda d: open(d / "model.safetensors", "r+b").truncate(200), ModelSourceError,
                          "cannot load the feature draft's weights"),
    "no vocabulary": (_drop_vocab_ids, ModelSourceError, "no 'vocab_ids' tensor"),
    "layers past the target's": (_edit_config(layers=[0, 7]), IncompatibleModelsError, r"reads layers \[0, 7\]; its target has 2"),
    "another width": (_edit_config(hidden_size=64), IncompatibleModelsError, "is 64 wide; its target's states are"),
    "unknown inputs": (_edit_config(inputs="nonsense"), ModelSourceError, "inputs: Input should be 'fused' or 'output'"),
}


@pytest.mark.parametrize("case", BROKEN_FEATURE_DRAFTS)
def test_a_broken_feature_draft_is_one_line(case, tiny_pair, tmp_path):
    from transformers import AutoConfig

    _, target_dir = tiny_pair
    target = AutoConfig.from_pretrained(target_dir)
    vocab_ids = torch.tensor([3, 5, 8])
    config = FeatureDraftConfig(target_identity="tiny-target", layers=[0, 1], vocab_size=target.vocab_size,
                                layer_config=layer_config_of(target))
    save_feature_draft(FeatureDraft(config, *target_tensors(target_dir, vocab_ids), vocab_ids), tmp_path / "good",
                       dtype=torch.float32)
    edit, error, reason = BROKEN_FEATURE_DRAFTS[case]
    broken = _edited_copy(tmp_path / "good", tmp_path / "broken", edit)
    with pytest.raises(error, match=reason) as info:
        load_feature_draft(broken, target_dir, "tiny-target")
    assert "\n" not in str(info.value)
