"""Weight formats and kernels per role.

`auto` picks what measured fastest on CPU for the role (see docs/performance.md):
draft steps feed one token at a time, verification passes feed K + 1 tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

WeightFormat = Literal["auto", "fp32", "onednn"]

AUTO_FORMAT = {"draft": "fp32", "target": "fp32"}


def apply_weight_format(model: nn.Module, role: str, weight_format: WeightFormat = "auto") -> nn.Module:
    fmt = AUTO_FORMAT[role] if weight_format == "auto" else weight_format
    if fmt == "fp32" or torch.cuda.is_available():
        return model
    if fmt == "onednn":
        return _to_onednn(model)
    raise ValueError(f"unknown weight format {weight_format!r}")


def _to_onednn(model: nn.Module) -> nn.Module:
    raise NotImplementedError
