"""The logits -> distribution transform shared by draft and target, and the request's sampling
parameters."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from scipy.stats import chisquare

from specdec.sampling import (BLOCK, SamplingParams, _top_p_filter, argmax, choose_token, probs_by_params,
                              probs_from_logits, probs_in_place, sample)

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, -2.5])  # distinct values: no ties at a cut-off


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(LOGITS / temperature, dim=-1))
    assert probs.dtype == torch.float32


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-36])
def test_a_temperature_near_zero_is_near_greedy_on_every_path(temperature):
    """Below float32's range the logits themselves would overflow to inf - inf = NaN; from the
    row's largest, every other token goes to 0 and the largest keeps it all (ties share it)."""
    logits = torch.stack([LOGITS, torch.tensor([1.0, 3.0, 2.0, 3.0, 0.0, -1.0])])
    params = SamplingParams(temperature=temperature)
    expected = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]])
    assert torch.equal(probs_from_logits(logits, params), expected)
    assert torch.equal(probs_in_place(logits.clone(), [params] * 2), expected)


def test_a_top_p_below_float32s_least_keeps_the_most_likely_token():
    """The wire carries top_p as a float32: 1e-46 arrives as 0, and the most likely token stays."""
    probs = torch.softmax(LOGITS, dim=-1)
    for top_p in (1e-46, float(torch.tensor(1e-46, dtype=torch.float32))):
        assert torch.equal(_top_p_filter(probs, top_p), torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k_tokens(k):
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=k))
    kept = torch.topk(LOGITS, k).indices
    assert int((probs > 0).sum()) == k
    assert set(torch.nonzero(probs).flatten().tolist()) == set(kept.tolist())
    torch.testing.assert_close(probs[kept], torch.softmax(LOGITS[kept], dim=-1))


def test_top_k_at_or_above_vocabulary_is_no_filter():
    for k in (0, len(LOGITS), len(LOGITS) + 3):
        probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=k))
        torch.testing.assert_close(probs, torch.softmax(LOGITS, dim=-1))


@pytest.mark.parametrize("top_p,expected", [
    (0.75, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.5 < 0.75 <= 0.5 + 0.3: two tokens
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.85: the third is needed too
    (0.4, [1.0, 0.0, 0.0, 0.0]),  # the top token alone already reaches the mass
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    probs = probs_from_logits(logits_of([0.5, 0.3, 0.15, 0.05]), SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected))


def test_top_p_on_shuffled_vocabulary_keeps_the_most_likely_tokens():
    probs = probs_from_logits(logits_of([0.15, 0.5, 0.05, 0.3]), SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))


def test_top_k_is_applied_before_top_p():
    """HF's order: top-k renormalises to [4/7, 3/7], then top-p 0.5 keeps only the first token.
    (Top-p first would keep two tokens.)"""
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    probs = probs_from_logits(logits_of([0.4, 0.3, 0.2, 0.1]), params)
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_filters_apply_per_row_of_a_batch():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.1])  # [3, V]
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    probs = probs_from_logits(logits, params)
    assert probs.shape == logits.shape
    for row in range(3):
        torch.testing.assert_close(probs[row], probs_from_logits(logits[row], params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_greedy_returns_the_plain_softmax():
    params = SamplingParams(temperature=0.0, top_k=2, top_p=0.5)  # filters are ignored when greedy
    assert params.greedy
    logits = LOGITS.to(torch.float16)
    probs = probs_from_logits(logits, params)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1))
    assert choose_token(probs, params, torch.Generator().manual_seed(0)) == int(torch.argmax(LOGITS))


@pytest.mark.parametrize("fields", [
    {"temperature": -0.1},
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"top_p": 0.0},
    {"top_p": 1.01},
    {"top_p": math.nan},
    {"top_k": -2},
    {"typo": 1},
])
def test_sampling_params_reject_out_of_range_values(fields):
    with pytest.raises(ValidationError):
        SamplingParams(**fields)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_number_that_is_not_finite_is_refused_as_such(field, value):
    """As the OpenAI route refuses it: NaN read as 'greater than or equal to 0' (temperature) or 'less
    than or equal to 1' (top_p), whichever bound it failed first, in process and over gRPC."""
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert info.value.errors()[0]["msg"] == "Input should be a finite number"


def test_a_top_k_of_minus_one_is_off_as_zero():
    """-1 is the OpenAI ecosystem's "no top-k filter" (vLLM's), 0 HF's: both off on every entry point
    (it was accepted over HTTP only), held as 0 (one transform, one value on the round wire)."""
    assert SamplingParams(temperature=1.0, top_k=-1) == SamplingParams(temperature=1.0, top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert torch.equal(probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=-1)), torch.softmax(LOGITS, -1))
    with pytest.raises(ValidationError, match="greater than or equal to -1"):
        SamplingParams(top_k=-2)


def test_sampling_params_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed is None
    assert not SamplingParams(temperature=0.5).greedy
    with pytest.raises(ValidationError):
        params.temperature = 1.0


def test_choose_token_samples_with_the_generator():
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0))
    params = SamplingParams(temperature=1.0)
    draws = [[choose_token(probs, params, generator) for _ in range(50)]
             for generator in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1
    filtered = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    generator = torch.Generator().manual_seed(6)
    assert {choose_token(filtered, params, generator) for _ in range(100)} == {0, 3}


def test_argmax_by_blocks_is_torch_argmax_ties_included():
    rows = torch.randn(6, 3 * BLOCK + 17, generator=torch.Generator().manual_seed(1))
    rows[1, 5] = rows[1, BLOCK + 3] = 50.0  # a tie across blocks: the first
    rows[2, -1] = 60.0  # in the short last block
    rows[3, BLOCK - 1] = rows[3, BLOCK] = 70.0  # at a block edge
    assert torch.equal(argmax(rows), torch.argmax(rows, dim=-1))


def test_sample_by_blocks_follows_the_distribution_and_never_draws_zero_mass():
    """Mass at block edges and in the short last block; 100,000 draws against a chi-squared test."""
    generator = torch.Generator().manual_seed(2)
    width = 3 * BLOCK + 17
    probs = torch.zeros(width)
    probs[torch.randperm(width, generator=generator)[:12]] = torch.rand(12, generator=generator)
    probs[BLOCK - 1], probs[BLOCK], probs[-1] = 0.3, 0.2, 0.1
    uniforms = torch.rand(100_000, generator=generator, dtype=torch.float64)
    tokens = sample(probs[None].expand(len(uniforms), width), uniforms)
    counts = torch.bincount(tokens, minlength=width).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() / probs.sum() * len(uniforms)
    assert chisquare(counts[support].numpy(), expected.numpy() * counts.sum().item() / expected.sum().item()).pvalue > 1e-3


def test_a_rows_distribution_does_not_depend_on_its_batch():
    """Rows of one transform share a call whatever their seeds, and every path (one call, per group,
    in place) computes a row bit for bit alike: a seeded request draws the same beside any other."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, seed=s) for s in (1, 2, 1, 3)]
    alone = torch.cat([probs_from_logits(logits[i:i + 1], p) for i, p in enumerate(params)])
    mixed = [params[0], SamplingParams(temperature=0.7, top_k=50), params[2], params[3]]
    assert torch.equal(probs_in_place(logits.clone(), params), alone)
    assert torch.equal(probs_in_place(logits.clone(), [params[0]] * 4),
                       torch.cat([probs_from_logits(logits[i:i + 1], params[0]) for i in range(4)]))
    assert torch.equal(probs_by_params(logits, mixed)[[0, 2, 3]], alone[[0, 2, 3]])
