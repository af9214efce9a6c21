"""Training the acceptance head (paper §3.3; docs/training.md).

The math is pure functions over tensors, one module per step, each testable without Ray or a model:

- `labels`: sample Y_i ~ q at every position of the target's response, soft label
  P_i = min(1, p(Y_i) / q(Y_i));
- `mixing`: the training sequence Z, r of its tokens from the target's X and the rest from Y, and
  the mask of positions that take part in the loss;
- `loss`: the weighted binary cross-entropy over those positions;
- `evaluation`: binary KL, AUROC, calibration (ECE and reliability data) and metrics per position.
"""
