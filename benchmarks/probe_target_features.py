"""Do features from the target's last verification pass predict acceptance beyond the shipped head?

    python -m benchmarks.probe_target_features      # ~3 minutes: one fp32 target pass per validation response

When a round starts at response position t, the target's last pass has scored position t - 1 (the
token it committed there): its distribution p_{t-1} and its final hidden state are known, and no
draft-side rule reads them. For every validation label of the head's feature cache (the candidate
at position i, the d-th of a round, d = 1..8, so the target's last scored position is i - d), this
fits a logistic regression on the head's logit at depth d plus candidate inputs from position i - d
and reports its soft-label AUROC, 4-fold cross-validated by response:
  - target scalars: log-odds of p's top-1 probability, p's entropy, log p(X_{t-1}), whether p's and
    q's argmax agree there;
  - TV(p, q) at t - 1 (how far the draft was from the target on the last scored token);
  - the first 16 principal components of the target's hidden state there.
Same feature cache, head and response order as benchmarks/replay_rules.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from benchmarks.replay_rules import HEAD, MAX_K, acceptance_by_position, label_sets, newest_cache
from specdec.builder import load_model, resolve_model
from specdec.head import load_head
from specdec.training.data import load_dataset, response_logits
from specdec.training.evaluation import soft_label_auroc

DATA = Path(__file__).resolve().parents[1] / "data" / "default-pair"
DEPTHS = range(1, 9)
FOLDS = 4


@torch.inference_mode()
def target_features(target, draft, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ([N, 5] scalars, [N, H] hidden) at the response positions, teacher-forced (the target's
    pass is training.data.response_logits' own, keeping the hidden state it drops)."""
    ids = torch.tensor([list(row["prompt_ids"]) + list(row["response_ids"][:-1])])
    n = len(row["response_ids"])
    hidden = target.model(input_ids=ids).last_hidden_state[0, -n:]  # [N, H]
    log_p = torch.log_softmax(target.lm_head(hidden).float(), -1)  # [N, V]
    log_q = torch.log_softmax(response_logits(draft, row["prompt_ids"], row["response_ids"]), -1)  # [N, V]
    vocab = min(log_p.shape[-1], log_q.shape[-1])
    log_p, log_q = log_p[:, :vocab], log_q[:, :vocab]
    p, x = log_p.exp(), torch.tensor(row["response_ids"])
    top1 = p.max(-1).values.clamp(1e-6, 1 - 1e-6)
    scalars = torch.stack([
        torch.log(top1 / (1 - top1)),
        -(p * log_p).sum(-1),
        log_p.gather(1, x[:, None])[:, 0].clamp_min(math.log(1e-9)),
        (log_p.argmax(-1) == log_q.argmax(-1)).float(),
        0.5 * (p - log_q.exp()).abs().sum(-1),  # TV(p, q)
    ], dim=1)
    return scalars.double(), hidden.double()


def fit_logistic(x: torch.Tensor, y: torch.Tensor):
    """Soft-label logistic regression (L-BFGS, standardised inputs) -> a scoring function."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=200)

    def loss():
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(((x - mean) / std) @ w[1:] + w[0], y)
        (value + 1e-4 * (w[1:] ** 2).sum()).backward()
        return value

    optimizer.step(loss)
    w = w.detach()
    return lambda z: ((z - mean) / std) @ w[1:] + w[0]


def cross_validated_scores(x: torch.Tensor, y: torch.Tensor, folds: torch.Tensor, hidden: torch.Tensor | None,
                           components: int = 16) -> torch.Tensor:
    scores = torch.empty(len(y), dtype=torch.float64)
    for f in range(FOLDS):
        train, test = folds != f, folds == f
        x_train, x_test = x[train], x[test]
        if hidden is not None:  # principal components fitted on the training folds only
            mean = hidden[train].mean(0)
            _, _, v = torch.pca_lowrank(hidden[train] - mean, q=components, center=False)
            x_train = torch.cat([x_train, (hidden[train] - mean) @ v], 1)
            x_test = torch.cat([x_test, (hidden[test] - mean) @ v], 1)
        scores[test] = fit_logistic(x_train, y[train])(x_test)
    return scores


def main() -> None:
    torch.manual_seed(0)
    features = torch.load(newest_cache(), weights_only=True)["validation"]
    head = load_head(HEAD)
    _, rows = load_dataset(DATA)
    rows = [row for row in rows if row["split"] == "validation" and row["response_ids"]]  # the cache's order
    target = load_model(resolve_model("default", role="target"), "target", "fp32")
    draft = load_model(resolve_model("default", role="draft"), "draft", "fp32")
    spans = iter(label_sets(features))
    columns = {T: {"x": [], "y": [], "fold": [], "hidden_at": []} for T in (0.0, 1.0)}
    hidden_states = []
    for r, row in enumerate(rows):
        scalars, hidden = target_features(target, draft, row)
        hidden_states.append(hidden)
        for temperature in row["label_temperatures"]:
            a, b = next(spans)
            assert b - a == len(row["response_ids"]), "the feature cache and the dataset disagree"
            logits = torch.logit(acceptance_by_position(head, features, a, b).clamp(1e-6, 1 - 1e-6))  # [N, MAX_K]
            labels = features["labels"][a:b].double()
            c = columns[float(temperature)]
            for d in DEPTHS:
                i = torch.arange(d, b - a)
                c["x"].append(torch.cat([logits[i, d - 1, None], torch.full((len(i), 1), float(d)),
                                         scalars[i - d]], 1))
                c["y"].append(labels[i])
                c["fold"].append(torch.full((len(i),), r % FOLDS))
                c["hidden_at"] += [(r, int(j)) for j in i - d]
        print(f"response {r + 1}/{len(rows)}", file=sys.stderr, flush=True)
    print(f"{len(rows)} validation responses; candidates at depths 1-{max(DEPTHS)} (of {MAX_K})\n")
    print("| inputs | greedy AUROC | T=1 AUROC | greedy, depth 1 | T=1, depth 1 |\n|---|---|---|---|---|")
    sets = [("head logit + depth", [0, 1], False), ("+ target scalars", [0, 1, 2, 3, 4, 5], False),
            ("+ target scalars + TV(p, q)", [0, 1, 2, 3, 4, 5, 6], False), ("+ target hidden (16 PCs)", [0, 1], True)]
    data = {T: (torch.cat(c["x"]), torch.cat(c["y"]), torch.cat(c["fold"]), c["hidden_at"]) for T, c in columns.items()}
    for name, cols, with_hidden in sets:
        aurocs = []
        for x, y, fold, hidden_at in data.values():
            hidden = torch.stack([hidden_states[r][j] for r, j in hidden_at]) if with_hidden else None
            scores = cross_validated_scores(x[:, cols], y, fold, hidden)
            aurocs.append((soft_label_auroc(scores, y), soft_label_auroc(scores[x[:, 1] == 1], y[x[:, 1] == 1])))
        print(f"| {name} | {aurocs[0][0]:.4f} | {aurocs[1][0]:.4f} | {aurocs[0][1]:.4f} | {aurocs[1][1]:.4f} |")


if __name__ == "__main__":
    main()
