"""Weighted binary cross-entropy of the acceptance head (paper §3.3).

Over the positions holding a draft token Y_i (`mixing.mix_tokens`' is_draft mask):

    L = mean_i [ - w_acc * P_i * log Phat_i  -  w_rej * (1 - P_i) * log(1 - Phat_i) ]

with P_i the soft label and Phat_i = sigmoid(l_i) the head's prediction from its logit l_i.
w_rej > 1 counters the class imbalance (most P_i are near 1) and the over-confidence that the
train/inference shift causes; the paper uses w_acc = 1 and w_rej in {1, 3, 6, 12}.

From logits: log Phat = logsigmoid(l) and log(1 - Phat) = logsigmoid(-l), finite and with finite
gradients for any finite logit (no log(0) when sigmoid saturates).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Reduction = Literal["mean", "weighted_mean"]


def weighted_bce_terms(
    logits: torch.Tensor,  # [...] l_i
    soft_labels: torch.Tensor,  # [...] P_i in [0, 1]
    w_acc: float = 1.0,
    w_rej: float = 1.0,
) -> torch.Tensor:
    """Per-position loss [...] = -w_acc * P * logsigmoid(l) - w_rej * (1 - P) * logsigmoid(-l), in fp32."""
    logits, labels = logits.float(), soft_labels.float()
    return -w_acc * labels * F.logsigmoid(logits) - w_rej * (1.0 - labels) * F.logsigmoid(-logits)


def weighted_bce_loss(
    logits: torch.Tensor,  # [...] l_i
    soft_labels: torch.Tensor,  # [...] P_i; any value (even NaN) where mask is False
    mask: torch.Tensor | None = None,  # [...] bool, True where the loss is taken (draft positions)
    w_acc: float = 1.0,
    w_rej: float = 1.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """The scalar loss L over the masked positions (all positions when mask is None).

    reduction="mean" divides by the number of positions, as the paper writes L.
    reduction="weighted_mean" divides by sum_i (w_acc * P_i + w_rej * (1 - P_i)) instead, as the
    official code does (a class-weighted cross-entropy's normalisation): the same minimiser per
    batch, a gradient scale that does not grow with w_rej.

    No positions selected -> 0.0, still attached to the logits' graph (its gradient is zero).
    A batch whose positions all came from X (short sequences, r close to 1) is legitimate, and in
    data-parallel training every worker must call backward on a loss that reaches all parameters,
    so an error or a detached zero would break an otherwise valid step.
    """
    if w_acc < 0 or w_rej < 0:
        raise ValueError(f"weights must be non-negative, got w_acc={w_acc}, w_rej={w_rej}")
    if soft_labels.shape != logits.shape:
        raise ValueError(f"soft labels {tuple(soft_labels.shape)} and logits {tuple(logits.shape)} differ in shape")
    if mask is not None:
        if mask.shape != logits.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool with the logits' shape {tuple(logits.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        # Select rather than multiply by the mask: labels at unused positions may be NaN or -100.
        logits, soft_labels = logits[mask], soft_labels[mask]  # [M]
    if logits.numel() == 0:
        return logits.float().sum() * 0.0
    terms = weighted_bce_terms(logits, soft_labels, w_acc, w_rej)  # [M]
    if reduction == "mean":
        return terms.mean()
    if reduction == "weighted_mean":
        labels = soft_labels.float()
        weight = (w_acc * labels + w_rej * (1.0 - labels)).sum()
        return terms.sum() / weight.clamp_min(torch.finfo(weight.dtype).tiny)
    raise ValueError(f"unknown reduction {reduction!r}; expected 'mean' or 'weighted_mean'")
