"""Verification (Algorithm 1): exact-match greedy cases and the statistics of rejection sampling on
hand-made distributions."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from specdec.verification import Verdict, residual_distribution, verify_greedy, verify_sampled
from stats import chi2_pvalue

SIGNIFICANCE = 1e-3  # a p-value below this at the fixed seed fails the test
TRIALS = 20_000


def one_hot_logits(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits [len(tokens), V] whose row argmaxes are `tokens`."""
    logits = torch.arange(vocab, dtype=torch.float32).repeat(len(tokens), 1) / 10  # [K+1, V]
    logits[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 5.0
    return logits


# ------------------------------------------------------------------------------------------------
# Greedy


def test_greedy_all_accepted_gives_bonus_from_last_row():
    verdict = verify_greedy(torch.tensor([2, 4, 1]), one_hot_logits([2, 4, 1, 3]))
    assert verdict == Verdict(num_accepted=3, next_token=3)
    assert verdict.committed([2, 4, 1]) == [2, 4, 1, 3]


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_first_mismatch_gives_target_token(mismatch):
    target = [2, 4, 1, 3]
    candidates = list(target[:3])
    candidates[mismatch] = 5
    if mismatch < 2:
        candidates[mismatch + 1] = 0  # a later mismatch must not matter
    verdict = verify_greedy(torch.tensor(candidates), one_hot_logits(target))
    assert verdict == Verdict(num_accepted=mismatch, next_token=target[mismatch])
    assert verdict.committed(candidates) == target[:mismatch + 1]


def test_greedy_without_candidates_is_one_target_token():
    verdict = verify_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([4]))
    assert verdict == Verdict(num_accepted=0, next_token=4)
    assert verdict.committed([]) == [4]


# ------------------------------------------------------------------------------------------------
# Residual distribution


def test_residual_distribution_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.2, 0.4, 0.1, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_residual_distribution_of_equal_distributions_is_p():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    residual = residual_distribution(p, p.clone())
    torch.testing.assert_close(residual, p)
    assert torch.isfinite(residual).all()


# ------------------------------------------------------------------------------------------------
# Sampled: statistics of rejection sampling


def random_rows(rows: int, vocab: int, generator: torch.Generator, zero: int | None = None) -> torch.Tensor:
    """Random distributions [rows, V] (not too peaked); `zero` gets probability 0 in row 0, like a
    token removed by top-k."""
    probs = torch.rand(rows, vocab, generator=generator, dtype=torch.float64) + 0.2
    if zero is not None:
        probs[0, zero] = 0.0
    return (probs / probs.sum(-1, keepdim=True)).float()


def run_rounds(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> list[tuple[int, list[int]]]:
    """(num_accepted, committed tokens) of `trials` rounds with candidates y_i ~ q_i."""
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.multinomial(q, trials, replacement=True, generator=generator).T  # [trials, K]
    rounds = []
    for ids in candidates:
        verdict = verify_sampled(ids, q, p, generator)
        rounds.append((verdict.num_accepted, verdict.committed(ids.tolist())))
    return rounds


def counts(tokens: list[tuple[int, ...]], vocab: int, length: int) -> np.ndarray:
    out = np.zeros([vocab] * length)
    for key, count in Counter(tokens).items():
        out[key] += count
    return out


@pytest.mark.parametrize("k,vocab,seed", [(2, 4, 0), (3, 5, 1), (3, 6, 2)])
def test_sampled_rounds_follow_the_target(k, vocab, seed):
    """Target rows here do not depend on the tokens, so the committed tokens must satisfy:
    token 1 ~ p_1; given y_1 accepted, (y_1, token 2) ~ Norm[min(p_1, q_1)] x p_2; given y_1..y_j
    accepted, token j + 1 ~ p_{j+1} (the bonus row when j = K); and P(y_1 accepted) =
    sum min(p_1, q_1)."""
    generator = torch.Generator().manual_seed(100 + seed)
    p = random_rows(k + 1, vocab, generator, zero=vocab - 1)  # [K+1, V]; p_1 never gives the last token
    q = random_rows(k, vocab, generator, zero=0)  # [K, V]; q_1 never drafts token 0
    rounds = run_rounds(p, q, TRIALS, seed)
    p64 = p.double().numpy()

    first = counts([(tokens[0],) for _, tokens in rounds], vocab, 1)
    assert chi2_pvalue(first, p64[0]) > SIGNIFICANCE

    overlap = np.minimum(p64[0], q.double().numpy()[0])
    accepted_first = sum(n >= 1 for n, _ in rounds)
    assert binomtest(accepted_first, TRIALS, overlap.sum()).pvalue > SIGNIFICANCE

    pairs = counts([tuple(tokens[:2]) for n, tokens in rounds if n >= 1], vocab, 2)
    assert chi2_pvalue(pairs, np.outer(overlap / overlap.sum(), p64[1])) > SIGNIFICANCE

    for j in range(2, k + 1):  # token j + 1 after j accepted candidates
        later = counts([(tokens[j],) for n, tokens in rounds if n >= j], vocab, 1)
        assert later.sum() > 500, "too few long rounds for a test"
        assert chi2_pvalue(later, p64[j]) > SIGNIFICANCE, f"token {j + 1}"


def test_sampled_accepts_every_candidate_when_draft_equals_target():
    generator = torch.Generator().manual_seed(3)
    p = random_rows(4, 5, generator)
    rounds = run_rounds(p, p[:3].clone(), trials=500, seed=4)
    assert all(n == 3 for n, _ in rounds)


def test_sampled_rejects_a_candidate_the_target_cannot_produce():
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.6, 0.2, 0.2]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        verdict = verify_sampled(torch.tensor([0]), q, p, generator)
        assert verdict.num_accepted == 0 and verdict.next_token in (1, 2)


def test_sampled_rejects_a_candidate_neither_could_produce():
    """p / q = 0 / 0 is NaN, and `r >= NaN` is false: the candidate was accepted (a peer can send one;
    the services refuse it, services/convert.py `unpack_draft_probs`)."""
    p = torch.tensor([[0.0, 0.2, 0.8], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.5, 0.5]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        verdict = verify_sampled(torch.tensor([0]), q, p, generator)
        assert verdict.num_accepted == 0 and verdict.next_token == 2


def test_sampled_without_candidates_draws_from_the_first_row():
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    generator = torch.Generator().manual_seed(5)
    tokens = [verify_sampled(torch.tensor([], dtype=torch.long), p[:0], p, generator) for _ in range(3000)]
    assert all(v.num_accepted == 0 for v in tokens)
    observed = counts([(v.next_token,) for v in tokens], 4, 1)
    assert chi2_pvalue(observed, p[0].double().numpy()) > SIGNIFICANCE


def test_sampled_is_reproducible_with_the_same_generator_seed():
    generator = torch.Generator().manual_seed(7)
    p, q = random_rows(4, 5, generator), random_rows(3, 5, generator)
    assert run_rounds(p, q, trials=200, seed=9) == run_rounds(p, q, trials=200, seed=9)
