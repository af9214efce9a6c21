"""Platt calibration of a head's logits: it repairs a shifted and over-sharp head, keeps its ranking,
and travels with the head through save and load."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.head import AcceptanceHead, Calibration, HeadConfig, load_head
from specdec.training.calibration import calibration_report, cross_fitted_predictions, fit_platt
from specdec.training.evaluation import expected_calibration_error, soft_label_auroc

W_REJ = 6.0


def miscalibrated(n: int = 4000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(head logits, soft labels): the true logit z, seen by the head doubled and shifted down by
    log(w_rej), as a head trained with w_rej = 6 and too sharp would be."""
    z = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1.5 + 1.0
    return 2.0 * z - math.log(W_REJ), torch.sigmoid(z)


def test_platt_recovers_the_true_map_and_reduces_ece():
    logits, labels = miscalibrated()
    platt = fit_platt(logits, labels)
    assert platt.scale == pytest.approx(0.5, rel=1e-3) and platt.bias == pytest.approx(math.log(W_REJ) / 2, rel=1e-3)
    before = expected_calibration_error(torch.sigmoid(logits), labels)
    after = expected_calibration_error(cross_fitted_predictions(logits, labels), labels)
    assert before > 0.1 and after < 0.01
    calibrated = torch.sigmoid(platt.apply(logits))
    assert soft_label_auroc(calibrated, labels) == pytest.approx(soft_label_auroc(logits, labels))  # a > 0: same order


def test_report_quotes_ece_before_and_after():
    logits, labels = miscalibrated(2000, seed=1)
    platt, report = calibration_report(logits, labels)
    assert (report["scale"], report["bias"]) == (platt.scale, platt.bias)
    assert report["ece_after"] < 0.02 < 0.1 < report["ece_before"]
    assert sum(report["reliability_after"]["count"]) == 2000


def test_calibration_round_trips_through_save_and_load(tmp_path):
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=6, depth=1, draft_identity="x")).eval()
    hidden = torch.randn(5, 6)
    raw = torch.sigmoid(head(hidden))
    torch.testing.assert_close(head.acceptance_probability(hidden), raw)  # no calibration: as before
    head.config.calibration = Calibration(scale=0.5, bias=0.9)
    loaded = load_head(head.save(tmp_path / "head"))
    assert loaded.config.calibration == Calibration(scale=0.5, bias=0.9)
    torch.testing.assert_close(loaded.acceptance_probability(hidden), torch.sigmoid(0.5 * head(hidden) + 0.9))
    with pytest.raises(ValueError):
        Calibration(scale=-1.0, bias=0.0)  # a negative scale would reverse the ranking


def test_logits_of_a_diverged_head_fail_calibration_in_one_line():
    from specdec.errors import SpecDecError

    with pytest.raises(SpecDecError, match="calibration failed: .* its training diverged: check train.lr"):
        fit_platt(torch.tensor([float("nan"), 1.0, -2.0]), torch.tensor([0.2, 0.9, 0.5]))
