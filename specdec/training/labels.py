"""Soft acceptance labels (paper §3.3).

For a prompt the target writes a response X_1..X_N. Run teacher-forced on it, the draft gives
q_i = q(. | prompt, X_<i) at every position; the target gives p_i = p(. | prompt, X_<i) in the
same pass that wrote (or re-scores) X. One draft token per position is sampled, Y_i ~ q_i, and its
label is the probability that verification would accept it:

    P_i = min(1, p_i(Y_i) / q_i(Y_i))

p and q must be the distributions verification compares, i.e. both through the same
`specdec.sampling.probs_from_logits` transform. For greedy decoding pass one-hot argmax
distributions: the label is then 1 where the argmaxes agree and 0 elsewhere (exact match).
"""

from __future__ import annotations

import torch


def sample_draft_tokens(draft_probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Y_i ~ q_i at every position: draft_probs [N, V] -> draft tokens [N] (long).

    `generator` must live on draft_probs' device; it is the only source of randomness.
    """
    _check_probs(draft_probs, "draft_probs")
    return torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)  # [N]


def soft_acceptance_labels(
    target_probs: torch.Tensor,  # [N, V] p_i
    draft_probs: torch.Tensor,  # [N, V] q_i
    draft_tokens: torch.Tensor,  # [N] Y_i
) -> torch.Tensor:
    """P_i = min(1, p_i(Y_i) / q_i(Y_i)) -> [N] fp32 in [0, 1].

    Raises ValueError when some q_i(Y_i) = 0: such a Y_i cannot have been sampled from q_i, so the
    data are inconsistent (wrong draft, wrong sampling transform, or misaligned positions).
    """
    _check_probs(target_probs, "target_probs")
    _check_probs(draft_probs, "draft_probs")
    if target_probs.shape != draft_probs.shape:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} and draft_probs "
                         f"{tuple(draft_probs.shape)} differ in shape")
    if draft_tokens.shape != draft_probs.shape[:1]:
        raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} must be [N] with N = {draft_probs.shape[0]}")
    index = draft_tokens.long().unsqueeze(-1)  # [N, 1]
    p_y = target_probs.gather(-1, index).squeeze(-1).float()  # [N] p_i(Y_i)
    q_y = draft_probs.gather(-1, index).squeeze(-1).float()  # [N] q_i(Y_i)
    if bool((q_y <= 0).any()):
        first = int(torch.nonzero(q_y <= 0)[0, 0])
        raise ValueError(f"draft token {int(draft_tokens[first])} at position {first} has draft probability 0; "
                         "Y must be sampled from q")
    return torch.clamp(p_y / q_y, max=1.0)  # q >= p: accept with p/q; p > q: always accept


def soft_acceptance_labels_from_logprobs(
    target_logprobs: torch.Tensor,  # [N] log p_i(Y_i)
    draft_logprobs: torch.Tensor,  # [N] log q_i(Y_i)
) -> torch.Tensor:
    """The same label from the two log-probabilities of Y_i: exp(min(0, log p - log q)) -> [N].

    For data that store only log p_i(Y_i) and log q_i(Y_i) (as the official code does) instead of
    two [N, V] distributions; log space also keeps tiny probabilities exact.
    """
    if target_logprobs.shape != draft_logprobs.shape:
        raise ValueError(f"log-probabilities differ in shape: {tuple(target_logprobs.shape)} "
                         f"vs {tuple(draft_logprobs.shape)}")
    if bool(torch.isneginf(draft_logprobs).any()):
        raise ValueError("a draft token has draft log-probability -inf; Y must be sampled from q")
    return torch.exp(torch.clamp(target_logprobs.float() - draft_logprobs.float(), max=0.0))


def _check_probs(probs: torch.Tensor, name: str) -> None:
    if probs.dim() != 2:
        raise ValueError(f"{name} must be [N, V], got shape {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {probs.dtype}")
