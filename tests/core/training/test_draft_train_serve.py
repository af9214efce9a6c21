"""What `specdec train-draft` teaches the feature draft is what serving asks of it: the training loss
(training/draft.py `batch_loss`, over `make_batch`'s padded batch of gen-data's stored states)
equals the same loss written from the serving side alone: for each round the target's verification
pass hands its states over, the draft runtime (models/feature_runtime.py) drafts from them, later
steps fed the next true token (as if the candidates before were accepted), and each of its
distributions is scored against the target's own distribution of the token it drafts, read off
that verification pass. An off-by-one between states, token embeddings and labels, a mask letting
padding in or dropping real positions, or a vocabulary mapping error makes the two differ."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny import tiny_feature_draft
from transformers import AutoModelForCausalLM

from specdec.models.feature_draft import FUSED
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.runtime import TargetRuntime
from specdec.training.config import DraftTrainSection
from specdec.training.data import target_states
from specdec.training.draft import Example, batch_loss, make_batch

STEPS, PROMPT_WEIGHT, DECAY = 3, 0.5, 0.7


def served_terms(target_model, draft, seq: list[int], prompt_length: int):
    """[(weight, KL(p || q), drafted, truth, counted, step)] of every (round, step) serving can reach on
    `seq`: the round whose committed history is seq[:t + 2] (the target's states held at 0..t), its
    step j drafting seq[t + j + 1] from the true candidates before it."""
    target = TargetRuntime(target_model)
    target.read_features(draft.config.layers)
    runtime = FeatureDraftRuntime(draft)
    ids = draft.vocab_ids
    terms = []
    for t in range(len(seq) - 1):
        steps = min(STEPS, len(seq) - 1 - t)  # step j's label: the target's distribution after seq[:t + j + 1]
        history, candidates = seq[:t + 2], seq[t + 2:t + 1 + steps]
        session = target.new_session()
        scores = target.score([session], [history], [candidates])
        assert scores.starts == [0]
        # what verification hands the draft once the round's history is committed: states at 0..t
        states = scores.features[0][:t + 1].float()
        drafting = runtime.new_session()
        runtime.add_features(drafting, states, 0)
        assert runtime.can_draft(drafting, history)
        outputs = [runtime.start([drafting], [history])]
        for token in candidates:
            outputs.append(runtime.step([drafting], [token]))
        for j, out in enumerate(outputs, start=1):
            predicted = t + j + 1  # the position of the token step j drafts
            q = out.logits[0]
            assert torch.isinf(q[torch.ones_like(q, dtype=torch.bool).index_fill_(0, ids, False)]).all()
            log_q = torch.log_softmax(q[ids], -1)
            log_p = torch.log_softmax(scores[0][j - 1][ids], -1)  # the target's distribution of that token
            kl = float((log_p.exp() * (log_p - log_q)).sum())
            weight = DECAY ** (j - 1) * (1.0 if predicted >= prompt_length else PROMPT_WEIGHT)
            truth = seq[predicted] if predicted < len(seq) else None
            counted = predicted >= prompt_length and truth is not None
            terms.append((weight, kl, int(q.argmax()), truth, counted, j))  # q.argmax(): a target id
    return terms


@pytest.fixture(scope="module")
def target_model(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()


def test_training_loss_is_the_served_drafts_loss(target_model, monkeypatch):
    vocab = target_model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, vocab, (13,), generator=generator).tolist(), 5),
                 (torch.randint(0, vocab, (8,), generator=generator).tolist(), 3)]  # shorter: padded
    trimmed = sorted(set(range(0, vocab, 3)) | {t for seq, _ in sequences for t in seq[:6]})
    draft = tiny_feature_draft(target_model, vocab_ids=trimmed, seed=4)
    layers = draft.config.layers
    examples = [Example(f"p{i}", "train", torch.tensor(seq), prompt, target_states(target_model, seq, layers))
                for i, (seq, prompt) in enumerate(sequences)]
    settings = DraftTrainSection(storage="s", output="o", steps=STEPS, prompt_weight=PROMPT_WEIGHT, step_decay=DECAY)
    # training computes under bfloat16 autocast; in float32 both sides are the same numbers up to the
    # bfloat16 rounding of the stored states, so that a misaligned term cannot hide in the tolerance
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
    batch = make_batch(examples, FUSED, len(layers), "cpu")
    batch.states, batch.outputs = batch.states.float(), batch.outputs.float()  # the stored bfloat16 values
    with torch.no_grad():
        loss, stats = batch_loss(draft, batch, settings)
        terms = [term for seq, prompt in sequences for term in served_terms(target_model, draft, seq, prompt)]
    served = sum(w * kl for w, kl, *_ in terms) / sum(w for w, *_ in terms)
    assert float(loss) == pytest.approx(served, rel=1e-3)
    for j in range(1, STEPS + 1):
        mine = [(drafted, truth) for _, _, drafted, truth, counted, step in terms if counted and step == j]
        assert stats[j] == (sum(d == t for d, t in mine), len(mine))
