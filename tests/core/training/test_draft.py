"""The feature draft's data kind and its Ray Train job on the tiny pair."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_PROMPTS, start_local_ray, tiny_config

from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.models.feature_draft import REPORT_FILE, load_feature_draft
from specdec.models.sources import model_identity
from specdec.training.config import ConfigError, DraftTrainSection, parse_config
from specdec.training.data import DatasetError, generate_dataset, read_manifest, target_states
from specdec.training.draft import (Example, batch_loss, build_draft, check_draft_data, load_examples, make_batch,
                                    train_draft, trimmed_vocabulary)

LAYERS = [0, 1]


def feature_config(tiny_pair, tmp_path, **draft) -> dict:
    raw = tiny_config(tiny_pair, tmp_path)
    raw["data"] = {**raw["data"], "kind": "features", "features": {"layers": LAYERS},
                   "response": {"temperature": 0.0, "max_new_tokens": 12, "policy": "fixed", "k": 3}}
    raw["data"].pop("labels")
    raw["scaling"] = {"num_workers": 1, "threads": 1}
    raw.pop("train")
    raw["draft"] = {"storage": str(tmp_path / "runs"), "output": str(tmp_path / "draft"), "intermediate_size": 24,
                    "epochs": 1, "batch_size": 2, "steps": 2, "checkpoint_every": 1, "warmup_steps": 0,
                    "vocab_coverage": 1.0, **draft}
    return raw


@pytest.fixture(scope="module")
def feature_dataset(tiny_pair, tmp_path_factory):
    raw = feature_config(tiny_pair, tmp_path_factory.mktemp("features"))
    start_local_ray()
    return raw, generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)


def test_shards_hold_the_targets_states_over_prompt_and_response(feature_dataset, tiny_pair):
    """Each row's states are the target's after the chosen layers and its output state, at every
    position of prompt + response; the manifest names the kind and the layers, not the draft."""
    from transformers import AutoModelForCausalLM

    raw, manifest = feature_dataset
    assert manifest["kind"] == "features" and manifest["complete"]
    assert manifest["settings"]["layers"] == LAYERS and "draft_identity" not in manifest["settings"]
    _, examples = load_examples(raw["data"]["dir"], max_tokens=1024)
    assert len(examples) == len(TINY_PROMPTS) and {e.split for e in examples} == {"train", "validation"}
    target = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    example = examples[0]
    with torch.no_grad():
        hidden = target(example.tokens[None], output_hidden_states=True).hidden_states
    assert example.states.shape == (len(example.tokens), len(LAYERS) + 1, target.config.hidden_size)
    # transformers' hidden_states: the embeddings, decoder layer i's output at i + 1, except the last
    # layer's, whose place holds the output state (the final norm of it)
    torch.testing.assert_close(example.states[:, 0].float(), hidden[1][0], atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        normed = target.model.norm(example.states[:, 1].float())
    torch.testing.assert_close(normed, hidden[-1][0], atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(example.states[:, -1].float(), hidden[-1][0], atol=2e-2, rtol=2e-2)


def test_a_rerun_generates_nothing_and_other_layers_are_refused(feature_dataset):
    raw, manifest = feature_dataset
    again = generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]
    other = {**raw, "data": {**raw["data"], "features": {"layers": [1]}}}
    with pytest.raises(DatasetError, match="other settings \\(layers differs\\)"):
        generate_dataset(parse_config(other), prompts=TINY_PROMPTS, progress=False)


def test_layers_past_the_targets_are_refused_before_any_work(tiny_pair, tmp_path):
    raw = feature_config(tiny_pair, tmp_path)
    raw["data"]["features"] = {"layers": [0, 5]}
    with pytest.raises(IncompatibleModelsError, match="the target has 2 decoder layers"):
        generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    assert not (tmp_path / "data").exists()


def test_the_vocabulary_covers_the_share_asked():
    examples = [Example("a", "train", torch.tensor([9, 1, 1, 1, 1, 2, 2, 3]), 1, torch.zeros(8, 1, 2)),
                Example("b", "validation", torch.tensor([7, 7, 7]), 1, torch.zeros(3, 1, 2))]
    assert trimmed_vocabulary(examples, 0.5).tolist() == [1]  # 4 of 7 response tokens
    assert trimmed_vocabulary(examples, 0.8).tolist() == [1, 2]
    assert trimmed_vocabulary(examples, 1.0).tolist() == [1, 2, 3]
    assert trimmed_vocabulary(examples, 0.8, minimum=4).tolist() == [0, 1, 2, 3]  # the lowest ids fill it


def test_training_steps_lower_the_loss(feature_dataset):
    """Thirty optimizer steps on one batch fit it: the loss falls and step-1 acceptance rises."""
    raw, manifest = feature_dataset
    config = parse_config(raw)
    _, examples = load_examples(raw["data"]["dir"], 1024)
    vocab_ids = trimmed_vocabulary(examples, 1.0)
    settings = {"draft": config.draft.model_dump(), "layers": LAYERS, "target_identity": "t", "target_name": "t"}
    model = build_draft(settings, raw["models"]["target"], vocab_ids)
    batch = make_batch(examples[:4], "fused", len(LAYERS), "cpu")
    draft = DraftTrainSection(**{**config.draft.model_dump(), "prompt_weight": 1.0})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first, first_stats = batch_loss(model, batch, draft)
    for _ in range(30):
        loss, _ = batch_loss(model, batch, draft)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, last_stats = batch_loss(model, batch, draft)
    assert float(last) < 0.5 * float(first)
    assert last_stats[1][0] > first_stats[1][0]


def test_train_resume_and_saved_draft(feature_dataset, tiny_pair, tmp_path):
    """Through the real TorchTrainer: one epoch, then epochs = 2 under the same run name resumes from
    the last checkpoint; the saved draft loads on its target and its report has per-step acceptance."""
    raw, _ = feature_dataset
    raw = {**raw, "draft": {**raw["draft"], "storage": str(tmp_path / "runs"), "output": str(tmp_path / "draft")}}
    first = train_draft(parse_config(raw))
    steps_first = [h["step"] for h in first["history"]]
    assert steps_first == list(range(1, steps_first[-1] + 1))
    assert {"val_acc_code_step1", "val_acc_code_step2", "val_loss"} <= set(first["final"])

    raw["draft"]["epochs"] = 2
    second = train_draft(parse_config(raw))
    assert second["history"][:len(steps_first)] == first["history"]  # epoch 1 came from the checkpoint
    assert second["history"][-1]["step"] == 2 * steps_first[-1]

    report = json.loads((tmp_path / "draft" / REPORT_FILE).read_text())
    assert report["vocabulary"]["coverage_train"] == 1.0
    loaded = load_feature_draft(tmp_path / "draft", tiny_pair[1], model_identity(tiny_pair[1]))
    assert loaded.config.layers == LAYERS

    raw["draft"]["steps"] = 3  # another setting under the same name: refused, nothing overwritten
    with pytest.raises(ConfigError, match="started with other settings \\(steps\\)"):
        train_draft(parse_config(raw))


def test_a_missing_or_other_target_is_one_line(feature_dataset, tmp_path):
    from tiny import byte_tokenizer, tiny_model

    raw, _ = feature_dataset
    other = tmp_path / "other-target"
    tokenizer = byte_tokenizer()
    tiny_model(len(tokenizer), 32, 2, seed=9).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(IncompatibleModelsError, match="made on another target"):
        check_draft_data(parse_config({**raw, "models": {**raw["models"], "target": str(other)}}))
    with pytest.raises(ModelSourceError, match="models.target"):
        check_draft_data(parse_config({**raw, "models": {**raw["models"], "target": str(tmp_path / "nowhere")}}))
    labels = {**raw, "data": {**raw["data"], "kind": "labels"}}
    with pytest.raises(ConfigError, match="data.kind must be `features`"):
        check_draft_data(parse_config(labels))
    assert read_manifest(raw["data"]["dir"])["kind"] == "features"


def test_target_states_match_a_plain_forward(tiny_pair):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    ids = [5, 6, 7, 8]
    states = target_states(target, ids, [0])
    with torch.no_grad():
        hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(states[:, 0].float(), hidden[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(states[:, 1].float(), hidden[-1][0], atol=2e-2, rtol=2e-2)
