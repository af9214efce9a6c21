"""Metrics of an acceptance head on held-out positions, each epoch.

Inputs are the head's logits l_i (or predictions) and the soft labels P_i, in that order, over
draft positions (apply the mixing mask first, or pass it). All metrics are computed in fp64 on the CPU.

- binary KL(P_i || Phat_i), mean: what the loss minimises up to the weights; 0 only when the
  predictions equal the labels.
- AUROC with soft labels: each example carries positive mass P_i and negative mass 1 - P_i, and
  AUROC = P(score of a positive > score of a negative) + 1/2 P(tie), positives and negatives drawn
  in proportion to their mass. This is the AUROC one would get by replacing every example with many
  copies whose outcomes are Bernoulli(P_i) draws (the accept / reject coin of verification), so it
  needs no arbitrary cut such as P_i >= 0.5, and it equals the ordinary AUROC when the labels are 0/1.
  An example paired with itself is a tie (the copies share a score). Undefined (NaN) when the
  positive or the negative mass is 0.
- calibration: B equal-width bins of Phat on [0, 1] (Phat = 1 falls in the last bin); per bin the
  mean prediction, mean soft label and count (the reliability diagram), and
  ECE = sum_b (n_b / n) * |mean Phat_b - mean P_b|.
- per position: the same metrics for the tokens at response position 0, 1, .., B-2 and one bucket
  for all later positions ("20+" with the default 21 buckets).
- single features (`feature_aurocs`): the soft-label AUROC of each draft-distribution feature
  (specdec/features.py) used alone as the score, beside the head's: q(y_i), the top-1 probability
  (HF's confidence rule), the top-1/top-2 margin, and the entropy negated (SVIP's rule: a higher
  entropy predicts rejection).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specdec.features import SCALAR_FEATURES

DEFAULT_CALIBRATION_BINS = 10
# Positions 0..19 get a bucket each and 20+ shares one: the paper caps a round at 20 candidates.
POSITION_BUCKETS = 21


def binary_kl(
    logits: torch.Tensor,  # [N] l_i, Phat_i = sigmoid(l_i)
    soft_labels: torch.Tensor,  # [N] P_i in [0, 1]
) -> torch.Tensor:
    """KL(Bernoulli(P_i) || Bernoulli(Phat_i)) per example -> [N] fp64, >= 0.

    = P log P + (1 - P) log(1 - P) - P logsigmoid(l) - (1 - P) logsigmoid(-l), with 0 log 0 = 0.
    """
    labels, logits = _f64(soft_labels), _f64(logits)
    neg_entropy = torch.xlogy(labels, labels) + torch.xlogy(1.0 - labels, 1.0 - labels)
    cross_entropy = -labels * F.logsigmoid(logits) - (1.0 - labels) * F.logsigmoid(-logits)
    return (cross_entropy + neg_entropy).clamp_min(0.0)  # >= 0 up to rounding


def soft_label_auroc(
    scores: torch.Tensor,  # [N] any monotone score: Phat_i or the logit l_i
    soft_labels: torch.Tensor,  # [N] P_i in [0, 1]
) -> float:
    """AUROC with positive mass P_i and negative mass 1 - P_i per example (module docstring).

    sum_{i,j} P_i (1 - P_j) [1(s_i > s_j) + 1/2 1(s_i = s_j)] / (sum_i P_i * sum_j (1 - P_j)),
    in O(N log N): group equal scores, then each group's positive mass beats the negative mass of
    all lower groups and ties half of its own.
    """
    scores, pos = _f64(scores), _f64(soft_labels)
    neg = 1.0 - pos
    total_pos, total_neg = float(pos.sum()), float(neg.sum())
    if total_pos <= 0.0 or total_neg <= 0.0:
        return math.nan
    unique, group = torch.unique(scores, sorted=True, return_inverse=True)  # ascending scores
    pos_g = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, group, pos)  # [G]
    neg_g = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, group, neg)  # [G]
    neg_below = torch.cumsum(neg_g, 0) - neg_g  # [G] negative mass with a strictly lower score
    wins = (pos_g * (neg_below + 0.5 * neg_g)).sum()
    return float(wins) / (total_pos * total_neg)


# Single-feature rules: name -> (column of the scalar features, sign making "higher = accept").
SINGLE_FEATURE_RULES = {
    "q_token": ("log_q_token", 1.0),
    "top1_probability": ("log_top1", 1.0),  # HF's confidence rule
    "margin": ("log_margin", 1.0),
    "entropy": ("entropy", -1.0),  # SVIP's rule, negated
}


def feature_aurocs(
    scalars: torch.Tensor,  # [N, S] the draft-distribution features (specdec/features.py order)
    soft_labels: torch.Tensor,  # [N] P_i
) -> dict[str, float]:
    """The soft-label AUROC of each single feature as the score (SINGLE_FEATURE_RULES)."""
    return {name: soft_label_auroc(sign * _f64(scalars[:, SCALAR_FEATURES.index(column)]), soft_labels)
            for name, (column, sign) in SINGLE_FEATURE_RULES.items()}


@dataclass(frozen=True)
class Reliability:
    """Reliability-diagram data: B equal-width bins of the prediction on [0, 1]."""

    bin_edges: list[float]  # [B + 1]
    mean_prediction: list[float]  # [B], NaN for an empty bin
    mean_label: list[float]  # [B], NaN for an empty bin
    count: list[int]  # [B]
    ece: float  # sum_b (count_b / n) |mean_prediction_b - mean_label_b|; NaN when n = 0


def calibration(
    predictions: torch.Tensor,  # [N] Phat_i in [0, 1]
    soft_labels: torch.Tensor,  # [N] P_i
    num_bins: int = DEFAULT_CALIBRATION_BINS,
) -> Reliability:
    """Bin b holds b/B <= Phat < (b+1)/B (the last bin also Phat = 1)."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    predictions, labels = _f64(predictions), _f64(soft_labels)
    bins = torch.clamp((predictions * num_bins).floor().long(), 0, num_bins - 1)  # [N]
    count = torch.bincount(bins, minlength=num_bins)  # [B]
    sum_pred = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, predictions)
    sum_label = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, labels)
    nonzero = count.clamp_min(1).double()
    mean_pred = torch.where(count > 0, sum_pred / nonzero, math.nan)  # [B]
    mean_label = torch.where(count > 0, sum_label / nonzero, math.nan)  # [B]
    n = int(count.sum())
    gap = (count.double() / max(n, 1)) * (mean_pred - mean_label).abs()
    ece = float(gap[count > 0].sum()) if n else math.nan
    return Reliability(
        bin_edges=torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64).tolist(),
        mean_prediction=mean_pred.tolist(),
        mean_label=mean_label.tolist(),
        count=count.tolist(),
        ece=ece,
    )


def expected_calibration_error(
    predictions: torch.Tensor, soft_labels: torch.Tensor, num_bins: int = DEFAULT_CALIBRATION_BINS
) -> float:
    return calibration(predictions, soft_labels, num_bins).ece


@dataclass(frozen=True)
class PositionMetrics:
    position: str  # "0", "1", .., or "20+" for the last bucket
    count: int
    mean_label: float
    mean_prediction: float
    kl: float
    auroc: float


@dataclass(frozen=True)
class HeadMetrics:
    count: int  # positions evaluated
    mean_label: float  # mean P_i: the draft's acceptance rate on these positions
    mean_prediction: float  # mean Phat_i
    kl: float  # mean binary KL(P || Phat)
    auroc: float
    ece: float
    reliability: Reliability
    per_position: list[PositionMetrics]

    def scalars(self) -> dict[str, float]:
        """The flat numbers, e.g. for `ray.train.report`."""
        return {"count": self.count, "mean_label": self.mean_label, "mean_prediction": self.mean_prediction,
                "kl": self.kl, "auroc": self.auroc, "ece": self.ece}

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_head(
    logits: torch.Tensor,  # [N] head logits l_i
    soft_labels: torch.Tensor,  # [N] P_i
    positions: torch.Tensor | None = None,  # [N] response position of each token, 0-based
    mask: torch.Tensor | None = None,  # [N] bool, positions to evaluate (draft positions)
) -> HeadMetrics:
    """All metrics of one evaluation pass; per-position rows only when positions are given."""
    if soft_labels.shape != logits.shape or (positions is not None and positions.shape != logits.shape):
        raise ValueError("logits, soft labels and positions must have the same shape [N]")
    if mask is not None:
        logits, soft_labels = logits[mask], soft_labels[mask]
        positions = positions[mask] if positions is not None else None
    logits, labels = _f64(logits).reshape(-1), _f64(soft_labels).reshape(-1)
    predictions = torch.sigmoid(logits)
    overall = _summary(logits, predictions, labels)
    reliability = calibration(predictions, labels)
    rows = []
    if positions is not None:
        positions = positions.reshape(-1).cpu().long()
        if bool((positions < 0).any()):
            raise ValueError("positions must be >= 0")
        last = POSITION_BUCKETS - 1
        bucket = positions.clamp(max=last)  # [N]
        for b in range(POSITION_BUCKETS):
            selected = bucket == b
            if bool(selected.any()):
                name = f"{b}+" if b == last else str(b)
                rows.append(PositionMetrics(name, *_summary(logits[selected], predictions[selected], labels[selected])))
    return HeadMetrics(*overall, reliability.ece, reliability, rows)


def _summary(logits: torch.Tensor, predictions: torch.Tensor, labels: torch.Tensor) -> tuple:
    """(count, mean label, mean prediction, mean KL, AUROC) of one set of positions."""
    n = logits.numel()
    if n == 0:
        return 0, math.nan, math.nan, math.nan, math.nan
    return (n, float(labels.mean()), float(predictions.mean()), float(binary_kl(logits, labels).mean()),
            soft_label_auroc(logits, labels))


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)
