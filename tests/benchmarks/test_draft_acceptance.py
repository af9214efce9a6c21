"""The acceptance benchmark's two readings of a feature draft agree: a free-running round's first k
drafts are accepted exactly where the teacher-forced drafts at positions 1..k all match."""

from __future__ import annotations

import torch
from transformers import Qwen2Config

from benchmarks.draft_acceptance import feature_free_running, feature_teacher_forced, starts_of, summarise
from specdec.models.feature_draft import FUSED, FeatureDraft, FeatureDraftConfig, layer_config_of
from specdec.training.draft import Example

HIDDEN, VOCAB = 32, 8


def test_free_running_rounds_are_the_teacher_forced_matches_in_a_row():
    target = Qwen2Config(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0)
    config = FeatureDraftConfig(target_identity="tiny", inputs=FUSED, layers=[0, 1, 2],
                                layer_config=layer_config_of(target, 48), vocab_size=VOCAB)
    torch.manual_seed(0)
    vocab_ids = torch.tensor([0, 2])  # two ids: about half the drafts match random tokens drawn from them
    model = FeatureDraft(config, torch.randn(VOCAB, HIDDEN), torch.randn(2, HIDDEN), vocab_ids).eval()
    T, prompt, k = 40, 6, 3
    example = Example("tiny:0", "validation", vocab_ids[torch.randint(0, 2, (T,))], prompt, torch.randn(T, 4, HIDDEN))

    lengths = feature_free_running(model, example, k, stride=1)
    with torch.no_grad():
        outs = model.unroll(example.states[None, :, :3], torch.cat([example.tokens[1:], torch.zeros(1, dtype=torch.long)])[None], k)
    starts = starts_of(example, 1)
    assert len(lengths) == len(starts)
    for t, length in zip(starts, lengths):
        # the round from t drafts x_{t+2}, x_{t+3}, ...: step j's state at position t + j - 1
        hits = []
        for j in range(1, k + 1):
            p = t + j - 1
            if p + 2 >= T:
                break
            hits.append(int(vocab_ids[model.logits(outs[j - 1][0, p]).argmax()]) == int(example.tokens[p + 2]))
        expected = next((i for i, hit in enumerate(hits) if not hit), len(hits))
        assert length == expected
    assert 0 < sum(lengths) < len(lengths) * k  # some rounds accept, none accepts everything

    teacher = feature_teacher_forced(model, example, k)
    summary = summarise(lengths, teacher, k)
    assert summary["reach"][0] == teacher[0][0] / teacher[0][1]  # position 1 is teacher-forced either way
    assert summary["mean_accepted"][0] == summary["reach"][0]
