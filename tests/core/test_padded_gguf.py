"""A padded pair on llama.cpp: GGUFs of one tokenizer whose embedding (and tied output) rows differ
past its last id, the extra rows listed as unused "[PAD<id>]" tokens as a real Qwen2.5 GGUF lists
them (its 0.5B: 151,936 rows, its 7B: 152,064, the tokenizer 151,665 ids). test_padded_vocab.py runs
such pairs in torch; here a llama.cpp draft is fitted as the builder fits it (models/runtime.py
`DraftRole.fit_vocabulary`), which proposes none of its padding ids, and decoding stays lossless. The
draft's padding rows are large, so an unmasked one would be proposed.

A GGUF's tokenizer, as transformers reads it, counts the [PAD] tokens as ids (len(tokenizer) is the
target's rows): the builder counts the ids before them (models/vocab.py `tokenizer_ids`), on
llama.cpp and on torch, which converts the GGUFs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.builder import EngineConfig, build_engine
from specdec.engine import SpecDecEngine
from specdec.models.llamacpp import LlamaCppDraftRuntime, LlamaCppOptions, LlamaCppTargetRuntime
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import SamplingParams
from stats import chi2_pvalue
from test_lossless import (SAMPLED_PROMPT, SAMPLES_PER_CASE, SAMPLINGS, SIGNIFICANCE, counting_proposals, prefix_counts,
                           sample_completions, target_joint)
from test_padded_vocab import assert_greedy_equals_target_only
from tiny import SMALL_TOKENS, byte_level_tokens, noisy_weights, tiny_gguf_weights, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = len(byte_level_tokens())  # 260 ids
TARGET_ROWS = 272
PAD_SCALE = 40.0  # the draft's padding rows (tied: its output's too): an unmasked one wins its argmax


def padded(weights: dict[str, np.ndarray], rows: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    """`weights` with `rows` embedding rows (cut or extended), those from `tokens` on random with norm
    ~PAD_SCALE; write_tiny_gguf lists them as [PAD] tokens."""
    embedding = weights["token_embd.weight"]
    hidden = embedding.shape[1]
    rows_now = np.concatenate([embedding, np.zeros((max(0, rows - len(embedding)), hidden), np.float32)])[:rows]
    rows_now[tokens:] = PAD_SCALE * np.random.default_rng(seed).normal(0, 1, (rows - tokens, hidden)) / hidden ** 0.5
    return {**weights, "token_embd.weight": rows_now.astype(np.float32)}


def engine_of(draft, target, cache, runtime: str, **llamacpp):
    """On torch (the GGUFs converted into `cache`) or llama.cpp, with `llamacpp`'s options there."""
    options = {"llamacpp": LlamaCppOptions(threads=1, **llamacpp)} if runtime == "llamacpp" else {}
    return build_engine(EngineConfig(draft=str(draft), target=str(target), runtime=runtime, head="none", threads=1,
                                     cache_dir=str(cache), **options), progress=False)


@pytest.fixture(scope="module")
def padded_ggufs(tmp_path_factory):
    """A target of 272 rows over the byte vocabulary; drafts (the target plus noise) of 264 (fewer)
    and 280 (more) rows, their padding rows large."""
    root = tmp_path_factory.mktemp("padded-gguf")
    target = tiny_gguf_weights(TARGET_ROWS, 32, layers=2, ffn=64, seed=3, scale=0.3)
    return {"target": write_tiny_gguf(root / "target.gguf", target), "cache": root / "cache",
            **{name: write_tiny_gguf(root / f"{name}.gguf",
                                     padded(noisy_weights(target, 0.05, seed=4), rows, TOKENS, seed=5))
               for name, rows in (("fewer", 264), ("more", 280))}}


@pytest.mark.parametrize("runtime", ["llamacpp", "torch"])
@pytest.mark.parametrize("draft, rows", [("fewer", 264), ("more", 280)])
def test_greedy_output_of_a_padded_gguf_pair_equals_target_only(padded_ggufs, draft, rows, runtime, monkeypatch):
    engine = engine_of(padded_ggufs[draft], padded_ggufs["target"], padded_ggufs["cache"], runtime,
                       context=1024, sequences=8)
    assert engine.draft.vocab_size == engine.target.vocab_size == TARGET_ROWS
    assert engine.draft._fitted == (TOKENS, TARGET_ROWS)  # the ids before the [PAD] tokens, not its rows'
    assert (engine.draft.llama.n_vocab if runtime == "llamacpp" else engine.draft.model.config.vocab_size) == rows
    assert_greedy_equals_target_only(
        engine, monkeypatch, ([5, 72, 101, 108, 108, 111], list(range(40, 52)), [7, 7, 7, 120, 250, 31, 64, 9]),
        (PolicyConfig(name="fixed", k=3), PolicyConfig(name="svip", threshold=0.5)), 32, TOKENS)


@pytest.mark.parametrize("draft_rows", [11, 14])
def test_sampled_output_of_a_padded_gguf_pair_follows_the_target(draft_rows, tmp_path, monkeypatch):
    """SMALL_TOKENS' 10 ids, a target of 12 rows (its 2 padding rows at normal size, so it samples
    them, and the 11-row draft is fed one it lacks as 0). The engine is built without EOS (every
    sample runs its full length), its draft fitted as build_engine fits it: to the ids before the
    [PAD] tokens."""
    tokens, target_rows = len(SMALL_TOKENS), 12
    target = tiny_gguf_weights(target_rows, 16, layers=1, seed=5, scale=0.6)
    target_path = write_tiny_gguf(tmp_path / "target.gguf", target, tokens=SMALL_TOKENS)
    draft_path = write_tiny_gguf(tmp_path / "draft.gguf", padded(noisy_weights(target, 0.15, seed=6), draft_rows,
                                                                 tokens, 7), tokens=SMALL_TOKENS)
    options = LlamaCppOptions(threads=1, context=4096, sequences=64)
    draft = LlamaCppDraftRuntime(draft_path, options=options)
    draft.fit_vocabulary(target_rows, tokens)
    engine = SpecDecEngine(draft, LlamaCppTargetRuntime(target_path, options=options))
    proposed = counting_proposals(monkeypatch)
    sampling, policy = SAMPLINGS["temperature-1"], PolicyConfig(name="fixed", k=3)
    completions, stats = sample_completions(engine, policy, sampling, SAMPLES_PER_CASE, seed=3000)
    assert max(proposed) < tokens and stats.accepted_tokens > 0 and stats.discarded_tokens > 0
    assert any(t >= tokens for ids in completions for t in ids)  # the target's padding ids, fed to the draft
    # The target as transformers runs the same file (within a few 1e-3 of llama.cpp's logits here: far
    # below what 1024 samples tell apart).
    hf_target = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=target_path.name, dtype=torch.float32).eval()
    for length in (1, 2, 3):
        expected = target_joint(hf_target, SAMPLED_PROMPT, sampling, length)
        pvalue = chi2_pvalue(prefix_counts(completions, length, target_rows), expected)
        assert pvalue > SIGNIFICANCE, f"first {length} token(s): chi-squared p = {pvalue:.2e}"
    seeded = GenerationParams(max_new_tokens=12, n=4, policy=policy, sampling=SamplingParams(temperature=1.0, seed=11))
    first, again = (engine.generate_ids(SAMPLED_PROMPT, seeded).completions for _ in range(2))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]  # a seed draws the same
