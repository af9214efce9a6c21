"""gen-data: what the workers refuse on the config's behalf reaches the user as one line (bug hunt:
it came back as Ray's task error, the worker's traceback inside, or killed the run with a traceback
when the worker refused while loading its models)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_PROMPTS, tiny_config

from specdec.errors import InvalidRequestError, ModelSourceError
from specdec.training.config import parse_config
from specdec.training.data import ExampleWriter, generate_dataset, shard_paths


def test_a_k_past_the_models_context_is_one_line(tiny_pair, tmp_path, ray_local):
    raw = tiny_config(tiny_pair, tmp_path)
    raw["data"]["response"]["k"] = 300  # the tiny models' context is 256 positions: refused by the engine
    with pytest.raises(InvalidRequestError) as refused:
        generate_dataset(parse_config(raw), prompts=TINY_PROMPTS[:3], progress=False)
    assert str(refused.value) == "k must be at most the models' context of 256 tokens, got 300"
    assert not shard_paths(tmp_path / "data")


def test_a_draft_vocab_id_past_the_drafts_vocabulary_is_one_line_before_the_workers(tiny_pair, tmp_path, ray_local,
                                                                                   monkeypatch):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps([0, 1, 99999]))  # the tiny draft has 259 ids
    raw = tiny_config(tiny_pair, tmp_path)
    raw["models"]["draft_vocab"] = str(vocab)

    def no_workers(*args, **kwargs):
        raise AssertionError("workers started (each loads both models) for a vocabulary the driver can check")

    monkeypatch.setattr(ray_local, "remote", no_workers)
    with pytest.raises(ModelSourceError, match=r"token ids in \[0, 259\)") as refused:
        generate_dataset(parse_config(raw), prompts=TINY_PROMPTS[:3], progress=False)
    assert "\n" not in str(refused.value)
    assert not shard_paths(tmp_path / "data")


def test_a_worker_that_refuses_its_models_raises_it_from_its_task(tiny_pair, tmp_path):
    """A Ray actor whose constructor raises dies (and is restarted, to die again) with a traceback the
    driver cannot read back; the refusal is raised by its task instead, which the driver prints in one line."""
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps([0, 1, 99999]))
    raw = tiny_config(tiny_pair, tmp_path)
    raw["models"]["draft_vocab"] = str(vocab)
    config = parse_config(raw)
    writer = ExampleWriter(config.models, config.data, threads=1)  # does not raise
    with pytest.raises(ModelSourceError, match=r"token ids in \[0, 259\)"):
        writer.rows(TINY_PROMPTS[:1])
