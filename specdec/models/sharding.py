"""The target model sharded across the devices of its replica: a layer-contiguous pipeline split.

accelerate computes the split (`infer_auto_device_map` over a weightless copy of the model) and
transformers loads into it (`from_pretrained(device_map=...)`); accelerate's hooks move the hidden
states from one device to the next. On CPU the target is one shard.

Worked example (Qwen2.5-Coder-1.5B: 28 decoder layers, tied embeddings) over 4 devices:

    model.embed_tokens, lm_head (tied: one tensor)   -> cuda:0
    model.layers.0..6                                -> cuda:0   7 layers
    model.layers.7..13                               -> cuda:1   7 layers
    model.layers.14..20                              -> cuda:2   7 layers
    model.layers.21..27, model.norm, rotary_emb      -> cuda:3   7 layers

With untied embeddings `lm_head` goes to the last device. When the layers do not divide evenly the
last devices take one more each: the first device already holds the embedding.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import compute_module_sizes, infer_auto_device_map
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specdec.errors import SpecDecError

DeviceMap = dict[str, str]  # module name ("" = the whole model) -> device, as from_pretrained takes it


class ShardingError(SpecDecError):
    """The target cannot be split as configured (shard count, devices)."""


class ShardingConfig(BaseModel):
    """How many shards the target is split into, and onto which devices.

    `devices` unset means the first `shards` CUDA devices of the machine the model loads on (resolved
    there, by `resolve_devices`), or ["cpu"] on a machine without CUDA, where only one shard is
    possible. Devices named explicitly are taken as given; a list of "cpu" entries runs the
    multi-shard path on one CPU, which is how it is tested."""

    model_config = ConfigDict(extra="forbid")

    shards: int = Field(1, ge=1)
    devices: list[str] | None = None

    @model_validator(mode="after")
    def _devices_match_shards(self) -> ShardingConfig:
        if self.devices is not None and len(self.devices) != self.shards:
            raise ValueError(f"{len(self.devices)} devices given for {self.shards} shards; "
                             "name one device per shard")
        return self

    def resolve_devices(self) -> list[str]:
        if self.devices is not None:
            return list(self.devices)
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available == 0:
            if self.shards > 1:
                raise ShardingError(f"sharding: {self.shards} shards need {self.shards} CUDA devices and this "
                                    "machine has none; on CPU the target runs as one shard (shards: 1)")
            return ["cpu"]
        if self.shards > available:
            raise ShardingError(f"sharding: {self.shards} shards need {self.shards} CUDA devices and this "
                                f"machine has {available}")
        return [f"cuda:{i}" for i in range(self.shards)]


def plan_device_map(model_config: PretrainedConfig, devices: list[str],
                    dtype: torch.dtype | None = None) -> DeviceMap:
    """A balanced, layer-contiguous split of a decoder-only model over `devices`, in order.

    The decoder layers are dealt out as evenly as possible (counts differ by at most one); the modules
    before the first layer (the embedding, and a tied lm_head with it) go to the first device, those
    after the last (final norm, rotary embedding, an untied lm_head) to the last. `devices` may repeat
    a name ("cpu" twice): the split is computed on slots 0..n-1 and named afterwards."""
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    model.tie_weights()  # from_config under init_empty_weights leaves tied weights untied (transformers 5)
    no_split = list(model._no_split_modules or [])
    units, layers = _placement_units(model, no_split)
    if not layers:
        raise ShardingError(f"sharding: {type(model).__name__} names no decoder layer class to split at")
    if len(devices) > len(layers):
        raise ShardingError(f"sharding: cannot split {len(layers)} layers over {len(devices)} devices")

    max_memory = _balanced_max_memory(compute_module_sizes(model, dtype=dtype), units, layers, len(devices))
    with _quiet_accelerate():
        slot_map = infer_auto_device_map(model, max_memory, no_split_module_classes=no_split, dtype=dtype)
    # The budgets rest on how accelerate fills devices; should that change, fail here, not on a GPU.
    placed = [_device_of(slot_map, layer) for layer in layers]
    if ([placed.count(slot) for slot in range(len(devices))] != layer_counts(len(layers), len(devices))
            or not all(isinstance(slot, int) for slot in slot_map.values())):  # or offloaded to "disk"
        raise RuntimeError(f"accelerate did not split the layers as budgeted: {slot_map}")
    return {name: devices[slot] for name, slot in slot_map.items()}


def load_sharded(model_dir: str | Path, config: ShardingConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    devices = config.resolve_devices()
    if len(devices) == 1:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(devices[0]).eval()
    plan = plan_device_map(AutoConfig.from_pretrained(model_dir), devices, dtype)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=plan).eval()


def layer_counts(n_layers: int, n_devices: int) -> list[int]:
    """Layers per device, differing by at most one; the extra layers go to the last devices because
    the first holds the embedding. layer_counts(28, 3) == [9, 9, 10]."""
    base, extra = divmod(n_layers, n_devices)
    return [base + (i >= n_devices - extra) for i in range(n_devices)]


def _placement_units(model: nn.Module, no_split: list[str]) -> tuple[list[str], list[str]]:
    """What accelerate places whole, in forward order: the outermost unsplittable blocks (the decoder
    layers) and the leaf modules outside them (embedding, norm, rotary embedding, lm_head).
    Returns (units, the decoder layers among them)."""
    units, layers = [], []
    for name, module in model.named_modules():  # depth first: a unit's submodules follow it
        if not name or any(name.startswith(unit + ".") for unit in units[-1:]):
            continue
        if type(module).__name__ in no_split:
            layers.append(name)
        if type(module).__name__ in no_split or not any(module.children()):
            units.append(name)
    return units, layers


def _balanced_max_memory(sizes: dict[str, int], units: list[str], layers: list[str],
                         n_devices: int) -> dict[int, int]:
    """Per-slot byte budgets under which accelerate's greedy fill yields the `layer_counts` split.

    accelerate's own balancing (`get_balanced_memory`, what device_map="balanced" uses) is uneven for
    these models. infer_auto_device_map keeps room on the first device for the largest unit still
    to place (headroom for offloading), and get_balanced_memory pads every budget by 1.25 x the
    largest leaf, here the embedding (151936 x 1536 for the 1.5B target: five layers' worth). For
    the 1.5B target over 4 devices that gives 3/9/9/7 layers (untied: 0/10/10/8). So each budget is
    the bytes of what the device should hold, plus that headroom on the first device, plus half a
    layer of slack: what is meant for a device always fits and the next layer never does.
    """
    counts = layer_counts(len(layers), n_devices)
    layer_slots = iter([slot for slot, count in enumerate(counts) for _ in range(count)])
    first_layer, is_layer = units.index(layers[0]), set(layers)
    slot_of = {unit: next(layer_slots) if unit in is_layer else (0 if i < first_layer else n_devices - 1)
               for i, unit in enumerate(units)}

    budgets = dict.fromkeys(range(n_devices), min(sizes[name] for name in layers) // 2)  # the slack
    for unit, slot in slot_of.items():
        budgets[slot] += sizes[unit]
    budgets[0] += max((sizes[unit] for unit, slot in slot_of.items() if slot > 0), default=0)  # the headroom
    budgets[n_devices - 1] = sizes[""] + max(sizes[unit] for unit in units)  # the last device takes what is left
    return budgets


def _device_of(device_map: dict, module: str):
    """Where `device_map` puts `module`: the entry for its longest listed prefix ("" = everything)."""
    owners = [name for name in device_map if name == "" or module == name or module.startswith(name + ".")]
    return device_map[max(owners, key=len)]


@contextmanager
def _quiet_accelerate():
    """The slots are passed to accelerate as integer device ids, which it checks against the CUDA
    devices present and warns about one by one; the names are only attached afterwards."""
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
