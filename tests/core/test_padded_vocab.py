"""A draft and target that share one tokenizer but whose embeddings differ in padding rows past its
last id (Qwen2.5's 0.5B: 151,936 rows, its 7B: 152,064, the tokenizer 151,665 ids): the builder fits
the draft to the target (models/vocab.py `shared_ids`, `widen_logits`; models/runtime.py
`DraftRole.fit_vocabulary`), which proposes no padding id and none the target lacks, and decoding stays
lossless. The draft's padding rows are large, so an unmasked one would be proposed."""

from __future__ import annotations

import pytest
import torch

from specdec.builder import EngineConfig, build_engine, build_rules
from specdec.engine import SpecDecEngine
from specdec.errors import IncompatibleModelsError
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.models.vocab import widen_logits
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from test_lossless import (SIGNIFICANCE, SAMPLES_PER_CASE, SAMPLINGS, counting_proposals, noisy_copy, policy_config,
                           prefix_counts, sample_completions, target_joint)
from stats import chi2_pvalue
from tiny import byte_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = len(byte_tokenizer())  # 259 ids
PAD_SCALE = 40.0  # the draft's padding rows (tied: its LM head's too): an unmasked one wins its argmax


def pad_rows(model, tokens: int, scale: float, seed: int):
    """The model's embedding (and tied LM head) rows from `tokens` on, random with norm ~`scale`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rows = model.model.embed_tokens.weight
        rows[tokens:] = scale * torch.randn(rows[tokens:].shape, generator=generator) / rows.shape[1] ** 0.5
    return model


def save_model(path, rows: int, hidden: int, layers: int, seed: int, pad_scale: float, tokenizer=None):
    tokenizer = tokenizer or byte_tokenizer()
    model = tiny_model(rows, hidden, layers, seed, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    pad_rows(model, TOKENS, pad_scale, seed + 100).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def padded_dirs(tmp_path_factory):
    """A target of 272 rows; drafts of 264 (fewer) and 280 (more) rows, their padding rows large."""
    root = tmp_path_factory.mktemp("padded")
    return {"target": save_model(root / "target", 272, 32, 2, 2, 1.0),
            "fewer": save_model(root / "fewer", 264, 16, 1, 1, PAD_SCALE),
            "more": save_model(root / "more", 280, 16, 1, 1, PAD_SCALE)}


@pytest.mark.parametrize("draft", ["fewer", "more"])
def test_greedy_output_of_a_padded_pair_equals_target_only(padded_dirs, draft, monkeypatch):
    engine = build_engine(EngineConfig(draft=str(padded_dirs[draft]), target=str(padded_dirs["target"]),
                                       head="none"), progress=False)
    assert engine.draft.vocab_size == engine.target.vocab_size == 272
    assert_greedy_equals_target_only(engine, monkeypatch, ([5, 72, 101, 108, 108, 111], list(range(40, 52))),
                                     (PolicyConfig(name="fixed", k=3), PolicyConfig(name="svip", threshold=0.5),
                                      PolicyConfig()), 24, TOKENS)


def assert_greedy_equals_target_only(engine, monkeypatch, prompts, policies, max_new_tokens: int, tokens: int):
    """Each policy's greedy output equals target-only's; the draft proposed, and only ids below `tokens`
    (neither its own padding rows nor an id the target lacks)."""
    proposed = counting_proposals(monkeypatch)
    for policy in policies:
        for prompt in prompts:
            got = engine.generate_ids(prompt, GenerationParams(max_new_tokens=max_new_tokens, policy=policy))
            want = engine.generate_ids(prompt, GenerationParams(max_new_tokens=max_new_tokens,
                                                                policy=PolicyConfig(name="target-only")))
            assert got.completions[0].token_ids == want.completions[0].token_ids, policy
    assert sum(proposed.values()) > 0
    assert max(proposed) < tokens


@pytest.mark.parametrize("draft", ["fewer", "more"])
def test_the_rules_accept_the_padded_pair_in_process_and_served(padded_dirs, draft):
    """The coordinator's rules, in process and as a served app's reads them (its replicas' devices,
    services/replicas.py `coordinator`), name the target's width, which a served draft replica fits
    its draft to (tests/services/test_round_services_padded.py)."""
    config = EngineConfig(draft=str(padded_dirs[draft]), target=str(padded_dirs["target"]), head="none")
    for devices in (None, {"target": "cpu", "draft": "cpu"}):
        rules = build_rules(config, progress=False, devices=devices)
        assert rules.vocab_size == 272 and len(rules.tokenizer) == TOKENS


def test_a_pair_whose_tokenizers_differ_is_refused_in_one_line(padded_dirs, tmp_path):
    """A draft whose byte tokens sit at other ids (shifted by one), with other padding rows too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    swapped = {text: (i + 1) % 256 if i < 256 else i for text, i in byte_tokenizer().get_vocab().items()}
    tok = Tokenizer(models.BPE(vocab={t: i for t, i in swapped.items() if i < 256}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    shifted = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    draft = save_model(tmp_path / "shifted", 264, 16, 1, 1, 1.0, tokenizer=shifted)
    config = EngineConfig(draft=str(draft), target=str(padded_dirs["target"]), head="none")
    for check in (lambda: build_rules(config, progress=False), lambda: build_engine(config, progress=False)):
        with pytest.raises(IncompatibleModelsError) as info:
            check()
        message = str(info.value)
        assert "\n" not in message and "tokenizers have different vocabularies" in message
        assert "264" not in message and "272" not in message  # not blamed on the padded sizes


def test_runtimes_of_other_widths_are_refused_unfitted():
    draft, target = tiny_model(9, 16, 1, seed=1), tiny_model(7, 16, 1, seed=2)
    with pytest.raises(IncompatibleModelsError, match="must be fitted"):
        SpecDecEngine(DraftRuntime(draft), TargetRuntime(target))


# ------------------------------------------------------------------------------------------------
# Sampled: the output follows the target's distribution (test_lossless.py's chi-squared test)

VOCAB_TOKENS, TARGET_ROWS = 5, 7  # a "tokenizer" of 5 ids; the target's 2 padding rows at normal size


def fitted_draft(model, target_rows: int, tokens: int) -> DraftRuntime:
    """A torch draft fitted as builder.py's build_draft does."""
    draft = DraftRuntime(model)
    draft.fit_vocabulary(target_rows, tokens)
    return draft


def padded_engine(draft_rows: int) -> SpecDecEngine:
    target = tiny_model(TARGET_ROWS, hidden_size=16, layers=1, seed=0, init_range=0.5)
    draft = tiny_model(draft_rows, hidden_size=16, layers=1, seed=0, init_range=0.5)
    with torch.no_grad():  # the target's weights, noisy (test_lossless's draft), its padding rows large
        noisy = noisy_copy(target, 0.1, 100)
        rows = min(draft_rows, TARGET_ROWS)
        for (name, mine), theirs in zip(draft.named_parameters(), noisy.parameters()):
            if name == "model.embed_tokens.weight":
                mine[:rows] = theirs[:rows]
            else:
                mine.copy_(theirs)
    pad_rows(draft, VOCAB_TOKENS, PAD_SCALE, seed=5)
    return SpecDecEngine(fitted_draft(draft, TARGET_ROWS, VOCAB_TOKENS), TargetRuntime(target))


@pytest.mark.parametrize("draft_rows", [6, 9])
def test_sampled_output_of_a_padded_pair_follows_the_target(draft_rows, monkeypatch):
    engine = padded_engine(draft_rows)
    proposed = counting_proposals(monkeypatch)
    sampling = SAMPLINGS["temperature-1"]
    completions, stats = sample_completions(engine, policy_config("fixed", "temperature-1"), sampling,
                                            SAMPLES_PER_CASE, seed=3000)
    assert max(proposed) < VOCAB_TOKENS and stats.accepted_tokens > 0 and stats.discarded_tokens > 0
    assert any(t >= VOCAB_TOKENS for ids in completions for t in ids)  # the target's padding ids, fed to the draft
    for length in (1, 2, 3):
        expected = target_joint(engine.target.model, [1, 3], sampling, length)
        pvalue = chi2_pvalue(prefix_counts(completions, length, TARGET_ROWS), expected)
        assert pvalue > SIGNIFICANCE, f"first {length} token(s): chi-squared p = {pvalue:.2e}"


# ------------------------------------------------------------------------------------------------
# llama.cpp's draft: its logits masked and widened in the runtime (no GGUFs of two sizes here)

def test_a_runtime_fitted_by_its_logits_masks_and_widens_them():
    """`DraftRole.fit_vocabulary`, the path every runtime's draft takes, on a torch draft: its own
    9-wide logits come out 7 wide, -inf from the 5th id on; a history's id past a 6-row draft's rows
    is fed as 0."""
    logits = torch.arange(9.0).repeat(2, 1)
    widened = widen_logits(logits, 5, 7)
    assert widened.shape == (2, 7) and torch.equal(widened[:, :5], logits[:, :5])
    assert torch.isinf(widened[:, 5:]).all()
    assert widen_logits(logits[:, :4], 4, 7).shape == (2, 7)

    more = DraftRuntime(pad_rows(tiny_model(9, 16, 1, seed=1), VOCAB_TOKENS, PAD_SCALE, seed=3))
    more.fit_vocabulary(TARGET_ROWS, VOCAB_TOKENS)
    out = more.start([more.new_session()], [[1, 2, 3]])
    assert more.vocab_size == TARGET_ROWS and out.logits.shape == (1, TARGET_ROWS)
    assert torch.isinf(out.logits[0, VOCAB_TOKENS:]).all() and torch.isfinite(out.logits[0, :VOCAB_TOKENS]).all()

    fewer = DraftRuntime(tiny_model(6, 16, 1, seed=1))
    fewer.fit_vocabulary(TARGET_ROWS, VOCAB_TOKENS)
    session = fewer.new_session()
    out = fewer.start([session], [[1, 6, 2]])  # 6: a padding id of the target's, which the draft lacks
    assert session.tokens == [1, 0, 2] and out.logits.shape == (1, TARGET_ROWS)

