"""What an acceptance head reads: the feature kinds and the draft-distribution features, as pure
functions shared by the drafting policies and the training pipeline (so both compute exactly the
same numbers).

Two kinds (`HeadConfig.features`):

- `hidden` (the paper, §3.2): the draft's final hidden state e_i at candidate y_i, i.e. the state
  after the draft has READ y_i. In the drafting loop that state comes out of the next draft pass,
  so at step i the head judges y_{i-1} from e_{i-1} (`DraftStep.prev_hidden`).
- `hidden+distribution`: the hidden state the draft's distribution q_i came from (e_{i-1}, and at
  i = 1 the state at the last committed token: `DraftStep.hidden`), plus `NUM_SCALAR_FEATURES`
  numbers read off q_i at the candidate y_i and the candidate's position i in the round. Everything
  is known at step i, right after y_i is sampled, so the head judges y_i itself before the next
  draft pass is paid for: a policy can stop without y_i, and a round can hold no candidate at all
  (K = 0) when even y_1 is predicted to be rejected. On the default pair's validation tokens
  q(y_i) alone reaches AUROC 0.89 (greedy labels) / 0.86 (T = 1) (docs/training.md).

The scalar features of candidate y drawn from q (all logs natural, probabilities floored at
`MIN_PROB` because under mixing a training token may have q = 0 after top-k/top-p):

    0  log q(y)                   the candidate's own probability
    1  log max_v q(v)             HF's confidence rule reads this (top-1 probability)
    2  log q_(1) - log q_(2)      the top-1/top-2 margin, as a log ratio (vLLM's logit margin)
    3  H(q) in nats               SVIP's rule reads this (entropy)
    4  log i                      the candidate's 1-based position in its round
    5  greedy                     1 when the round verifies greedily (exact match), else 0: the same
                                  features mean different acceptance at T = 0 and under sampling

Position in training (`round_positions`): in a mixed sequence Z (training/mixing.py) a token taken
from the draft's Y plays a candidate, one taken from the target's X a committed token; a draft
token's position is 1 + the number of consecutive draft tokens right before it. At inference the
candidates y_1..y_{i-1} of the round precede y_i and a committed token precedes y_1, the same rule.
"""

from __future__ import annotations

from typing import Literal

import torch

FEATURES_HIDDEN = "hidden"
FEATURES_DISTRIBUTION = "hidden+distribution"
FeatureKind = Literal["hidden", "hidden+distribution"]

SCALAR_FEATURES = ("log_q_token", "log_top1", "log_margin", "entropy", "log_position", "greedy")
NUM_SCALAR_FEATURES = len(SCALAR_FEATURES)
MIN_PROB = 1e-9  # log floor: a token outside the filtered support (possible only in training's mixing)


def distribution_features(
    probs: torch.Tensor,  # [..., V] q, the distribution the candidate was drawn from
    tokens: torch.Tensor,  # [...] long, the candidates y
    positions: torch.Tensor,  # [...] 1-based position of each candidate in its round
    greedy: bool | torch.Tensor = False,  # [...] or one flag: the round verifies greedily
) -> torch.Tensor:
    """-> [..., NUM_SCALAR_FEATURES] fp32 (module docstring for the order)."""
    probs = probs.float()
    token_prob = probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [...]
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values  # [..., 2]
    top1 = top2[..., 0]
    second = top2[..., 1] if top2.shape[-1] > 1 else torch.zeros_like(top1)
    log = lambda x: torch.log(x.clamp_min(MIN_PROB))  # noqa: E731
    entropy = -torch.xlogy(probs, probs).sum(-1)  # [...], 0 log 0 = 0
    greedy = torch.as_tensor(greedy, dtype=torch.float32, device=top1.device).expand_as(top1)
    return torch.stack([log(token_prob), log(top1), log(top1) - log(second), entropy,
                        torch.log(positions.float().clamp_min(1.0)), greedy], dim=-1)


def join_head_inputs(kind: str, hidden: torch.Tensor, scalars: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [..., H] (+ scalars [..., S] for `hidden+distribution`) -> a head's inputs [..., I]."""
    if kind == FEATURES_HIDDEN:
        return hidden
    if scalars is None:
        raise ValueError(f"a {FEATURES_DISTRIBUTION!r} head needs the distribution features")
    return torch.cat([hidden.to(scalars.dtype), scalars], dim=-1)


def round_positions(is_draft: torch.Tensor) -> torch.Tensor:
    """is_draft [N] bool (a mixed sequence's origins) -> [N] long: at a draft position, 1 + the number
    of consecutive draft positions right before it; 0 at a target position.

    Worked example: is_draft = [T, T, F, T, T, T, F] -> [1, 2, 0, 1, 2, 3, 0]."""
    positions, run = [], 0
    for draft in is_draft.tolist():
        run = run + 1 if draft else 0
        positions.append(run)
    return torch.tensor(positions, dtype=torch.long)
