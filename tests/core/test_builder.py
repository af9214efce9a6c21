import json

import pytest
import torch

from specdec.builder import EngineConfig, build_engine, resolve_device, resolve_dtype
from specdec.errors import ModelSourceError


def test_auto_device_is_the_cpu_without_a_gpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ModelSourceError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ModelSourceError, match="unknown device 'tpu7'"):
        resolve_device("tpu7")


def test_models_load_on_the_configured_device(tiny_pair):
    draft, target = tiny_pair
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target), device="cpu"), progress=False)
    assert engine.draft.model.device.type == engine.target.model.device.type == "cpu"


def test_auto_dtype_is_bfloat16_on_a_gpu_and_float32_on_the_cpu():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16


def test_a_half_dtype_on_the_cpu_is_a_clear_error(tiny_pair):
    draft, target = tiny_pair
    with pytest.raises(ModelSourceError, match="dtype 'bfloat16' on the CPU"):
        build_engine(EngineConfig(draft=str(draft), target=str(target), device="cpu", dtype="bfloat16"), progress=False)


def test_auto_draft_quant_requantizes_only_the_default_draft_on_llamacpp(tiny_pair):
    from specdec.builder import DEFAULT_DRAFT_QUANT, resolve_draft_quant
    from specdec.models.sources import SHIPPED

    assert EngineConfig().draft_quant == "auto"
    assert resolve_draft_quant(EngineConfig(runtime="llamacpp")) == DEFAULT_DRAFT_QUANT
    assert resolve_draft_quant(EngineConfig(runtime="torch")) == SHIPPED  # torch converts the GGUF as shipped
    assert resolve_draft_quant(EngineConfig(runtime="llamacpp", draft="/models/mine.gguf")) == SHIPPED
    assert resolve_draft_quant(EngineConfig(runtime="llamacpp", draft_quant="q4_0")) == "q4_0"
    draft, target = tiny_pair  # HF directories: torch, as shipped, with nothing to requantize
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target)), progress=False)
    assert engine.draft.kind == "torch"


@pytest.mark.parametrize("target", ["/no/such/target", "/no/such/target.gguf", "not a hub id"])
def test_a_mistyped_target_fails_before_the_draft_is_loaded(tiny_pair, monkeypatch, target):
    import specdec.builder

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before every source was checked")

    monkeypatch.setattr(specdec.builder, "load_model", no_load)
    with pytest.raises(ModelSourceError, match="no such"):
        build_engine(EngineConfig(draft=str(tiny_pair[0]), target=target), progress=False)


def test_a_feature_draft_on_the_llamacpp_runtime_is_a_clear_error(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from specdec.models.feature_files import save_feature_draft
    from specdec.models.sources import model_identity
    from tiny import tiny_feature_draft

    draft = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(tiny_pair[1]))
    draft.config = draft.config.model_copy(update={"target_identity": model_identity(tiny_pair[1])})
    save_feature_draft(draft, tmp_path / "feature")
    with pytest.raises(ModelSourceError, match="use --runtime torch"):
        build_engine(EngineConfig(draft=str(tmp_path / "feature"), target=str(tiny_pair[1]), runtime="llamacpp"),
                     progress=False)
    engine = build_engine(EngineConfig(draft=str(tmp_path / "feature"), target=str(tiny_pair[1])), progress=False)
    assert engine.draft.reads_features and engine.rules.drafts["default"].reads_features and engine.head is None
    assert engine.draft.kv is None and not engine.draft.chain_steps  # the CPU's slots, step by step


def test_a_shipped_feature_draft_is_named_and_its_own_head_found(tiny_pair, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoModelForCausalLM

    import specdec.drafts
    import specdec.heads
    from specdec.drafts import draft_dir
    from specdec.heads import resolve_head
    from specdec.models.feature_files import save_feature_draft
    from specdec.models.sources import model_identity
    from tiny import tiny_feature_draft

    assert draft_dir("default-feature") == specdec.drafts.DRAFTS_DIR / "default-feature"
    assert draft_dir("~/runs/fused") == draft_dir("~").joinpath("runs", "fused")
    draft = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(tiny_pair[1]))
    draft.config = draft.config.model_copy(update={"target_identity": model_identity(tiny_pair[1])})
    save_feature_draft(draft, tmp_path / "shipped")
    monkeypatch.setitem(specdec.drafts.SHIPPED_FEATURE_DRAFTS, "default-feature", tmp_path / "shipped")
    engine = build_engine(EngineConfig(draft="default-feature", target=str(tiny_pair[1])), progress=False)
    assert engine.draft.reads_features and engine.draft.name == "default-feature" and engine.head is None
    shutil.copytree(specdec.heads.SHIPPED["default"], tmp_path / "shipped" / "head")  # any head: the name finds it
    assert resolve_head("auto", "default-feature") == str(tmp_path / "shipped" / "head")


@pytest.mark.skipif(torch.cuda.is_available(), reason="resolves `auto` as a process without a GPU does")
def test_the_coordinator_takes_the_context_limit_of_its_replicas_on_a_gpu(tmp_path):
    """A served app's coordinator often has no GPU: `runtime: auto` resolves to llama.cpp (8192
    positions) there, while its replicas on a GPU run torch on the static cache (4096): it must
    refuse what they cannot hold, not accept it and fail mid-request."""
    from specdec.builder import build_rules
    from specdec.models.llamacpp import LlamaCppOptions
    from specdec.models.static import StaticOptions
    from tiny import byte_level_tokens, tiny_gguf_weights, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_gguf_weights(len(byte_level_tokens())), context=32768)
    config = EngineConfig(draft=str(gguf), target=str(gguf), kv_cache="static", cache_dir=str(tmp_path / "cache"))
    here = build_rules(config, progress=False)
    assert here.max_context == LlamaCppOptions().context
    on_cpus = build_rules(config, progress=False, devices={"target": "cpu", "draft": "cpu"})
    assert on_cpus.max_context == LlamaCppOptions().context
    on_gpus = build_rules(config, progress=False, devices={"target": "cuda", "draft": "cuda"})
    assert on_gpus.max_context == StaticOptions().capacity < LlamaCppOptions().context


def test_a_head_that_is_not_one_is_refused_before_any_model_loads(tiny_pair, tmp_path, monkeypatch):
    """Found by a bug hunt: a mistyped --head was reported after both models loaded (with the
    default pair: after the 1.6 GB fetch and the requantization)."""
    import specdec.builder

    draft, target = tiny_pair
    monkeypatch.setattr(specdec.builder, "build_draft", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(ModelSourceError, match="no acceptance head at"):
        build_engine(EngineConfig(draft=str(draft), target=str(target), head=str(tmp_path / "nowhere")), progress=False)


def test_a_second_drafts_foreign_head_names_the_draft_and_what_to_do(tiny_pair, tmp_path):
    """Found by a bug hunt: a draft of --also-draft whose directory holds another draft's head/
    failed with "pass --head none", which applies to the first draft only."""
    import shutil

    from specdec.errors import IncompatibleModelsError
    from specdec.head import AcceptanceHead, HeadConfig

    draft, target = tiny_pair
    second = tmp_path / "second"
    shutil.copytree(draft, second)
    hidden = json.loads((draft / "config.json").read_text())["hidden_size"]
    AcceptanceHead(HeadConfig(hidden_size=hidden, depth=1, draft_identity="b" * 64)).save(second / "head")
    with pytest.raises(IncompatibleModelsError, match=r"^draft 'h': head .* was trained for another draft .*; "
                                                      r"a draft besides the first reads the head in its own directory"):
        build_engine(EngineConfig(draft=str(draft), target=str(target), head="none", drafts={"h": str(second)}),
                     progress=False)


def test_fusing_the_suffix_draft_is_said_by_the_source_only():
    """`suffix+SOURCE` is how a user fuses the suffix draft; the flag the builder sets from it
    (draft_configs: the draft's config names SOURCE) is no field a config can set: a Serve config's
    `models: {fuse_suffix: true}` was a second, undocumented way to say it."""
    import pickle

    from pydantic import ValidationError

    from services.config import AppConfig
    from specdec.builder import draft_configs

    with pytest.raises(ValidationError, match="fuse_suffix\n  Extra inputs are not permitted"):
        EngineConfig(draft="default", fuse_suffix=True)
    with pytest.raises(ValidationError, match="fuse_suffix\n  Extra inputs are not permitted"):
        AppConfig.model_validate({"models": {"fuse_suffix": True}})
    config = EngineConfig(draft="suffix+default", drafts={"plain": "default", "suffix": "suffix"})
    drafts = draft_configs(config)
    assert [(each.draft, each.fuse_suffix) for each in drafts.values()] == [
        ("default", True), ("default", False), ("suffix", False)]
    # as the replicas take it (services/replicas.py draft_worker: a copy; Ray: pickled)
    fused = pickle.loads(pickle.dumps(drafts["default"].model_copy(update={"threads": 2})))
    assert (fused.draft, fused.fuse_suffix, fused.threads) == ("default", True, 2)
    assert "fuse_suffix" not in fused.model_dump() and not config.fuse_suffix
