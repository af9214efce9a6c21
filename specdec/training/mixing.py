"""BERT-style token mixing (paper §3.3).

The head is trained on hidden states e_i(prompt, Z_<i, Y_i): the draft reads a sequence Z that
takes each token from the target's response X with probability r and from the draft samples Y
otherwise. At inference the prefix is the draft's own candidates, at training time the target's
tokens; mixing exposes the head to draft-written prefixes while keeping most of the context on the
target's path. The loss is taken only at positions whose token came from Y, because the label
P_i is the acceptance probability of Y_i.

Worked example (N = 5, r = 0.4), coins u_i ~ U[0, 1), "take X_i" iff u_i < r:

    X        = [10, 11, 12, 13, 14]
    Y        = [10, 21, 22, 13, 24]
    u        = [.9, .1, .7, .3, .5]
    Z        = [10, 11, 22, 13, 24]      positions 1 and 3 from X
    is_draft = [ T,  F,  T,  F,  T]

Position 0 holds the same token either way (Y_0 = X_0) and counts as a draft position because its
coin chose Y. Position 3 also has Y_3 = X_3 but its coin chose X, so it is NOT a draft position,
although the head's input there is exactly e(prompt, Z_<3, Y_3).

Why the mask follows the coin and not the token values: then every position enters the loss with
probability 1 - r whatever its tokens, so the loss positions are an unbiased sample of all
positions. Also counting "taken from X but equal to Y" positions would add exactly the positions
where the draft's sample matches the target's token, which are mostly well-accepted ones, and bias
the head towards acceptance: the over-confidence the paper already warns about. The official code
(`specdec_pp/train.py`, mixing_ratio = 0.15) does the same: mask from the coin only.
"""

from __future__ import annotations

import hashlib

import torch

# Fraction of tokens taken from the target's response X in the official recipe (mixing_ratio).
OFFICIAL_TARGET_TOKEN_RATIO = 0.15


def mix_tokens(
    target_tokens: torch.Tensor,  # [..., N] X
    draft_tokens: torch.Tensor,  # [..., N] Y
    target_ratio: float,  # r: probability that Z_i = X_i
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (Z [..., N] long, is_draft [..., N] bool): Z_i = X_i with probability r, else Y_i.

    is_draft marks the positions whose token was taken from Y: the positions the loss uses.
    The coins are drawn on the generator's device, so a seed gives the same Z on every device.
    """
    if not 0.0 <= target_ratio <= 1.0:
        raise ValueError(f"target_ratio must lie in [0, 1], got {target_ratio}")
    if target_tokens.shape != draft_tokens.shape:
        raise ValueError(f"target tokens {tuple(target_tokens.shape)} and draft tokens "
                         f"{tuple(draft_tokens.shape)} differ in shape")
    coins = torch.rand(target_tokens.shape, generator=generator, device=generator.device)
    is_draft = (coins >= target_ratio).to(target_tokens.device)  # P(take X) = P(u < r) = r
    mixed = torch.where(is_draft, draft_tokens, target_tokens).long()
    return mixed, is_draft


def mixing_generator(seed: int, prompt_id: str, label_set: int = 0) -> torch.Generator:
    """The coins of one response and label set: the same for a run's seed wherever they are drawn
    (the head's features and a feature draft's labels mix alike)."""
    digest = hashlib.sha256(f"mix\0{seed}\0{prompt_id}\0{label_set}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
