"""Weighted BCE: a hand-computed value, masking, agreement with torch's BCE, stability, the optimum."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec.training.loss import weighted_bce_loss, weighted_bce_terms

# Phat = sigmoid(logit) = 0.5, 0.75, 0.25 at the three used positions; the fourth is masked out.
LOGITS = torch.tensor([0.0, math.log(3.0), -math.log(3.0), 2.0])
LABELS = torch.tensor([1.0, 0.5, 0.2, math.nan])
MASK = torch.tensor([True, True, True, False])
W_ACC, W_REJ = 1.0, 3.0


def hand_terms() -> list[float]:
    """-w_acc * P * log Phat - w_rej * (1 - P) * log(1 - Phat) per used position."""
    return [
        -W_ACC * 1.0 * math.log(0.5) - W_REJ * 0.0 * math.log(0.5),
        -W_ACC * 0.5 * math.log(0.75) - W_REJ * 0.5 * math.log(0.25),
        -W_ACC * 0.2 * math.log(0.25) - W_REJ * 0.8 * math.log(0.75),
    ]


def test_matches_hand_computed_value():
    loss = weighted_bce_loss(LOGITS, LABELS, MASK, w_acc=W_ACC, w_rej=W_REJ)
    assert loss.shape == ()
    assert float(loss) == pytest.approx(sum(hand_terms()) / 3, rel=1e-6)
    assert float(loss) == pytest.approx(1.294709, abs=1e-6)  # (0.693147 + 2.223283 + 0.967696) / 3


def test_weighted_mean_divides_by_the_weight_mass():
    loss = weighted_bce_loss(LOGITS, LABELS, MASK, w_acc=W_ACC, w_rej=W_REJ, reduction="weighted_mean")
    weight = (1.0 + 3.0 * 0.0) + (0.5 + 3.0 * 0.5) + (0.2 + 3.0 * 0.8)  # 5.6
    assert float(loss) == pytest.approx(sum(hand_terms()) / weight, rel=1e-6)


def test_masked_positions_do_not_count():
    base = weighted_bce_loss(LOGITS, LABELS, MASK, w_rej=W_REJ)
    changed_logits, changed_labels = LOGITS.clone(), LABELS.clone()
    changed_logits[3], changed_labels[3] = -50.0, 0.0
    assert float(weighted_bce_loss(changed_logits, changed_labels, MASK, w_rej=W_REJ)) == float(base)
    assert math.isfinite(float(base))  # the NaN label at the masked position is ignored

    logits = LOGITS.clone().requires_grad_()
    weighted_bce_loss(logits, LABELS, MASK, w_rej=W_REJ).backward()
    assert logits.grad[3] == 0.0 and bool((logits.grad[:3] != 0).all())

    used = weighted_bce_loss(LOGITS[:3], LABELS[:3], w_rej=W_REJ)  # mask=None: all positions
    torch.testing.assert_close(base, used)


@pytest.mark.parametrize(("w_acc", "w_rej"), [(1.0, 1.0), (1.0, 6.0), (2.0, 0.5)])
def test_agrees_with_torch_bce_with_pos_weight(w_acc, w_rej):
    """w_rej * BCE(pos_weight = w_acc / w_rej) is the same weighted loss."""
    generator = torch.Generator().manual_seed(0)
    logits, labels = 3 * torch.randn(200, generator=generator), torch.rand(200, generator=generator)
    reference = w_rej * F.binary_cross_entropy_with_logits(logits, labels, pos_weight=torch.tensor(w_acc / w_rej))
    torch.testing.assert_close(weighted_bce_loss(logits, labels, w_acc=w_acc, w_rej=w_rej), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_logits_give_finite_loss_and_gradients(dtype):
    logits = torch.tensor([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4], dtype=dtype, requires_grad=True)
    labels = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.0, 1.0, 0.3])
    loss = weighted_bce_loss(logits, labels, w_rej=12.0)
    loss.backward()
    loss = loss.detach()
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))
    assert bool(torch.isfinite(logits.grad).all())
    assert float(loss) > 100.0  # confidently wrong positions cost ~|logit|, not a clipped log(eps)


def test_empty_mask_gives_zero_attached_to_the_graph():
    logits = torch.randn(5, requires_grad=True)
    loss = weighted_bce_loss(logits, torch.rand(5), torch.zeros(5, dtype=torch.bool), w_rej=6.0)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    loss.backward()
    torch.testing.assert_close(logits.grad, torch.zeros(5))


@pytest.mark.parametrize(("w_acc", "w_rej"), [(1.0, 1.0), (1.0, 6.0)])
def test_optimum_is_the_reweighted_label(w_acc, w_rej):
    """d/dl = 0 at sigmoid(l) = w_acc P / (w_acc P + w_rej (1 - P)): the label itself when w_acc = w_rej,
    a more cautious prediction when rejections weigh more."""
    labels = torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
    optimum = w_acc * labels / (w_acc * labels + w_rej * (1 - labels))
    logits = torch.logit(optimum).requires_grad_()
    weighted_bce_terms(logits.double(), labels, w_acc, w_rej).sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(4, dtype=torch.float64), atol=1e-6, rtol=0)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="non-negative"):
        weighted_bce_loss(LOGITS, LABELS, MASK, w_rej=-1.0)
    with pytest.raises(ValueError, match="reduction"):
        weighted_bce_loss(LOGITS, LABELS, MASK, reduction="sum")
    with pytest.raises(ValueError, match="mask"):
        weighted_bce_loss(LOGITS, LABELS, MASK.long())
    with pytest.raises(ValueError, match="shape"):
        weighted_bce_loss(LOGITS, LABELS[:3])
