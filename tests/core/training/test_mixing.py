"""BERT-style mixing: Z_i = X_i with probability r, else Y_i; the loss mask marks the Y-taken positions."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.training.mixing import OFFICIAL_TARGET_TOKEN_RATIO, mix_tokens

N = 100_000
DRAFT_OFFSET = 1_000  # X in [0, 1000), Y in [1000, 2000): a token in Z tells where it came from


def disjoint_tokens(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, DRAFT_OFFSET, (n,), generator=generator)
    y = torch.randint(0, DRAFT_OFFSET, (n,), generator=generator) + DRAFT_OFFSET
    return x, y


@pytest.mark.parametrize("ratio", [OFFICIAL_TARGET_TOKEN_RATIO, 0.5, 0.9])
def test_fraction_taken_from_target_is_close_to_r(ratio):
    x, y = disjoint_tokens()
    _, is_draft = mix_tokens(x, y, ratio, torch.Generator().manual_seed(1))
    taken_from_x = int((~is_draft).sum())  # ~ Binomial(N, r)
    assert abs(taken_from_x - N * ratio) < 5 * math.sqrt(N * ratio * (1 - ratio))


def test_mask_marks_exactly_the_draft_taken_positions():
    x, y = disjoint_tokens()
    z, is_draft = mix_tokens(x, y, 0.3, torch.Generator().manual_seed(2))
    assert z.shape == x.shape and z.dtype == torch.long and is_draft.dtype == torch.bool
    torch.testing.assert_close(is_draft, z >= DRAFT_OFFSET)
    torch.testing.assert_close(z[is_draft], y[is_draft])
    torch.testing.assert_close(z[~is_draft], x[~is_draft])


def test_mask_follows_the_coin_not_token_equality():
    """Where Y_i == X_i the token is the same either way; the position still counts iff taken from Y."""
    x, y = disjoint_tokens(n=1_000)
    mixed_distinct, mask_distinct = mix_tokens(x, y, 0.5, torch.Generator().manual_seed(3))
    mixed_same, mask_same = mix_tokens(x, x.clone(), 0.5, torch.Generator().manual_seed(3))
    torch.testing.assert_close(mask_same, mask_distinct)
    torch.testing.assert_close(mixed_same, x)
    assert 0 < int(mask_same.sum()) < len(x)  # some identical tokens are draft positions, some not


def test_reproducible_with_seed():
    x, y = disjoint_tokens(n=2_000)
    first = mix_tokens(x, y, 0.15, torch.Generator().manual_seed(4))
    second = mix_tokens(x, y, 0.15, torch.Generator().manual_seed(4))
    other = mix_tokens(x, y, 0.15, torch.Generator().manual_seed(5))
    torch.testing.assert_close(first, second)
    assert not torch.equal(first[1], other[1])


def test_extreme_ratios_and_batches():
    x, y = disjoint_tokens(n=64)
    x, y = x.view(4, 16), y.view(4, 16)
    z, is_draft = mix_tokens(x, y, 0.0, torch.Generator().manual_seed(6))
    assert is_draft.all() and torch.equal(z, y) and z.shape == (4, 16)
    z, is_draft = mix_tokens(x, y, 1.0, torch.Generator().manual_seed(6))
    assert not is_draft.any() and torch.equal(z, x)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan])
def test_ratio_outside_unit_interval_is_an_error(ratio):
    x, y = disjoint_tokens(n=8)
    with pytest.raises(ValueError, match="target_ratio"):
        mix_tokens(x, y, ratio, torch.Generator())


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in shape"):
        mix_tokens(torch.zeros(4, dtype=torch.long), torch.zeros(5, dtype=torch.long), 0.15, torch.Generator())
