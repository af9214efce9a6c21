"""A trimmed draft vocabulary: the head scores only the kept ids and everything else gets q = 0."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast

from specdec.builder import EngineConfig, build_engine
from specdec.errors import ModelSourceError
from specdec.models.formats import apply_weight_format
from specdec.models.vocab import (TrimmedLMHead, ascii_token_ids, check_draft_vocab, is_byte_token, resolve_draft_vocab,
                                  trim_lm_head, vocab_setting)
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from tiny import tiny_model


NON_ASCII_SPECIAL, NON_ASCII_ADDED = "<｜end▁of▁sentence｜>", "«sep»"


def merged_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with two merges, "ab" (ASCII) and "é" (two bytes, not ASCII), an ASCII and a
    non-ASCII special token and a non-ASCII added (not special) token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["ab"], vocab["Ã©"] = len(vocab), len(vocab) + 1  # "Ã©" is "é" in byte-level symbols
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("Ã", "©")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>", NON_ASCII_SPECIAL])
    tok.add_tokens([NON_ASCII_ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def test_trimmed_head_scores_kept_ids_exactly_and_masks_the_rest():
    lm_head = nn.Linear(8, 10, bias=False)
    keep = torch.tensor([0, 3, 4, 9])
    trimmed = TrimmedLMHead(lm_head, keep)
    hidden = torch.randn(3, 8)
    logits, full = trimmed(hidden), lm_head(hidden)

    assert logits.shape == (3, 10)
    torch.testing.assert_close(logits[:, keep], full[:, keep])
    dropped = [i for i in range(10) if i not in keep.tolist()]
    assert torch.isneginf(logits[:, dropped]).all()
    assert torch.softmax(logits, -1)[:, dropped].sum() == 0  # q = 0 off the kept ids


def test_trimming_copies_a_tied_head_and_composes_with_int8():
    model = tiny_model(20, hidden_size=16, layers=1)
    embedding = model.model.embed_tokens.weight.detach().clone()
    trim_lm_head(model, [5, 1, 2, 2])
    assert model.lm_head.keep.tolist() == [1, 2, 5] and model.lm_head.proj.out_features == 3
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding)  # the input side stays whole

    model = apply_weight_format(model, "draft", "int8")  # the smaller matrix is the one quantized
    assert not isinstance(model.lm_head.proj, nn.Linear)
    logits = model(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert torch.isfinite(logits[[1, 2, 5]]).all() and torch.isneginf(logits[0])


def test_ascii_vocabulary_keeps_ascii_special_and_byte_tokens():
    tokenizer = merged_tokenizer()
    ids = ascii_token_ids(tokenizer, vocab_size=len(tokenizer) + 3)  # the model has 3 padding rows
    ab, e_acute = tokenizer.convert_tokens_to_ids(["ab", "Ã©"])
    assert ab in ids and e_acute not in ids
    assert set(tokenizer.convert_tokens_to_ids(["<|im_end|>", NON_ASCII_SPECIAL, NON_ASCII_ADDED])) <= set(ids)
    assert set(range(256)) <= set(ids)  # every byte: any text can still be spelled
    assert sorted(ids) == [i for i in range(len(tokenizer)) if i != e_acute]  # padding rows left out


def test_byte_tokens_are_recognised():
    assert is_byte_token("Ġ") and is_byte_token("<0x0A>")
    assert not is_byte_token("ab") and not is_byte_token("<0xZZ>") and not is_byte_token(None)


def test_a_vocabulary_file_must_list_valid_ids(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps([1, 2, 3]))
    assert resolve_draft_vocab(str(good), vocab_size=10) == [1, 2, 3]
    assert resolve_draft_vocab("full", vocab_size=10) is None
    bad.write_text(json.dumps([1, 99]))
    with pytest.raises(ModelSourceError, match=r"token ids in \[0, 10\)"):
        resolve_draft_vocab(str(bad), vocab_size=10)
    check_draft_vocab(str(bad))  # (before any model loads: the draft's vocabulary is not known yet)
    for ids in ([], [1, True], [-1], {"ids": [1]}):
        bad.write_text(json.dumps(ids))
        for check in (lambda: resolve_draft_vocab(str(bad), vocab_size=10), lambda: check_draft_vocab(str(bad))):
            with pytest.raises(ModelSourceError, match="must be a non-empty JSON list of token ids"):
                check()
    for check in (lambda: resolve_draft_vocab(str(tmp_path / "missing.json"), vocab_size=10),
                  lambda: check_draft_vocab(str(tmp_path / "missing.json"))):
        with pytest.raises(ModelSourceError, match="expected 'full', 'ascii' or a JSON file"):
            check()
    check_draft_vocab("full"), check_draft_vocab("ascii")
    with pytest.raises(ModelSourceError, match=r"token ids in \[0, 4\)"):
        TrimmedLMHead(nn.Linear(8, 4), torch.tensor([1, 4]))


def test_a_vocabulary_file_is_recorded_by_path_and_content(tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    first = vocab_setting(str(ids))
    assert first.startswith(str(ids.resolve()) + "#") and vocab_setting("ascii") == "ascii"
    ids.write_text("[1, 3]")
    assert vocab_setting(str(ids)) != first


def test_engine_with_a_trimmed_draft_matches_target_only(tiny_pair, tmp_path):
    draft, target = tiny_pair
    keep = tmp_path / "keep.json"
    kept = list(range(0, 259, 2))  # the even bytes, <|endoftext|> (256) and <|im_end|> (258)
    keep.write_text(json.dumps(kept))
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target), head="none", draft_vocab=str(keep)),
                          progress=False)
    prompt = engine.tokenizer.encode("def add(a, b):")
    [out] = engine.draft.start([engine.draft.new_session()], [prompt])
    assert torch.isfinite(out.logits[kept]).all() and torch.isneginf(out.logits[1::2]).all()

    fixed = engine.generate_ids(prompt, GenerationParams(max_new_tokens=24, policy=PolicyConfig(name="fixed", k=4)))
    alone = engine.generate_ids(prompt, GenerationParams(max_new_tokens=24, policy=PolicyConfig(name="target-only")))
    assert fixed.completions[0].token_ids == alone.completions[0].token_ids
    assert fixed.stats.discarded_tokens > 0 and fixed.stats.draft_tokens > 0
