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
