"""The draft-distribution features a `hidden+distribution` head reads, and round positions."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.features import MIN_PROB, SCALAR_FEATURES, distribution_features, round_positions


def test_features_of_one_candidate():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    got = dict(zip(SCALAR_FEATURES, distribution_features(probs, torch.tensor(1), torch.tensor(3)).tolist()))
    assert got["log_q_token"] == pytest.approx(math.log(0.3))
    assert got["log_top1"] == pytest.approx(math.log(0.5))
    assert got["log_margin"] == pytest.approx(math.log(0.5 / 0.3))
    assert got["entropy"] == pytest.approx(-(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)))
    assert got["log_position"] == pytest.approx(math.log(3)) and got["greedy"] == 0.0
    greedy = distribution_features(probs, torch.tensor(0), torch.tensor(3), greedy=True)
    assert greedy[SCALAR_FEATURES.index("greedy")] == 1.0
    outside = distribution_features(probs, torch.tensor(3), torch.tensor(1))  # q = 0: floored, finite
    assert outside[0] == pytest.approx(math.log(MIN_PROB))


def test_batched_features_equal_one_at_a_time():
    probs = torch.softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), -1)
    tokens, positions = torch.tensor([0, 3, 3, 10, 2]), torch.tensor([1, 2, 3, 1, 2])
    batched = distribution_features(probs, tokens, positions)
    for i in range(5):
        torch.testing.assert_close(batched[i], distribution_features(probs[i], tokens[i], positions[i]))


def test_round_positions_count_the_run_of_draft_tokens():
    is_draft = torch.tensor([True, True, False, True, True, True, False])
    assert round_positions(is_draft).tolist() == [1, 2, 0, 1, 2, 3, 0]
