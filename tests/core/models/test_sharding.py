"""The target's sharding plan: balanced, layer-contiguous, every module placed; and a sharded load
(on CPU, every shard on "cpu") that computes the same logits as the plain model."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model, init_empty_weights
from accelerate.utils import check_device_map
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, Qwen2Config

from specdec.models.sharding import ShardingConfig, ShardingError, layer_counts, load_sharded, plan_device_map
from tiny import tiny_model

VOCAB = 64
TINY_LAYERS = 8


def coder_1_5b_config(tied: bool = True) -> Qwen2Config:
    """The shape of Qwen2.5-Coder-1.5B, written out (no download)."""
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=tied)


CONFIGS = {
    "tiny": lambda: tiny_model(VOCAB, layers=TINY_LAYERS).config,
    "coder-1.5b": coder_1_5b_config,
    "coder-1.5b-untied": lambda: coder_1_5b_config(tied=False),
}


def device_of(plan: dict[str, str], module: str) -> str:
    """The device of `module` under `plan`: its longest listed prefix, as accelerate reads a map."""
    owners = [name for name in plan if name == "" or module == name or module.startswith(name + ".")]
    return plan[max(owners, key=len)]


def test_layer_counts_differ_by_at_most_one_with_extras_last():
    assert layer_counts(28, 1) == [28]
    assert layer_counts(28, 3) == [9, 9, 10]
    assert layer_counts(28, 4) == [7, 7, 7, 7]
    assert layer_counts(8, 3) == [2, 3, 3]


@pytest.mark.parametrize("n_devices", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_is_balanced_and_layer_contiguous(name, n_devices):
    config = CONFIGS[name]()
    devices = [f"cuda:{i}" for i in range(n_devices)]  # a plan is only names: no GPU needed
    plan = plan_device_map(config, devices, dtype=torch.bfloat16)

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    check_device_map(model, plan)  # every parameter and buffer is placed
    assert set(plan.values()) <= set(devices)  # names as given, not accelerate's integer ids

    slots = [devices.index(device_of(plan, f"model.layers.{i}")) for i in range(config.num_hidden_layers)]
    assert slots == sorted(slots) and set(slots) == set(range(n_devices))  # contiguous, in order, all used
    assert [slots.count(slot) for slot in range(n_devices)] == layer_counts(config.num_hidden_layers, n_devices)

    assert device_of(plan, "model.embed_tokens") == devices[0]
    assert device_of(plan, "model.norm") == devices[-1]
    # a tied lm_head is the embedding's tensor, so it stays with it on the first device
    assert device_of(plan, "lm_head") == devices[0 if config.tie_word_embeddings else -1]


def test_plan_with_more_devices_than_layers_is_refused():
    with pytest.raises(ShardingError, match="cannot split 8 layers over 9 devices"):
        plan_device_map(CONFIGS["tiny"](), ["cpu"] * 9)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    model = tiny_model(VOCAB, layers=TINY_LAYERS, seed=3)
    path = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(path)
    return model, path


TOKENS = torch.tensor([[5, 17, 3, 42, 8, 11]])


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"], ["cpu"] * 4])
def test_sharded_load_computes_the_same_logits(tiny_target, devices):
    model, path = tiny_target
    sharded = load_sharded(path, ShardingConfig(shards=len(devices), devices=devices))
    with torch.no_grad():
        assert torch.equal(sharded(TOKENS).logits, model(TOKENS).logits)


def test_plan_runs_under_accelerate_hooks(tiny_target):
    """from_pretrained adds accelerate's hooks only when the plan names several devices; force them
    here so the hidden states pass through every shard boundary as they would between GPUs."""
    model, path = tiny_target
    plan = plan_device_map(model.config, ["cpu"] * 4)
    hooked = dispatch_model(AutoModelForCausalLM.from_pretrained(path), device_map=plan, force_hooks=True)
    assert hasattr(hooked.model.layers[0], "_hf_hook")
    with torch.no_grad():
        assert torch.equal(hooked(TOKENS).logits, model(TOKENS).logits)


def without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def with_cuda(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_devices_default_to_cpu_without_cuda(monkeypatch):
    without_cuda(monkeypatch)
    assert ShardingConfig().resolve_devices() == ["cpu"]


def test_several_shards_without_cuda_is_a_one_line_error(monkeypatch):
    without_cuda(monkeypatch)
    with pytest.raises(ShardingError) as raised:
        ShardingConfig(shards=2).resolve_devices()
    message = str(raised.value)
    assert "\n" not in message
    assert message == ("sharding: 2 shards need 2 CUDA devices and this machine has none; "
                       "on CPU the target runs as one shard (shards: 1)")


def test_devices_default_to_the_first_cuda_devices(monkeypatch):
    with_cuda(monkeypatch, 4)
    assert ShardingConfig(shards=2).resolve_devices() == ["cuda:0", "cuda:1"]
    with_cuda(monkeypatch, 1)
    with pytest.raises(ShardingError, match="2 shards need 2 CUDA devices and this machine has 1$"):
        ShardingConfig(shards=2).resolve_devices()


def test_config_validation():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ShardingConfig(shards=0)
    with pytest.raises(ValidationError, match="2 devices given for 1 shards"):
        ShardingConfig(devices=["cuda:0", "cuda:1"])
    assert ShardingConfig(shards=2, devices=["cuda:1", "cuda:3"]).resolve_devices() == ["cuda:1", "cuda:3"]
