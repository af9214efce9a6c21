"""Calibrating a trained head on validation tokens: Platt scaling, Phat = sigmoid(a * l + b), a > 0.

Why Platt (an affine map of the logit) rather than temperature scaling alone or isotonic regression:
- the head is trained with w_rej > 1 on purpose (class imbalance, paper §3.3), which moves its
  logits down by about log(w_rej) (the weighted loss is minimised at Phat = P / (P + w_rej (1 - P)),
  i.e. logit(P) - log(w_rej)); a temperature alone cannot undo a shift, the bias b can;
- two parameters cannot overfit a few thousand validation tokens, while isotonic regression's
  steps can, and its flat steps tie candidates the head had ranked (AUROC drops); an affine map
  with a > 0 keeps every ranking, so AUROC is unchanged;
- the cost-aware rule multiplies the a_j of a round, so a smooth, monotone map matters more than
  bin-level fit.

Fit: minimise the unweighted soft-label cross-entropy -P log Phat - (1 - P) log(1 - Phat) over
(log a, b) with L-BFGS in fp64. The ECE "after" that the report quotes is cross-fitted (each half
of the validation tokens calibrated by a map fitted on the other half), so it is not measured on the
tokens the map was fitted to; the map saved with the head is fitted on all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.errors import SpecDecError
from specdec.head import Calibration
from specdec.training.evaluation import calibration

LBFGS_STEPS = 100
CROSS_FIT_FOLDS = 2
CROSS_FIT_SEED = 0


def fit_platt(logits: torch.Tensor, soft_labels: torch.Tensor) -> Calibration:
    """logits [N] (the head's raw l_i), soft labels [N] P_i -> the Platt map minimising the cross-entropy."""
    x, y = logits.detach().double().cpu().reshape(-1), soft_labels.detach().double().cpu().reshape(-1)
    if x.numel() == 0:
        return Calibration(scale=1.0, bias=0.0)
    log_scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_scale, bias], max_iter=LBFGS_STEPS, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        z = x * log_scale.exp() + bias
        loss = -(y * F.logsigmoid(z) + (1.0 - y) * F.logsigmoid(-z)).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    scale, shift = float(log_scale.detach().exp()), float(bias.detach())
    if not (0.0 < scale < float("inf") and abs(shift) < float("inf")):  # (logits of a diverged head: no map)
        raise SpecDecError(f"calibration failed: the head's logits fit no Platt map (scale {scale:g}); "
                           "its training diverged: check train.lr")
    return Calibration(scale=scale, bias=shift)


def cross_fitted_predictions(logits: torch.Tensor, soft_labels: torch.Tensor) -> torch.Tensor:
    """[N] calibrated Phat_i, each from a map fitted on the other folds (tokens assigned at random)."""
    x, y = logits.detach().double().cpu().reshape(-1), soft_labels.detach().double().cpu().reshape(-1)
    fold = torch.randperm(len(x), generator=torch.Generator().manual_seed(CROSS_FIT_SEED)) % CROSS_FIT_FOLDS
    out = torch.empty_like(x)
    for f in range(CROSS_FIT_FOLDS):
        held = fold == f
        platt = fit_platt(x[~held], y[~held])
        out[held] = torch.sigmoid(platt.apply(x[held]))
    return out


def calibration_report(logits: torch.Tensor, soft_labels: torch.Tensor) -> tuple[Calibration, dict]:
    """(the map fitted on all tokens, a report: the map, ECE and reliability before and after)."""
    platt = fit_platt(logits, soft_labels)
    before = calibration(torch.sigmoid(logits.double()), soft_labels)
    after = calibration(cross_fitted_predictions(logits, soft_labels), soft_labels)
    in_sample = calibration(torch.sigmoid(platt.apply(logits.double())), soft_labels)
    report = {**platt.model_dump(), "ece_before": before.ece, "ece_after": after.ece,
              "ece_after_in_sample": in_sample.ece, "folds": CROSS_FIT_FOLDS,
              "reliability_before": before.__dict__, "reliability_after": after.__dict__}
    return platt, report
