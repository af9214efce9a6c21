"""Weight formats and kernels per role (measurements in docs/performance.md).

On this class of CPU the stock fp32 path runs every Linear through MKL's sgemm, which is slow for
the few rows a decode step has (M = 1 for a draft step, M = K + 1 for a verification pass).
- `onednn`: the same fp32 weights reordered once for oneDNN (`torch.utils.mkldnn.MkldnnLinear`);
  exact fp32 math, 2-3x faster for small M and nearly flat in M.
- `int8`: dynamic int8 quantization of every Linear (weights int8 with one scale per output
  channel, activations quantized per call with ONE scale per pass). It changes the model's outputs
  slightly, so `auto` uses it only for the draft, where any distribution is allowed (losslessness
  holds for every draft); the target keeps exact fp32. Per-channel weight scales: with one scale
  per tensor the default draft's distributions moved by KL 0.05-0.17 nats a token from fp32's even
  one token a pass, per channel by under 0.01 (same speed). The per-pass activation scale is why
  the runtime feeds a session's first token in a pass of its own (`scales_activations_per_pass`).
- `fp32`: the stock path.
On a GPU every format is a no-op: the model runs as loaded.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import nn

with warnings.catch_warnings():  # MkldnnLinear is a ScriptModule; torch.jit warns it is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.utils.mkldnn import MkldnnLinear

WeightFormat = Literal["auto", "fp32", "onednn", "int8"]
WEIGHT_FORMATS = ("auto", "fp32", "onednn", "int8")

# On a CPU a drafting step is one token per session, bound by reading the weights: int8 reads a
# quarter of fp32's and accepts the same; a verification feeds K + 1 tokens, where oneDNN's fp32
# kernels are the fastest (docs/performance.md, "Forward time per weight format").
AUTO_FORMAT = {"draft": "int8", "target": "onednn"}


def resolve_format(role: str, weight_format: WeightFormat = "auto") -> str:
    return AUTO_FORMAT[role] if weight_format == "auto" else weight_format


def apply_weight_format(model: nn.Module, role: str, weight_format: WeightFormat = "auto") -> nn.Module:
    fmt = resolve_format(role, weight_format)
    if fmt == "fp32" or next(model.parameters()).device.type != "cpu":
        return model
    if fmt == "onednn":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return _replace_linears(model, lambda linear: MkldnnLinear(linear, torch.float32))
    if fmt == "int8":
        with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
            warnings.simplefilter("ignore")
            return torch.ao.quantization.quantize_dynamic(
                model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8)
    raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def scales_activations_per_pass(model: nn.Module) -> bool:
    """True when the model's Linears quantize their input with one scale per call (`int8`): every
    token of a pass then shares the scale its largest activation sets."""
    return any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules())


def _replace_linears(module: nn.Module, convert) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, convert(child))
        else:
            _replace_linears(child, convert)
    return module
