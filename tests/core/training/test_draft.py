"""The feature draft's data kind and its Ray Train job on the tiny pair."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_PROMPTS, start_local_ray, tiny_config

from benchmarks.draft_batching import padded_positions
from specdec.errors import IncompatibleModelsError, ModelSourceError
from specdec.models.feature_files import REPORT_FILE, load_feature_draft, save_feature_draft
from specdec.models.sources import model_identity
from specdec.training.config import ConfigError, DraftTrainSection, parse_config
from specdec.files import held
from specdec.training.data import LOCK_FILE, DatasetError, generate_dataset, read_manifest, target_states
from specdec.training.draft import (Example, batch_loss, build_draft, check_draft_data, check_trainable,
                                    epoch_examples, epoch_order, load_examples, make_batch, train_draft,
                                    trimmed_vocabulary)

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


def test_lazy_examples_read_the_same_states_from_their_shards(feature_dataset):
    """`lazy` holds where each sequence's states lie, not the states, and reads the same tensors."""
    from specdec.training.draft import StoredStates

    raw, _ = feature_dataset
    _, loaded = load_examples(raw["data"]["dir"], max_tokens=20)
    _, lazy = load_examples(raw["data"]["dir"], max_tokens=20, states="lazy")
    _, skipped = load_examples(raw["data"]["dir"], max_tokens=20, states="skip")
    assert all(isinstance(e.stored, StoredStates) for e in lazy) and all(e.states is None for e in skipped)
    assert [e.prompt_id for e in lazy] == [e.prompt_id for e in loaded]
    for a, b in zip(loaded, lazy):
        assert len(b.states) == len(b.tokens) <= 20
        assert torch.equal(a.states, b.states) and torch.equal(a.tokens, b.tokens)


def test_a_rerun_generates_nothing_and_other_layers_are_refused(feature_dataset):
    raw, manifest = feature_dataset
    again = generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]
    with held(Path(raw["data"]["dir"]) / LOCK_FILE, DatasetError, "", ""):  # a gen-data writing it meanwhile
        with pytest.raises(DatasetError, match=rf"data.dir .* is being written by process {os.getpid()} on .*; wait"):
            generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    other = {**raw, "data": {**raw["data"], "features": {"layers": [1]}}}
    with pytest.raises(DatasetError, match="other settings \\(layers differs\\)"):
        generate_dataset(parse_config(other), prompts=TINY_PROMPTS, progress=False)


def test_train_prompts_take_their_reference_answers(feature_dataset, tiny_pair, tmp_path):
    """With response.reference a dataset of the target's responses continues: a new train prompt with
    a reference takes it (cut at max_new_tokens, else closed by the end-of-turn token), a validation
    prompt or one without a reference gets the target's; the old rows stay. Once it holds references
    a run without them is refused, and labels data refuses the key."""
    import shutil

    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from specdec.training.data import shard_paths
    from specdec.training.stdlib_prompts import Prompt

    raw, manifest = feature_dataset
    directory = tmp_path / "data"
    shutil.copytree(raw["data"]["dir"], directory)
    short, long = "f = 1", "```python\n" + "x = 1\n" * 20 + "```"  # byte tokens: 5 and 131 of them
    extra = [Prompt("ref:short", "Write f.", "train", short), Prompt("ref:long", "Write x.", "train", long),
             Prompt("ref:held-out", "Write g.", "validation", short), Prompt("ref:none", "Write h.", "train")]
    with_reference = {**raw, "data": {**raw["data"], "dir": str(directory),
                                      "response": {**raw["data"]["response"], "reference": True}}}
    grown = generate_dataset(parse_config(with_reference), prompts=TINY_PROMPTS + extra, progress=False)
    assert grown["complete"] and grown["counts"]["sequences"] == len(TINY_PROMPTS) + len(extra)
    assert grown["settings"]["response"]["reference"] and "reference" not in manifest["settings"]["response"]
    assert [s["sha256"] for s in grown["shards"][:len(manifest["shards"])]] == [s["sha256"] for s in manifest["shards"]]
    rows = {r["prompt_id"]: r for path in shard_paths(directory)
            for r in pq.read_table(path, columns=["prompt_id", "response_ids", "finish_reason"]).to_pylist()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[1])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert rows["ref:short"]["response_ids"] == tokenizer.encode(short, add_special_tokens=False) + [im_end]
    assert rows["ref:long"]["response_ids"] == tokenizer.encode(long, add_special_tokens=False)[:12]
    assert rows["ref:short"]["finish_reason"] == rows["ref:long"]["finish_reason"] == "reference"
    assert rows["ref:held-out"]["finish_reason"] != "reference" and rows["ref:none"]["finish_reason"] != "reference"
    assert all(rows[p.id]["finish_reason"] != "reference" for p in TINY_PROMPTS)
    with pytest.raises(DatasetError, match="other settings \\(response differs\\)"):
        generate_dataset(parse_config({**with_reference, "data": {**with_reference["data"], "response": raw["data"]["response"]}}),
                         prompts=TINY_PROMPTS + extra, progress=False)
    labels = tiny_config(tiny_pair, tmp_path)
    labels["data"]["response"] = {**labels["data"]["response"], "reference": True}
    with pytest.raises(ConfigError, match="response.reference applies to features data only"):
        parse_config(labels)


def test_states_computed_in_bfloat16_continue_a_dataset_and_each_shard_says_how(feature_dataset, tiny_pair, tmp_path):
    """`features.compute: bfloat16` runs the states' pass on a bfloat16 copy of the float32 target: a
    dataset made by the target itself continues (the old shards untouched), each new shard records it,
    and its states are the float32 pass's within bfloat16's rounding."""
    import shutil

    from transformers import AutoModelForCausalLM

    from specdec.training.stdlib_prompts import Prompt

    raw, manifest = feature_dataset
    directory = tmp_path / "data"
    shutil.copytree(raw["data"]["dir"], directory)
    extra = [Prompt(f"bf16:{i}", f"Write function number {i}.", "train") for i in range(3)]
    in_bf16 = {**raw, "data": {**raw["data"], "dir": str(directory),
                               "features": {**raw["data"]["features"], "compute": "bfloat16"}}}
    grown = generate_dataset(parse_config(in_bf16), prompts=TINY_PROMPTS + extra, progress=False)
    old, new = grown["shards"][:len(manifest["shards"])], grown["shards"][len(manifest["shards"]):]
    assert [s["sha256"] for s in old] == [s["sha256"] for s in manifest["shards"]]
    assert new and all(s["states_compute"] == "bfloat16" for s in new)
    assert all(s["states_compute"] == "target" for s in old) and grown["settings"] == manifest["settings"]
    _, examples = load_examples(str(directory), max_tokens=1024)
    target = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    copy = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.bfloat16).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(raw["scaling"]["threads"])  # as the worker ran it: the same sums in the same order
    try:
        for example in (e for e in examples if e.prompt_id.startswith("bf16:")):
            exact = target_states(target, example.tokens.tolist(), LAYERS).float()
            torch.testing.assert_close(example.states.float(), target_states(copy, example.tokens.tolist(), LAYERS).float(),
                                       atol=0, rtol=0)  # the bfloat16 copy's pass ...
            assert not torch.equal(example.states.float(), exact)  # ... not the float32 one's, ...
            torch.testing.assert_close(example.states.float(), exact, atol=0.15, rtol=0.05)  # ... within its rounding
    finally:
        torch.set_num_threads(threads)


def test_layers_past_the_targets_are_refused_before_any_work(tiny_pair, tmp_path):
    raw = feature_config(tiny_pair, tmp_path)
    raw["data"]["features"] = {"layers": [0, 5]}
    with pytest.raises(IncompatibleModelsError, match="the target has 2 decoder layers"):
        generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    assert [p.name for p in (tmp_path / "data").iterdir()] == [LOCK_FILE]  # its lock, taken first, alone


def test_the_vocabulary_covers_the_share_asked():
    examples = [Example("a", "train", torch.tensor([9, 1, 1, 1, 1, 2, 2, 3]), 1, torch.zeros(8, 1, 2)),
                Example("b", "validation", torch.tensor([7, 7, 7]), 1, torch.zeros(3, 1, 2))]
    assert trimmed_vocabulary(examples, 0.5).tolist() == [1]  # 4 of 7 response tokens
    assert trimmed_vocabulary(examples, 0.8).tolist() == [1, 2]
    assert trimmed_vocabulary(examples, 1.0).tolist() == [1, 2, 3]
    assert trimmed_vocabulary(examples, 0.8, minimum=4).tolist() == [0, 1, 2, 3]  # the lowest ids fill it


def test_what_would_fail_in_the_workers_is_refused_before_ray():
    examples = [Example("a", "train", torch.tensor([9, 1, 1, 2]), 1, None),
                Example("b", "train", torch.tensor([9, 1]), 1, None)]
    check = DraftTrainSection(storage="s", output="o", batch_size=2, max_tokens=8)
    check_trainable(check, 1, examples, target_vocab=10)
    with pytest.raises(ConfigError, match="draft.batch_size 2 x scaling.num_workers 2 is more than the 2 train"):
        check_trainable(check, 2, examples, target_vocab=10)
    with pytest.raises(ConfigError, match="draft.vocab_size 11 is more than the target's 10 tokens"):
        check_trainable(check.model_copy(update={"vocab_size": 11}), 1, examples, target_vocab=10)
    prompts_only = [Example(e.prompt_id, "train", e.tokens[:1], 1, None) for e in examples]  # cut at max_tokens
    with pytest.raises(ConfigError, match="no train response token within draft.max_tokens 8"):
        check_trainable(check, 1, prompts_only, target_vocab=10)


def test_an_epoch_batches_sequences_of_like_length():
    """group_by_length: each epoch a permutation, the same for a seed and epoch (a resumed run goes on
    with it), another the next epoch, padding far less than a plain shuffle's (which it is when off)."""
    lengths = torch.randint(20, 600, (800,), generator=torch.Generator().manual_seed(1)).tolist()
    draft = DraftTrainSection(storage="s", output="o", batch_size=8)
    grouped = epoch_order(lengths, draft, 0)
    assert sorted(grouped) == list(range(800)) and grouped == epoch_order(lengths, draft, 0)
    assert grouped != epoch_order(lengths, draft, 1)
    shuffled = epoch_order(lengths, draft.model_copy(update={"group_by_length": False}), 0)
    assert shuffled == torch.randperm(800, generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_positions(lengths, grouped, 8) < 0.75 * padded_positions(lengths, shuffled, 8)


def test_an_epoch_repeats_the_targets_own_responses():
    """own_repeats: the target's own responses come that many times an epoch, reference answers and
    the validation split once and never."""
    examples = [Example(f"p{i}", split, torch.tensor([1, 2]), 1, None, own)
                for i, (split, own) in enumerate([("train", True), ("train", False), ("validation", True)])]
    draft = DraftTrainSection(storage="s", output="o")
    assert [e.prompt_id for e in epoch_examples(examples, draft)] == ["p0", "p1"]
    repeated = epoch_examples(examples, draft.model_copy(update={"own_repeats": 3}))
    assert [e.prompt_id for e in repeated] == ["p0", "p0", "p0", "p1"]


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

    settings = tmp_path / "runs" / f"{parse_config(raw).draft.name}.settings.json"
    older = json.loads(settings.read_text())
    del older["draft"]["own_repeats"]  # a run started before a setting existed resumes with its default
    settings.write_text(json.dumps(older))
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

    # A new run started from the saved draft: its weights and vocabulary (a learning rate too small
    # to move them keeps them equal); a draft of another shape is refused before Ray starts.
    warm = {**raw["draft"], "steps": 2, "epochs": 1, "name": "warm", "lr": 1e-12, "init": str(tmp_path / "draft"),
            "output": str(tmp_path / "warm")}
    train_draft(parse_config({**raw, "draft": warm}))
    started = load_feature_draft(tmp_path / "warm", tiny_pair[1], model_identity(tiny_pair[1]))
    for key, value in loaded.own_state().items():
        torch.testing.assert_close(started.own_state()[key], value)
    other = {**warm, "name": "other", "intermediate_size": 8}
    with pytest.raises(ConfigError, match="draft.init .* another kind of draft \\(layer_config differ\\)"):
        train_draft(parse_config({**raw, "draft": other}))


def test_a_held_draft_run_is_refused_before_the_dataset_is_hashed(feature_dataset, tmp_path, monkeypatch):
    """A feature dataset holds the target's states (GBs): their sha256 is not read for a run that
    another process trains, refused in one line before the data, the target or Ray."""
    import specdec.training.data as data
    from specdec.training.checkpoints import runs_held

    hashed, hash_file = [], data.sha256_file
    monkeypatch.setattr(data, "sha256_file", lambda path: hashed.append(path) or hash_file(path))
    raw, _ = feature_dataset
    runs = tmp_path / "runs"
    raw = {**raw, "draft": {**raw["draft"], "storage": str(runs)}}
    name, connected = parse_config(raw).draft.name, []
    with runs_held(str(runs), [name], "draft"):
        with pytest.raises(ConfigError, match=rf"run '{name}' in .* is being trained by process \d+ on .*; wait"):
            train_draft(parse_config(raw), connect=lambda: connected.append(1))
    assert hashed == [] and connected == []


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
    with pytest.raises(ConfigError, match="draft.init: no feature draft at .*nowhere"):  # (was found after Ray started)
        check_draft_data(parse_config({**raw, "draft": {**raw["draft"], "init": str(tmp_path / "nowhere")}}))
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


# -- the acceptance head of a feature draft (training/feature_labels.py) ---------------------------

@pytest.fixture(scope="module")
def saved_feature_draft(tiny_pair, tmp_path_factory):
    """A random feature draft on the tiny target's layers 0 and 1, saved as train-draft saves one."""
    from tiny import tiny_feature_draft
    from transformers import AutoModelForCausalLM

    draft = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(tiny_pair[1]))
    draft.config = draft.config.model_copy(update={"target_identity": model_identity(tiny_pair[1])})
    assert draft.config.layers == LAYERS
    return save_feature_draft(draft, tmp_path_factory.mktemp("feature-draft") / "draft", dtype=torch.float32)


def test_the_heads_data_are_what_the_runtime_hands_the_head(feature_dataset, saved_feature_draft, tiny_pair):
    """A round drafted by the runtime from the target's states over prompt + x_P: its first and second
    candidates' states are the head data's rows of steps 1 and 2 at response positions 1 and 2, and
    a greedy label is 1 exactly where the draft's argmax is the target's."""
    from specdec.models.feature_draft import FUSED, stored_inputs
    from specdec.models.feature_files import target_tensors
    from specdec.models.feature_runtime import FeatureDraftRuntime
    from specdec.sampling import SamplingParams
    from specdec.training.feature_labels import sequence_features

    raw, _ = feature_dataset
    model = load_feature_draft(saved_feature_draft, tiny_pair[1], model_identity(tiny_pair[1]))
    _, target_head = target_tensors(tiny_pair[1])
    _, examples = load_examples(raw["data"]["dir"], max_tokens=1024)
    e = next(e for e in examples if len(e.tokens) - e.prompt_length >= 3)
    P = e.prompt_length
    greedy, sampled = sequence_features(model, target_head, e, len(LAYERS),
                                        [SamplingParams(), SamplingParams(temperature=1.0)],
                                        torch.Generator().manual_seed(0), steps=2)
    runtime = FeatureDraftRuntime(model)
    session = runtime.new_session()
    runtime.add_features(session, stored_inputs(e.states[:P], FUSED, len(LAYERS)), 0)
    drafted = [runtime.start([session], [e.tokens[:P + 1].tolist()])]
    drafted.append(runtime.step([session], [int(e.tokens[P + 1])]))
    steps = torch.exp(greedy["scalars"][:, 4]).round()
    assert set(steps.tolist()) == {1.0, 2.0}
    for step, out in enumerate(drafted, start=1):
        [row] = ((steps == step) & (greedy["positions"] == step)).nonzero()[:, 0].tolist()
        torch.testing.assert_close(greedy["hidden"][row], out.hidden[0], atol=1e-4, rtol=1e-4)
        p = e.states[P + step - 1, -1].float() @ target_head.T  # the target's output state at x_{P+step-1}
        assert greedy["labels"][row] == float(out.logits[0].argmax() == p.argmax())
    # every greedy row: exact match against the target's distribution of the token it drafts, from the
    # target's stored output state at the token before it (response position r: x_{P+r-1})
    p = e.states[P + greedy["positions"] - 1, -1].float() @ target_head.T
    with torch.no_grad():
        q = model.full_logits(greedy["hidden"])
    assert torch.equal(greedy["labels"], (q.argmax(-1) == p.argmax(-1)).float())
    y = sampled["draft_ids"][:, None]
    p_y, q_y = torch.softmax(p, -1).gather(-1, y), torch.softmax(q, -1).gather(-1, y)
    torch.testing.assert_close(sampled["labels"], (p_y / q_y).clamp(max=1.0)[:, 0])
    assert sampled["labels"].min() < 1 and sampled["temperatures"].eq(1.0).all()
    torch.testing.assert_close(sampled["hidden"], greedy["hidden"])


def test_train_head_on_a_feature_draft(feature_dataset, saved_feature_draft, tiny_pair, tmp_path):
    """`specdec train-head` on a features dataset trains the head of the config's feature draft: saved
    in the draft's directory, it is the head an engine on that draft loads (`auto`), for that draft
    only; a feature draft of another target is refused before Ray starts."""
    from specdec.builder import EngineConfig, build_engine
    from specdec.heads import resolve_head
    from specdec.training.train import train_head

    raw, _ = feature_dataset
    raw = {**raw, "draft": {**raw["draft"], "output": str(saved_feature_draft)},
           "train": {"storage": str(tmp_path / "runs"), "output": str(saved_feature_draft / "head"), "depth": 1,
                     "epochs": 1, "batch_size": 16, "lr": 1e-2, "features": "hidden+distribution"}}
    report = train_head(parse_config(raw))
    assert set(report["by_temperature"]) == {"0", "1"} and report["calibration"]
    assert resolve_head("auto", str(saved_feature_draft)) == str(saved_feature_draft / "head")
    engine = build_engine(EngineConfig(draft=str(saved_feature_draft), target=str(tiny_pair[1])), progress=False)
    assert engine.draft_worker.head is not None and engine.rules.drafts["default"].has_head
    assert engine.draft_worker.head.config.draft_identity == model_identity(saved_feature_draft)

    from tiny import tiny_feature_draft
    from transformers import AutoModelForCausalLM

    other = save_feature_draft(tiny_feature_draft(AutoModelForCausalLM.from_pretrained(tiny_pair[1])), tmp_path / "other")  # "tiny"
    with pytest.raises(IncompatibleModelsError, match="reads another target"):
        train_head(parse_config({**raw, "draft": {**raw["draft"], "output": str(other)}}))


def test_a_heads_data_from_the_first_train_sequences(feature_dataset, saved_feature_draft):
    """`train.max_sequences`: the head's data come from the dataset's first N train sequences, the
    validation split whole, and the feature cache is keyed by it."""
    from specdec.training.feature_labels import feature_draft_features
    from specdec.training.train import feature_key

    raw, manifest = feature_dataset
    raw = {**raw, "draft": {**raw["draft"], "output": str(saved_feature_draft)},
           "train": {"storage": "s", "output": "o"}}
    whole, _ = feature_draft_features(parse_config(raw), raw["data"]["dir"])
    first, _ = feature_draft_features(parse_config({**raw, "train": {**raw["train"], "max_sequences": 1}}),
                                      raw["data"]["dir"])
    per_sequence = len(parse_config(raw).data.labels.sets())  # one part per label set
    assert len(whole["train"]) > per_sequence and len(first["train"]) == per_sequence
    for a, b in zip(first["train"] + first["validation"], whole["train"][:per_sequence] + whole["validation"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(first["validation"]) == len(whole["validation"])
    keys = {feature_key(manifest, parse_config({**raw, "train": {**raw["train"], **more}}).require_train(), "d")
            for more in ({}, {"max_sequences": 1}, {"max_sequences": 2})}
    assert len(keys) == 3
