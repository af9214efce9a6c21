"""Soft acceptance labels P_i = min(1, p(Y_i)/q(Y_i)) and the draft samples Y_i ~ q_i."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.training.labels import (
    sample_draft_tokens,
    soft_acceptance_labels,
    soft_acceptance_labels_from_logprobs,
)


def random_probs(n: int, v: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(n, v, generator=generator), dim=-1)


def test_labels_equal_min_one_p_over_q_computed_independently():
    p, q = random_probs(64, 9, seed=1), random_probs(64, 9, seed=2)
    y = sample_draft_tokens(q, torch.Generator().manual_seed(3))
    labels = soft_acceptance_labels(p, q, y)

    p_np, q_np, y_np = p.double().numpy(), q.double().numpy(), y.numpy()
    expected = np.empty(len(y_np))
    for i, token in enumerate(y_np):
        ratio = p_np[i, token] / q_np[i, token]
        expected[i] = ratio if ratio < 1.0 else 1.0
    np.testing.assert_allclose(labels.numpy(), expected, rtol=1e-6)
    assert labels.shape == (64,) and labels.dtype == torch.float32
    assert 0.0 < labels.min() and labels.max() == 1.0  # both regimes occur in this sample


def test_hand_example():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.1, 0.9]])
    q = torch.tensor([[0.25, 0.75], [0.25, 0.75], [0.2, 0.8]])
    labels = soft_acceptance_labels(p, q, torch.tensor([0, 1, 0]))
    torch.testing.assert_close(labels, torch.tensor([1.0, 0.5 / 0.75, 0.5]))


def test_log_space_labels_agree_with_probability_labels():
    p, q = random_probs(40, 6, seed=4), random_probs(40, 6, seed=5)
    y = sample_draft_tokens(q, torch.Generator().manual_seed(6))
    index = y.unsqueeze(-1)
    from_logprobs = soft_acceptance_labels_from_logprobs(p.log().gather(-1, index).squeeze(-1),
                                                         q.log().gather(-1, index).squeeze(-1))
    torch.testing.assert_close(from_logprobs, soft_acceptance_labels(p, q, y))


def test_mean_label_is_one_minus_total_variation():
    """E_{Y~q}[min(1, p(Y)/q(Y))] = sum_v min(p_v, q_v): the acceptance rate of verification."""
    n = 20_000
    p = torch.tensor([0.5, 0.3, 0.15, 0.05]).expand(n, 4)
    q = torch.tensor([0.2, 0.2, 0.3, 0.3]).expand(n, 4)
    labels = soft_acceptance_labels(p, q, sample_draft_tokens(q.contiguous(), torch.Generator().manual_seed(7)))
    expected = float(torch.minimum(p[0], q[0]).sum())  # 0.2 + 0.2 + 0.15 + 0.05 = 0.6
    standard_error = float(labels.std()) / math.sqrt(n)
    assert abs(float(labels.mean()) - expected) < 5 * standard_error


def test_greedy_one_hot_labels_are_exact_match():
    target_argmax, draft_argmax = torch.tensor([2, 0, 1]), torch.tensor([2, 1, 1])
    p = torch.nn.functional.one_hot(target_argmax, 3).float()
    q = torch.nn.functional.one_hot(draft_argmax, 3).float()
    torch.testing.assert_close(soft_acceptance_labels(p, q, draft_argmax), torch.tensor([1.0, 0.0, 1.0]))


def test_samples_follow_the_draft_distribution_and_are_reproducible():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4]).expand(40_000, 4).contiguous()
    tokens = sample_draft_tokens(q, torch.Generator().manual_seed(8))
    assert tokens.shape == (40_000,) and tokens.dtype == torch.long
    counts = torch.bincount(tokens, minlength=4).numpy()
    assert stats.chisquare(counts, q[0].numpy() * len(tokens)).pvalue > 1e-3
    torch.testing.assert_close(tokens, sample_draft_tokens(q, torch.Generator().manual_seed(8)))
    assert not torch.equal(tokens, sample_draft_tokens(q, torch.Generator().manual_seed(9)))


def test_token_impossible_under_q_is_an_error():
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="draft probability 0"):
        soft_acceptance_labels(p, q, torch.tensor([1]))
    with pytest.raises(ValueError, match="-inf"):
        soft_acceptance_labels_from_logprobs(torch.tensor([-0.7]), torch.tensor([-math.inf]))


@pytest.mark.parametrize("shapes", [((2, 3), (2, 4), (2,)), ((2, 3), (2, 3), (3,)), ((6,), (6,), (1,))])
def test_shape_mismatch_is_an_error(shapes):
    p_shape, q_shape, y_shape = shapes
    with pytest.raises(ValueError):
        soft_acceptance_labels(torch.full(p_shape, 0.5), torch.full(q_shape, 0.5),
                               torch.zeros(y_shape, dtype=torch.long))
