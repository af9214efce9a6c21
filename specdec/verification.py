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

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from specdec.sampling import argmax, sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # n in 0..K
    next_token: int  # correction token (n < K) or bonus token (n = K)
    # For a feature draft: the target's states [m, reads, H] at the committed positions from the
    # item's `features_from` on (its history and the n accepted candidates), which the draft reads
    # next round (models/feature_draft.py). None otherwise.
    features: object = field(default=None, compare=False, repr=False)

    def committed(self, candidates: list[int]) -> list[int]:
        """The n + 1 tokens the round adds to the sequence."""
        return [*candidates[: self.num_accepted], self.next_token]


@dataclass(frozen=True)
class RoundBatch:
    """B sessions' candidates, laid out as vLLM's `SpecDecodeMetadata`: padded [B, K_max] for the
    token ids, flat for the [*, V] rows (the target scores session b's K_b + 1 positions in rows
    target_starts[b] + 0..K_b of one [T, V] tensor).

    Worked example: candidates [[5, 7], [], [9]] -> padded [[5, 7], [0, 0], [9, 0]],
    num_candidates [2, 0, 1], target_starts [0, 3, 4] (T = 6)."""

    candidates: torch.Tensor  # [B, K_max] long, 0 past each session's K_b
    num_candidates: torch.Tensor  # [B] long: K_b
    target_starts: torch.Tensor  # [B] long: where session b's target rows start

    @classmethod
    def of(cls, candidates: list[list[int]], device: torch.device | str = "cpu") -> RoundBatch:
        """On `device`, the target logits' (one copy from the host)."""
        k_max = max((len(c) for c in candidates), default=0)
        counts = [len(c) for c in candidates]
        starts = accumulate((n + 1 for n in counts[:-1]), initial=0)
        rows = torch.tensor([c + [0] * (k_max - len(c)) + [n, s] for c, n, s in zip(candidates, counts, starts)],
                            dtype=torch.long, device=device).reshape(len(candidates), k_max + 2)
        return cls(rows[:, :k_max], rows[:, k_max], rows[:, k_max + 1])

    @property
    def positions(self) -> torch.Tensor:
        """[B, K_max + 1] long: the target row of each position, the last row repeated past K_b."""
        steps = torch.arange(self.candidates.shape[1] + 1, device=self.candidates.device)
        return self.target_starts[:, None] + torch.minimum(steps[None, :], self.num_candidates[:, None])

    @property
    def real(self) -> torch.Tensor:
        """[B, K_max] bool: True where a candidate is one of the session's (not padding)."""
        return torch.arange(self.candidates.shape[1], device=self.candidates.device)[None, :] < self.num_candidates[:, None]


def verify_greedy_batch(batch: RoundBatch, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match against the target's argmax, for every session at once.

    target_logits [T, V] (the batch's layout) -> (num_accepted [B], next_token [B]) long."""
    target_tokens = argmax(target_logits)[batch.positions]  # [B, K_max + 1]
    rejected = (batch.candidates != target_tokens[:, :-1]) | ~batch.real  # [B, K_max]
    num_accepted = _first_true_rows(rejected)
    return num_accepted, target_tokens.gather(1, num_accepted[:, None]).squeeze(1)


def verify_sampled_batch(batch: RoundBatch, draft_token_probs: torch.Tensor, target_token_probs: torch.Tensor,
                         uniforms: torch.Tensor, final_probs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for every session at once: accept y_i while r_i < p_i(y_i) / q_i(y_i).

    draft_token_probs, target_token_probs [B, K_max]: q_i(y_i) and p_i(y_i) (any value past K_b);
    uniforms [B, K_max + 1] float64 from each session's generator: r_1..r_{K_b}, then the one the
    correction or bonus token is drawn with (column K_b); final_probs(num_accepted [B]) -> [B, V]:
    each session's Norm[(p_{n+1} - q_{n+1})_+] where n < K, else p_{K+1}, unnormalised
    (`final_distributions`).
    Returns (num_accepted [B], next_token [B]) long. The output sequence is distributed as the target's."""
    ratio = (target_token_probs / draft_token_probs).double()  # [B, K_max]; q_i(y_i) > 0 since y_i ~ q_i
    rejected = ~(uniforms[:, :-1] < ratio) | ~batch.real  # (a NaN ratio, 0 / 0, rejects)
    num_accepted = _first_true_rows(rejected)
    draw = uniforms.gather(1, batch.num_candidates[:, None]).squeeze(1)  # [B]: the uniform at column K_b
    return num_accepted, sample(final_probs(num_accepted), draw)


def final_distributions(target_rows: torch.Tensor, draft_rows: torch.Tensor | None,
                        rejected: torch.Tensor) -> torch.Tensor:
    """[B, V] the weights (unnormalised: `sample` normalises) each session's last committed token is
    drawn with: (p - q)_+ where its candidate was rejected (p where that is all 0: a rejection of
    probability ~0), p (the bonus row) where all were accepted. target_rows [B, V] p_{n+1}, written
    over; draft_rows [R, V] q_{n+1} of the R rejected sessions, in order (None: none rejected);
    rejected [B] bool."""
    if draft_rows is None:
        return target_rows
    index = rejected.nonzero().squeeze(1)
    every = len(index) == len(target_rows)
    residual = (target_rows if every else target_rows[index]).sub(draft_rows).clamp_(min=0.0)  # [R, V]
    empty = residual.sum(dim=-1) <= 0
    if bool(empty.any()):
        residual[empty] = target_rows[index[empty]]
    if every:
        return residual
    target_rows[index] = residual
    return target_rows


def verify_greedy(candidates: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Exact match against the target's argmax (`verify_greedy_batch` for one session).

    candidates: [K] long; target_logits: [K+1, V] (row i scores position i+1).
    """
    n, token = verify_greedy_batch(RoundBatch.of([candidates.tolist()], target_logits.device), target_logits)
    return Verdict(int(n[0]), int(token[0]))


def verify_sampled(
    candidates: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Rejection sampling for one session (`verify_sampled_batch`).

    candidates: [K] long; draft_probs: [K, V] (q_i, what y_i was drawn from);
    target_probs: [K+1, V] (p_i, processed exactly like q). The output sequence is distributed as
    the target's.
    """
    k, device = len(candidates), target_probs.device
    batch = RoundBatch.of([candidates.tolist()], device)
    positions = torch.arange(k, device=device)
    uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64)[None].to(device)  # [1, K + 1], host generator

    def final(n: torch.Tensor) -> torch.Tensor:
        i = int(n[0])
        return final_distributions(target_probs[i:i + 1].clone(), draft_probs[i:i + 1] if i < k else None,
                                   torch.tensor([i < k], device=device))

    n, token = verify_sampled_batch(batch, draft_probs[positions, candidates][None], target_probs[positions, candidates][None],
                                    uniforms, final)
    return Verdict(int(n[0]), int(token[0]))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Norm[(p - q)_+]. When p <= q everywhere (p == q up to rounding) a rejection had probability
    ~0; p itself is then the right distribution. (`final_distributions` is its batched, unnormalised form.)"""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        return p
    return residual / total


def _first_true_rows(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] long: the index of each row's first True, K where there is none."""
    padded = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)  # [B, K + 1]
    return padded.to(torch.uint8).argmax(dim=1)
