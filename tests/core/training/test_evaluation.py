"""Evaluation metrics: binary KL, soft-label AUROC against brute force and scipy, ECE and reliability
data, metrics per position."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.training.evaluation import (
    binary_kl,
    calibration,
    evaluate_head,
    expected_calibration_error,
    soft_label_auroc,
)


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- binary KL ---------------------------------------------------------------------------------

def test_binary_kl_is_zero_when_predictions_equal_labels():
    labels = 0.01 + 0.98 * rand(100, seed=0)
    kl = binary_kl(torch.logit(labels), labels)
    assert kl.shape == (100,) and float(kl.max()) < 1e-12


def test_binary_kl_is_positive_when_they_differ_and_matches_the_formula():
    labels, predictions = rand(100, seed=1), 0.01 + 0.98 * rand(100, seed=2)
    kl = binary_kl(torch.logit(predictions), labels).numpy()
    p, ph = labels.numpy(), predictions.numpy()
    expected = p * np.log(p / ph) + (1 - p) * np.log((1 - p) / (1 - ph))
    np.testing.assert_allclose(kl, expected, rtol=1e-9)
    assert (kl > 0).all()


def test_binary_kl_with_hard_labels_is_the_cross_entropy():
    kl = binary_kl(torch.tensor([0.0, math.log(3.0)]), torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(kl, torch.tensor([math.log(2.0), -math.log(0.75)], dtype=torch.float64))


# --- AUROC -------------------------------------------------------------------------------------

def brute_force_auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """sum over all ordered pairs (i, j), i == j included, of P_i (1 - P_j) [s_i > s_j] + 1/2 [tie]."""
    wins = 0.0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if scores[i] > scores[j]:
                wins += labels[i] * (1 - labels[j])
            elif scores[i] == scores[j]:
                wins += 0.5 * labels[i] * (1 - labels[j])
    return wins / (labels.sum() * (1 - labels).sum())


def test_auroc_is_one_for_perfectly_separated_and_zero_for_reversed():
    scores = torch.tensor([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    labels = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    assert soft_label_auroc(scores, labels) == 1.0
    assert soft_label_auroc(-scores, labels) == 0.0


def test_auroc_is_one_half_for_constant_predictions():
    assert soft_label_auroc(torch.full((50,), 0.7), rand(50, seed=3)) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("seed", [4, 5])
def test_auroc_matches_brute_force_pairs_with_ties(seed):
    scores = (rand(80, seed) * 6).round() / 6  # 7 distinct values: many ties
    labels = rand(80, seed + 100)
    expected = brute_force_auroc(scores.numpy(), labels.numpy())
    assert soft_label_auroc(scores, labels) == pytest.approx(expected, rel=1e-12)


def test_auroc_with_hard_labels_matches_mann_whitney():
    scores, labels = (rand(300, seed=6) * 20).round(), (rand(300, seed=7) < 0.7).double()
    u = stats.mannwhitneyu(scores[labels == 1].numpy(), scores[labels == 0].numpy()).statistic
    expected = u / (int(labels.sum()) * int((1 - labels).sum()))
    assert soft_label_auroc(scores, labels) == pytest.approx(expected, rel=1e-12)


def test_soft_auroc_equals_auroc_of_bernoulli_replicas():
    """Each example replaced by 10 copies, 10 * P_i of them accepted: the ordinary AUROC of the copies."""
    copies = 10
    labels = torch.randint(0, copies + 1, (40,), generator=torch.Generator().manual_seed(8)).double() / copies
    scores = rand(40, seed=9)
    replica_scores = scores.repeat_interleave(copies)
    replica_labels = torch.cat([(torch.arange(copies) < round(float(p) * copies)).double() for p in labels])
    u = stats.mannwhitneyu(replica_scores[replica_labels == 1].numpy(),
                           replica_scores[replica_labels == 0].numpy()).statistic
    expected = u / (int(replica_labels.sum()) * int((1 - replica_labels).sum()))
    assert soft_label_auroc(scores, labels) == pytest.approx(expected, rel=1e-12)


def test_auroc_is_undefined_without_both_classes():
    assert math.isnan(soft_label_auroc(rand(10, seed=10), torch.ones(10)))
    assert math.isnan(soft_label_auroc(rand(10, seed=10), torch.zeros(10)))


# --- calibration -------------------------------------------------------------------------------

def test_ece_is_zero_for_perfectly_calibrated_bins():
    predictions = torch.tensor([0.15, 0.15, 0.55, 0.55, 0.95, 1.0], dtype=torch.float64)
    # per-bin means equal the predictions'
    labels = torch.tensor([0.1, 0.2, 0.45, 0.65, 1.0, 0.95], dtype=torch.float64)
    assert expected_calibration_error(predictions, labels, num_bins=10) == pytest.approx(0.0, abs=1e-12)


def test_ece_and_reliability_match_a_hand_example():
    predictions = torch.tensor([0.1, 0.3, 0.35, 0.9])
    labels = torch.tensor([0.0, 1.0, 0.5, 1.0])
    result = calibration(predictions, labels, num_bins=2)  # bins [0, 0.5) and [0.5, 1]
    assert result.count == [3, 1]
    assert result.mean_prediction == pytest.approx([0.25, 0.9])
    assert result.mean_label == pytest.approx([0.5, 1.0])
    assert result.bin_edges == [0.0, 0.5, 1.0]
    assert result.ece == pytest.approx(3 / 4 * 0.25 + 1 / 4 * 0.1)  # 0.2125


def test_calibration_edges_and_empty_bins():
    result = calibration(torch.tensor([0.0, 1.0, 0.05]), torch.tensor([0.0, 1.0, 0.05]), num_bins=10)
    assert result.count == [2, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # 1.0 falls in the last bin
    assert math.isnan(result.mean_prediction[5]) and math.isnan(result.mean_label[5])
    assert result.ece == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(calibration(torch.tensor([]), torch.tensor([])).ece)
    with pytest.raises(ValueError):
        calibration(torch.tensor([0.5]), torch.tensor([0.5]), num_bins=0)


# --- evaluate_head -----------------------------------------------------------------------------

def test_evaluate_head_overall_masked_and_per_position():
    n = 500
    generator = torch.Generator().manual_seed(11)
    labels = torch.rand(n, generator=generator)
    logits = torch.logit(labels.clamp(0.02, 0.98)) + 0.5 * torch.randn(n, generator=generator)
    positions = torch.randint(0, 30, (n,), generator=generator)
    mask = torch.rand(n, generator=generator) < 0.85
    labels_with_garbage = torch.where(mask, labels, torch.full_like(labels, -100.0))

    metrics = evaluate_head(logits, labels_with_garbage, positions, mask=mask)
    used_logits, used_labels, used_positions = logits[mask], labels[mask], positions[mask]
    assert metrics.count == int(mask.sum())
    assert metrics.kl == pytest.approx(float(binary_kl(used_logits, used_labels).mean()))
    assert metrics.auroc == pytest.approx(soft_label_auroc(used_logits, used_labels))
    assert metrics.ece == pytest.approx(expected_calibration_error(torch.sigmoid(used_logits.double()), used_labels))
    assert metrics.mean_label == pytest.approx(float(used_labels.double().mean()))
    assert 0.5 < metrics.auroc < 1.0  # informative but noisy predictions

    assert [row.position for row in metrics.per_position] == [*map(str, range(20)), "20+"]
    assert sum(row.count for row in metrics.per_position) == metrics.count
    late = used_positions >= 20
    row = metrics.per_position[-1]
    assert row.count == int(late.sum())
    assert row.kl == pytest.approx(float(binary_kl(used_logits[late], used_labels[late]).mean()))
    assert row.auroc == pytest.approx(soft_label_auroc(used_logits[late], used_labels[late]))

    scalars = metrics.scalars()
    assert set(scalars) == {"count", "mean_label", "mean_prediction", "kl", "auroc", "ece"}
    assert metrics.to_dict()["reliability"]["count"] == metrics.reliability.count


def test_evaluate_head_without_positions_and_bad_positions():
    logits, labels = torch.zeros(4), torch.tensor([0.0, 1.0, 0.5, 0.5])
    metrics = evaluate_head(logits, labels)
    assert metrics.per_position == [] and metrics.auroc == 0.5 and metrics.ece == pytest.approx(0.0)
    with pytest.raises(ValueError, match=">= 0"):
        evaluate_head(logits, labels, torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match="same shape"):
        evaluate_head(logits, labels[:3])


def test_single_feature_aurocs_score_each_rule_alone():
    """Labels driven by q(y_i): its AUROC is the ranking's; entropy counts negated (SVIP: high
    entropy predicts rejection), so an entropy that falls as q(y) rises scores above 1/2."""
    from specdec.features import SCALAR_FEATURES
    from specdec.training.evaluation import SINGLE_FEATURE_RULES, feature_aurocs

    generator = torch.Generator().manual_seed(0)
    q = torch.rand(3000, generator=generator) * 0.98 + 0.01
    scalars = torch.zeros(3000, len(SCALAR_FEATURES))
    scalars[:, SCALAR_FEATURES.index("log_q_token")] = q.log()
    scalars[:, SCALAR_FEATURES.index("log_top1")] = torch.rand(3000, generator=generator).log()  # noise
    scalars[:, SCALAR_FEATURES.index("log_margin")] = -q.log()  # reversed on purpose
    scalars[:, SCALAR_FEATURES.index("entropy")] = 1.0 - q
    labels = q ** 2
    aurocs = feature_aurocs(scalars, labels)
    assert set(aurocs) == set(SINGLE_FEATURE_RULES)
    assert aurocs["q_token"] == pytest.approx(soft_label_auroc(q, labels)) and aurocs["q_token"] > 0.7
    assert aurocs["entropy"] == pytest.approx(aurocs["q_token"])
    assert aurocs["margin"] == pytest.approx(1.0 - aurocs["q_token"])
    assert abs(aurocs["top1_probability"] - 0.5) < 0.05
