"""Verification of one speculation round (Algorithm 1 of the SpecDec++ paper; Leviathan et al. 2023,
Chen et al. 2023). Pure functions over tensors.

Glossary (as in vLLM's rejection sampler):
- candidates: y_1..y_K, drafted by the draft model from q_1..q_K;
- accepted: the longest prefix y_1..y_n that passes the test;
- correction token: when n < K, a fresh sample from Norm[(p_{n+1} - q_{n+1})_+] replacing y_{n+1};
- bonus token: when n = K, a sample from p_{K+1}, which the target scored for free.
Either way a round commits n + 1 tokens: y_1..y_n and the correction or bonus token.

Worked example (K = 3): the target scores positions 1..4 in one pass. If y_1, y_2 pass and y_3
fails, n = 2 and the round commits y_1, y_2, y' with y' ~ Norm[(p_3 - q_3)_+]; p_4 is unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # n in 0..K
    next_token: int  # correction token (n < K) or bonus token (n = K)

    def committed(self, candidates: list[int]) -> list[int]:
        """The n + 1 tokens the round adds to the sequence."""
        return [*candidates[: self.num_accepted], self.next_token]


def verify_greedy(candidates: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Exact match against the target's argmax.

    candidates: [K] long; target_logits: [K+1, V] (row i scores position i+1).
    """
    target_tokens = torch.argmax(target_logits, dim=-1)  # [K+1]
    num_accepted = _first_true(candidates != target_tokens[: len(candidates)])
    return Verdict(num_accepted, int(target_tokens[num_accepted]))


def verify_sampled(
    candidates: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Rejection sampling: accept y_i while r_i < p_i(y_i) / q_i(y_i).

    candidates: [K] long; draft_probs: [K, V] (q_i, what y_i was drawn from);
    target_probs: [K+1, V] (p_i, processed exactly like q). The output sequence is distributed as
    the target's.
    """
    k = len(candidates)
    positions = torch.arange(k)
    p_y = target_probs[positions, candidates]  # [K]
    q_y = draft_probs[positions, candidates]  # [K], > 0 since y_i ~ q_i
    r = torch.rand(k, generator=generator, dtype=torch.float64)
    num_accepted = _first_true(r >= (p_y / q_y).double())
    if num_accepted < k:
        distribution = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
    else:
        distribution = target_probs[k]
    return Verdict(num_accepted, int(torch.multinomial(distribution, 1, generator=generator)))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Norm[(p - q)_+]. When p <= q everywhere (p == q up to rounding) a rejection had probability
    ~0; p itself is then the right distribution."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        return p
    return residual / total


def _first_true(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-D mask, or its length when there is none."""
    hits = torch.nonzero(mask)
    return int(hits[0]) if len(hits) else len(mask)
