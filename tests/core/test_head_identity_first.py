"""A head trained for another draft is refused before any model loads, where the draft's identity
is known without loading it (a model directory, a feature draft's directory, the pinned default),
not after the draft (and the target) loaded."""

from __future__ import annotations

import json
import shutil

import pytest

import specdec.builder
from specdec.builder import EngineConfig, build_engine
from specdec.errors import IncompatibleModelsError
from specdec.head import AcceptanceHead, HeadConfig

FOREIGN = "b" * 64  # a draft identity no test model has


def foreign_head(directory, hidden: int):
    AcceptanceHead(HeadConfig(hidden_size=hidden, depth=1, draft_identity=FOREIGN)).save(directory)
    return directory


def hidden_size(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["hidden_size"]


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The models loaded (by their directory), recorded instead of loading them."""
    loaded = []

    def record(directory, *args, **kwargs):
        loaded.append(str(directory))
        raise AssertionError(f"loaded {directory} before its head was checked")

    monkeypatch.setattr(specdec.builder, "load_model", record)
    monkeypatch.setattr(specdec.builder, "load_feature_draft", record)
    return loaded


def test_a_head_for_another_draft_is_refused_before_the_draft_loads(tiny_pair, tmp_path, loads):
    draft, target = tiny_pair
    head = foreign_head(tmp_path / "head", hidden_size(draft))
    with pytest.raises(IncompatibleModelsError, match=r"^head .* was trained for another draft model \(identity "
                                                      r"bbbbbbbbbbbb\), not this one .*; pass --head none"):
        build_engine(EngineConfig(draft=str(draft), target=str(target), head=str(head)), progress=False)
    assert loads == []


def test_a_second_drafts_foreign_head_is_refused_before_the_first_draft_loads(tiny_pair, tmp_path, loads):
    draft, target = tiny_pair
    second = tmp_path / "second"
    shutil.copytree(draft, second)
    foreign_head(second / "head", hidden_size(draft))  # its own head (`auto`), trained for another draft
    with pytest.raises(IncompatibleModelsError, match=r"^draft 'h': head .* was trained for another draft .*; "
                                                      r"a draft besides the first reads the head in its own directory"):
        build_engine(EngineConfig(draft=str(draft), target=str(target), head="none", drafts={"h": str(second)}),
                     progress=False)
    assert loads == []


def test_a_feature_drafts_foreign_head_is_refused_before_it_loads(tiny_pair, tmp_path, loads):
    from transformers import AutoModelForCausalLM

    from specdec.models.feature_files import save_feature_draft
    from specdec.models.sources import model_identity
    from tiny import tiny_feature_draft

    feature = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(tiny_pair[1]))
    feature.config = feature.config.model_copy(update={"target_identity": model_identity(tiny_pair[1])})
    save_feature_draft(feature, tmp_path / "feature")
    head = foreign_head(tmp_path / "head", hidden_size(tiny_pair[1]))
    with pytest.raises(IncompatibleModelsError, match="trained for another draft"):
        build_engine(EngineConfig(draft=str(tmp_path / "feature"), target=str(tiny_pair[1]), head=str(head)),
                     progress=False)
    assert loads == []


def test_the_identity_known_before_loading_is_the_loaded_drafts(tiny_pair, tmp_path):
    """What the early check compares is what the loaded draft carries: a directory's model_identity;
    the pinned default's GGUF identity, with the recipe of its requantization on llama.cpp (the
    shipped head serves each); None where only fetching or hashing the source tells (the check
    after loading then refuses)."""
    from specdec.builder import build_draft, known_draft_identity
    from specdec.head import read_head_config
    from specdec.heads import SHIPPED
    from tiny import byte_level_tokens, tiny_gguf_weights, write_tiny_gguf

    draft, target = tiny_pair
    config = EngineConfig(draft=str(draft), target=str(target))
    assert known_draft_identity(config) == build_draft(config, progress=False)[0].identity
    shipped = read_head_config(SHIPPED["default"])
    for each in (EngineConfig(draft="default", runtime="llamacpp"),  # draft_quant auto: iq4_nl
                 EngineConfig(draft="default", runtime="llamacpp", draft_quant="q4_0"),
                 EngineConfig(draft="suffix+default", runtime="llamacpp", draft_quant="shipped"),
                 EngineConfig(draft="default", runtime="torch")):
        assert shipped.serves(known_draft_identity(each)), each
    assert known_draft_identity(EngineConfig(draft="default", runtime="llamacpp")).endswith("+iq4_nl")
    assert known_draft_identity(EngineConfig(draft="default", runtime="torch", draft_quant="q4_0")) is None
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_gguf_weights(len(byte_level_tokens())))
    assert known_draft_identity(EngineConfig(draft=str(gguf), runtime="llamacpp")) is None
    assert known_draft_identity(EngineConfig(draft="org/model", runtime="torch")) is None
    assert known_draft_identity(EngineConfig(draft="suffix")) is None
