"""Training data: teacher-forced labels, shards + manifest generated on Ray workers, resume, bad data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY_PROMPTS

from specdec.builder import EngineConfig, build_engine
from specdec.errors import IncompatibleModelsError
from specdec.sampling import SamplingParams
from specdec.training.config import parse_config
from specdec.training.data import (
    MANIFEST_FILE,
    DatasetError,
    generate_dataset,
    label_distribution,
    label_response,
    load_dataset,
    read_manifest,
    shard_paths,
)


def test_labels_are_min_one_p_over_q_of_the_teacher_forced_models(tiny_pair):
    # fp32 weights: int8 dynamic quantization scales activations per pass, so one pass over all
    # positions and one pass per position would differ slightly by design.
    engine = build_engine(EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1]), draft_format="fp32",
                                       target_format="fp32"), progress=False)
    draft, target = engine.draft.model, engine.target.model
    prompt, response = [257, 40, 41], [50, 51, 52, 53]
    sampling = SamplingParams(temperature=1.0)
    out, = label_response(draft, target, prompt, response, [sampling], torch.Generator().manual_seed(0))
    for i, (y, label) in enumerate(zip(out.draft_ids, out.labels)):
        prefix = torch.tensor([prompt + response[:i]])  # position i from scratch, no shared pass
        with torch.no_grad():
            q = torch.softmax(draft(prefix).logits[0, -1].float(), -1)
            p = torch.softmax(target(prefix).logits[0, -1].float(), -1)
        assert label == pytest.approx(min(1.0, float(p[y] / q[y])), rel=1e-4)
    assert out.temperature == 1.0 and len(out.draft_ids) == len(response)


def test_recorded_verification_logits_are_the_teacher_forced_targets(tiny_pair):
    from specdec.params import build_params
    from specdec.training.data import RecordingTarget, response_logits

    engine = build_engine(EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1]), draft_format="fp32",
                                       target_format="fp32"), progress=False)
    engine.verifier_worker.target = recording = RecordingTarget(engine.target)
    prompt = [257, 40, 41]
    response = engine.generate_ids(prompt, build_params(policy="fixed", k=3, max_new_tokens=12)).completions[0].token_ids
    assert len(recording.calls) > 1  # several rounds, so rows come from different passes
    recorded = recording.committed_logits(prompt, response)
    teacher_forced = response_logits(recording.model, prompt, response)
    assert recorded.shape == teacher_forced.shape
    assert torch.allclose(recorded, teacher_forced, atol=1e-4)
    sampling = SamplingParams(temperature=1.0)
    with_recorded, = label_response(engine.draft.model, None, prompt, response, [sampling],
                                    torch.Generator().manual_seed(0), recorded)
    with_pass, = label_response(engine.draft.model, recording.model, prompt, response, [sampling],
                                torch.Generator().manual_seed(0))
    assert with_recorded.draft_ids == with_pass.draft_ids
    assert with_recorded.labels == pytest.approx(with_pass.labels, abs=1e-4)


def test_recording_reads_back_each_response_of_a_batch(tiny_pair):
    """Two prompts generated together: each response's rows come from its own passes."""
    from specdec.params import build_params
    from specdec.training.data import RecordingTarget, response_logits

    engine = build_engine(EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1]), draft_format="fp32",
                                       target_format="fp32"), progress=False)
    engine.verifier_worker.target = recording = RecordingTarget(engine.target)
    prompts = [[257, 40, 41], [257, 60, 61, 62]]
    results = engine.generate_many(prompts, build_params(policy="fixed", k=3, max_new_tokens=10))
    for prompt, result in zip(prompts, results):
        response = result.completions[0].token_ids
        torch.testing.assert_close(recording.committed_logits(prompt, response),
                                   response_logits(recording.model, prompt, response), atol=1e-4, rtol=1e-4)


def test_label_sets_share_one_draft_pass():
    """Greedy: Y is q's argmax and the label is exact match; sampled draws are independent."""
    from specdec.training.labels import soft_acceptance_labels

    class Fixed(torch.nn.Module):  # a "model" whose teacher-forced logits are given
        def __init__(self, logits):
            super().__init__()
            self.logits, self.lm_head, self.weight = logits, torch.nn.Identity(), torch.nn.Parameter(torch.zeros(1))
            self.model = lambda input_ids: type("Out", (), {"last_hidden_state": self.logits[None]})()

    q_logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0], [1.0, 1.1, 0.0]])
    p_logits = torch.tensor([[2.0, 0.5, 0.0], [3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    sets = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    out = label_response(Fixed(q_logits), None, [1], [0, 1, 2], sets, torch.Generator().manual_seed(0), p_logits)
    assert [s.temperature for s in out] == [0.0, 1.0, 1.0]
    assert out[0].draft_ids == [0, 1, 1] and out[0].labels == [1.0, 0.0, 1.0]
    q, p = torch.softmax(q_logits, -1), torch.softmax(p_logits, -1)
    for labelled in out[1:]:
        expected = soft_acceptance_labels(p, q, torch.tensor(labelled.draft_ids))
        assert labelled.labels == pytest.approx(expected.tolist())


def test_responses_are_reused_and_labelled_again(tiny_dataset, tmp_path):
    """Other labels over the responses of a dataset: no response is generated again (the rows keep
    them) and the labels follow the new settings; other response settings cannot be reused."""
    raw, _ = tiny_dataset
    relabel = {**raw, "data": {**raw["data"], "dir": str(tmp_path / "relabelled"), "labels": {"temperatures": [0.5]}}}
    manifest = generate_dataset(parse_config(relabel), prompts=TINY_PROMPTS, progress=False, reuse=raw["data"]["dir"])
    _, old = load_dataset(raw["data"]["dir"])
    _, new = load_dataset(relabel["data"]["dir"])
    old = {r["prompt_id"]: r for r in old}
    assert manifest["complete"] and len(new) == len(old)
    for row in new:
        assert row["response_ids"] == old[row["prompt_id"]]["response_ids"] and row["label_temperatures"] == [0.5]
    other = {**relabel, "data": {**relabel["data"], "dir": str(tmp_path / "other"),
                                 "response": {**raw["data"]["response"], "max_new_tokens": 5}}}
    with pytest.raises(DatasetError, match="cannot reuse the responses of .*: made with another response"):
        generate_dataset(parse_config(other), prompts=TINY_PROMPTS, progress=False, reuse=raw["data"]["dir"])


def test_greedy_labels_are_exact_match():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert label_distribution(logits, SamplingParams()).tolist() == [[0, 1, 0], [1, 0, 0]]


def test_shards_and_manifest(tiny_dataset, tiny_pair):
    raw, manifest = tiny_dataset
    directory = raw["data"]["dir"]
    on_disk = read_manifest(directory)
    assert on_disk == json.loads(json.dumps(manifest)) and manifest["complete"]
    assert len(shard_paths(__import__("pathlib").Path(directory))) == 3  # 7 prompts, 3 per shard
    counts = manifest["counts"]
    assert (counts["sequences"], counts["validation_sequences"], counts["train_sequences"]) == (7, 2, 5)
    assert counts["positions"] == 7 * 12  # max_new_tokens, no EOS at these settings
    assert counts["tokens"] == 7 * 12 * 3  # label sets: greedy, and 2 draws at T = 1
    assert manifest["settings"]["labels"]["temperatures"] == [0.0, 1.0]
    assert manifest["prompt_source"].startswith("custom")
    engine = build_engine(EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1])), progress=False)
    assert manifest["draft"]["identity"] == engine.draft.identity
    assert manifest["target"]["identity"] == engine.target.identity
    _, rows = load_dataset(directory, draft_identity=engine.draft.identity)
    assert sorted(r["prompt_id"] for r in rows) == sorted(p.id for p in TINY_PROMPTS)
    for row in rows:
        assert row["label_temperatures"] == [0.0, 1.0, 1.0]
        assert len(row["response_ids"]) == 12
        assert [len(y) for y in row["draft_ids"]] == [len(p) for p in row["labels"]] == [12, 12, 12]
        assert all(x in (0.0, 1.0) for x in row["labels"][0])  # greedy: exact match
        assert all(0.0 <= x <= 1.0 for labels in row["labels"] for x in labels)
        assert row["draft_ids"][1] != row["draft_ids"][2]  # independent draws


def test_resume_generates_only_missing_prompts(tiny_dataset, tmp_path):
    raw, directory = resumable_copy(tiny_dataset, tmp_path)
    removed = shard_paths(directory)[1]
    removed_ids = set(pq.read_table(removed).column("prompt_id").to_pylist())
    kept = {p.name: p.read_bytes() for p in shard_paths(directory) if p != removed}
    removed.unlink()

    manifest = generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    new = [p for p in shard_paths(directory) if p.name not in kept]
    assert [set(pq.read_table(p).column("prompt_id").to_pylist()) for p in new] == [removed_ids]
    assert all(p.read_bytes() == kept[p.name] for p in shard_paths(directory) if p.name in kept)  # untouched
    assert manifest["counts"]["sequences"] == 7 and manifest["complete"]

    again = generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)  # nothing left: no Ray work
    assert again["counts"] == manifest["counts"] and len(shard_paths(directory)) == 3


@pytest.mark.parametrize("cut", [0, 100])
def test_a_shard_cut_short_is_generated_again(tiny_dataset, tmp_path, cut):
    """Found by a bug hunt: a shard a crashed machine (or a copy cut off) left short was refused
    ("corrupt or not parquet") on every rerun, where docs/resuming.md says it is redone."""
    raw, directory = resumable_copy(tiny_dataset, tmp_path)
    cut_short = shard_paths(directory)[1]
    ids = set(pq.read_table(cut_short).column("prompt_id").to_pylist())
    cut_short.write_bytes(cut_short.read_bytes()[:cut])

    manifest = generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
    assert manifest["counts"]["sequences"] == 7 and manifest["complete"]
    assert cut_short.with_name(cut_short.name + ".corrupt").stat().st_size == cut  # kept aside, not read
    redone = {p.name: set(pq.read_table(p).column("prompt_id").to_pylist()) for p in shard_paths(directory)}
    assert ids in redone.values() and len(redone) == 3
    load_dataset(directory)


def test_a_worker_killed_mid_run_is_restarted_and_nothing_is_lost(tiny_dataset, tmp_path):
    """A gen-data worker killed once its first shard is written is restarted, its chunk sent again:
    the run completes with the rows an undisturbed run writes (the seeds are per prompt)."""
    import threading
    import time

    import psutil

    raw, _ = tiny_dataset
    raw = {**raw, "data": {**raw["data"], "dir": str(tmp_path / "data"), "shard_size": 1},
           "scaling": {**raw["scaling"], "num_workers": 1}}
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(manifest=generate_dataset(
        parse_config(raw), prompts=TINY_PROMPTS, progress=False)))
    run.start()
    deadline = time.monotonic() + 120
    while not shard_paths(tmp_path / "data") and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [p for p in psutil.process_iter(["cmdline"]) if "ExampleWriter" in " ".join(p.info["cmdline"] or [])]
    assert len(workers) == 1, "the one gen-data worker was not found"
    workers[0].kill()
    run.join(timeout=300)
    manifest = done["manifest"]
    assert manifest["complete"] and manifest["counts"]["sequences"] == len(TINY_PROMPTS)
    _, rows = load_dataset(tmp_path / "data")
    _, undisturbed = load_dataset(tiny_dataset[0]["data"]["dir"])
    responses = {r["prompt_id"]: r["response_ids"] for r in undisturbed}
    assert sorted(r["prompt_id"] for r in rows) == sorted(responses)
    assert all(r["response_ids"] == responses[r["prompt_id"]] for r in rows)


def test_other_settings_in_the_same_directory_are_refused(tiny_dataset):
    raw, _ = tiny_dataset
    changed = {**raw, "data": {**raw["data"], "labels": {"temperatures": [0.5]}}}
    with pytest.raises(DatasetError, match="made with other settings \\(labels differs\\)"):
        generate_dataset(parse_config(changed), prompts=TINY_PROMPTS, progress=False)


def test_a_data_dir_it_cannot_write_is_one_line(tiny_dataset, tmp_path, monkeypatch):
    import specdec.training.data as data_module

    raw, _ = tiny_dataset
    locked = tmp_path / "locked"
    locked.mkdir()
    # (root passes permission bits, so the read-only file system is played by os.access)
    monkeypatch.setattr(data_module.os, "access", lambda path, mode: Path(path) != locked)
    with pytest.raises(DatasetError, match="data.dir .*locked is not writable"):
        generate_dataset(parse_config({**raw, "data": {**raw["data"], "dir": str(locked)}}), prompts=TINY_PROMPTS,
                         progress=False)


def test_a_run_that_wrote_no_shard_binds_no_settings(tiny_dataset, tmp_path):
    """A run that failed before its first shard (bad input found in the workers) left a manifest:
    the corrected config is taken, not refused as other settings."""
    raw, _ = tiny_dataset
    directory = copy_dataset(tiny_dataset, tmp_path)
    for shard in shard_paths(directory):
        shard.unlink()
    changed = {**raw, "data": {**raw["data"], "dir": str(directory), "labels": {"temperatures": [0.5]}}}
    manifest = generate_dataset(parse_config(changed), prompts=TINY_PROMPTS[:2], progress=False)
    assert manifest["complete"] and manifest["settings"]["labels"]["temperatures"] == [0.5]


def copy_dataset(tiny_dataset, tmp_path):
    raw, _ = tiny_dataset
    directory = tmp_path / "data"
    shutil.copytree(raw["data"]["dir"], directory)
    return directory


def resumable_copy(tiny_dataset, tmp_path):
    """(the config writing into a copy of the dataset, the copy)"""
    raw, directory = tiny_dataset[0], copy_dataset(tiny_dataset, tmp_path)
    return {**raw, "data": {**raw["data"], "dir": str(directory)}}, directory


def test_dataset_made_with_another_draft(tiny_dataset, tmp_path):
    directory = copy_dataset(tiny_dataset, tmp_path)
    with pytest.raises(IncompatibleModelsError, match="made with another draft model"):
        load_dataset(directory, draft_identity="0" * 64)


def test_corrupt_shard(tiny_dataset, tmp_path):
    directory = copy_dataset(tiny_dataset, tmp_path)
    shard = shard_paths(directory)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DatasetError, match=f"shard {shard} is corrupt"):
        load_dataset(directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["shards"][0].pop("sha256")  # without a checksum the parquet reader still catches it
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="is corrupt or not parquet"):
        load_dataset(directory)


def test_empty_shard(tiny_dataset, tmp_path):
    directory = copy_dataset(tiny_dataset, tmp_path)
    shard = shard_paths(directory)[0]
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, 0), shard)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["shards"][0].pop("sha256")
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=f"shard {shard} is empty"):
        load_dataset(directory)


def test_missing_dataset(tmp_path):
    with pytest.raises(DatasetError, match="no dataset at .* run `specdec gen-data` first"):
        load_dataset(tmp_path)


@pytest.mark.parametrize("text", ["[]", "null", '{"settings": []}'])
def test_a_manifest_that_is_not_one_is_corrupt(tmp_path, text):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(DatasetError, match="corrupt manifest .*not a manifest's object"):
        read_manifest(tmp_path)


def test_a_features_dataset_is_not_taken_for_a_model_drafts_labels(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"kind": "features", "settings": {}, "shards": []}))
    with pytest.raises(DatasetError, match="holds features data, not a model draft's labels"):
        load_dataset(tmp_path, draft_identity="0" * 64)


def test_a_draft_that_is_not_a_transformers_model_is_one_line(tmp_path):
    from specdec.errors import ModelSourceError
    from specdec.training.data import model_entry

    (tmp_path / "config.json").write_text("{}")  # a directory with a config of no model_type (a feature draft's)
    with pytest.raises(ModelSourceError, match="models.draft .* is not a transformers model"):
        model_entry(str(tmp_path), "draft", None)


def test_prompts_longer_than_the_context_get_an_empty_row(tiny_pair):
    from specdec.training.data import FINISH_TOO_LONG, ExampleWriter
    from specdec.training.stdlib_prompts import Prompt

    raw = parse_config({"models": {"draft": str(tiny_pair[0]), "target": str(tiny_pair[1])},
                        "data": {"dir": "unused", "response": {"max_new_tokens": 4}}})
    writer = ExampleWriter(raw.models, raw.data, threads=1)
    (row,) = writer.rows([Prompt("long", "x" * 300, "train")])  # byte tokens: 300+ > 256 positions
    assert row["finish_reason"] == FINISH_TOO_LONG and row["labels"] == [] and row["response_ids"] == []


def test_sources_take_turns_and_validation_comes_first():
    from specdec.training.config import DataSection
    from specdec.training.data import select_prompts
    from specdec.training.stdlib_prompts import Prompt

    def source(name, n):
        return [Prompt(f"{name}:{i}", "t", "validation" if i % 3 == 0 else "train") for i in range(n)]

    data = DataSection(dir="d", prompts={"train": 2, "validation": 1})
    chosen = select_prompts(data, {"code": source("code", 9), "prose": source("prose", 4)})
    assert [p.id for p in chosen] == ["code:0", "prose:0", "code:1", "prose:1", "code:2", "prose:2"]


def test_a_dataset_continues_with_added_sources_only(tmp_path):
    from specdec.training.data import _check_same_settings

    found = {"prompt_source": ["stdlib-docstrings", "prose"], "seed": 0}
    _check_same_settings(tmp_path, dict(found), {**found, "prompt_source": [*found["prompt_source"], "package-docstrings"]})
    for fewer in ("stdlib-docstrings", ["stdlib-docstrings", "package-docstrings"]):
        with pytest.raises(DatasetError, match="prompt_source differs"):
            _check_same_settings(tmp_path, dict(found), {**found, "prompt_source": fewer})
