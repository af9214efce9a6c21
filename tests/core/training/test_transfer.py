"""A head judged on another draft (specdec/training/transfer.py): the teacher-forced pass any runtime
gives, equal drafts giving equal figures, and the verdict's two bounds."""

from __future__ import annotations

import pytest
import torch

from specdec.features import FEATURES_DISTRIBUTION
from specdec.head import AcceptanceHead, HeadConfig
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import SamplingParams
from specdec.training.data import response_logits
from specdec.training.transfer import AUROC_DROP, MAX_ECE, compare_drafts, teacher_forced, validated_draft, verdict


@pytest.fixture(scope="module")
def rows(tiny_engine):
    params = GenerationParams(max_new_tokens=10, policy=PolicyConfig(name="target-only"),
                              sampling=SamplingParams(temperature=1.0, seed=3))
    out = []
    for i, text in enumerate(["def add(a, b):", "Write hello world.", "Sort a list."]):
        prompt = tiny_engine.encode_prompt(text)
        response = tiny_engine.generate_ids(prompt, params).completions[0].token_ids
        out.append({"prompt_id": f"p{i}", "prompt_ids": prompt, "response_ids": response,
                    "label_temperatures": [0.0, 1.0, 1.0]})
    return out


def test_the_teacher_forced_pass_of_a_runtime_is_the_models_own(tiny_engine, rows):
    row, n = rows[0], len(rows[0]["response_ids"])
    logits, hidden = teacher_forced(tiny_engine.draft, row["prompt_ids"], row["response_ids"])
    assert logits.shape == (n, tiny_engine.draft.vocab_size) and hidden.shape == (n, tiny_engine.draft.hidden_size)
    logits, _ = teacher_forced(tiny_engine.target, row["prompt_ids"], row["response_ids"])  # fp32 (the draft: int8)
    expected = response_logits(tiny_engine.target.model, row["prompt_ids"], row["response_ids"])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_same_draft_twice_gives_the_same_figures_per_temperature(tiny_engine, rows):
    draft = tiny_engine.draft
    head = AcceptanceHead(HeadConfig(hidden_size=draft.hidden_size, depth=1, draft_identity=draft.identity,
                                     features=FEATURES_DISTRIBUTION)).eval()
    results = compare_drafts(head, tiny_engine.target, {"a": draft, "b": draft}, rows,
                             lambda row: [SamplingParams(temperature=t) for t in row["label_temperatures"]],
                             mixing_ratio=0.15, mixing_seed=0, label_seed=0)
    assert results["a"] == results["b"] and set(results["a"]) == {"all", "T=0", "T=1"}
    tokens = sum(len(r["response_ids"]) for r in rows)
    assert results["a"]["all"]["count"] == 3 * tokens and results["a"]["T=0"]["count"] == tokens
    assert 0.0 <= results["a"]["T=1"]["mean_label"] <= 1.0
    assert verdict(results["a"]["all"], results["b"]["all"]) == (results["b"]["all"]["ece"] <= MAX_ECE)


def test_the_verdict_bounds_the_auroc_drop_and_the_ece():
    reference = {"auroc": 0.870, "ece": 0.005, "count": 100}
    assert verdict(reference, {"auroc": 0.870 - AUROC_DROP, "ece": MAX_ECE, "count": 100})
    assert verdict(reference, {"auroc": 0.90, "ece": 0.01, "count": 100})  # better is fine
    assert not verdict(reference, {"auroc": 0.864, "ece": 0.01, "count": 100})
    assert not verdict(reference, {"auroc": 0.870, "ece": 0.031, "count": 100})
    record = validated_draft("gguf-sha256:ab+q4_0", "q4_0", reference, {"auroc": 0.868, "ece": 0.02, "count": 100})
    assert (record.tokens, record.auroc, record.reference_auroc, record.reference_ece) == (100, 0.868, 0.870, 0.005)
