"""Hand-written prose prompts: topic x template, deterministic hash order, a stable split."""

from __future__ import annotations

import pytest

from specdec.training.prose_prompts import TEMPLATES, TOPICS, prose_prompts, source_description, topic_slug
from specdec.training.stdlib_prompts import prompt_hash


def test_every_topic_meets_every_template():
    prompts = prose_prompts(0.05)
    assert len(TOPICS) >= 160 and len(TEMPLATES) >= 8
    assert len(prompts) == len(TOPICS) * len(TEMPLATES) >= 1000
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({topic_slug(t) for t in TOPICS}) == len(TOPICS)  # no two topics share an id
    assert all(p.id.startswith("prose:") and p.id.split(":")[1] in TEMPLATES for p in prompts)


def test_texts_are_filled_sentences():
    for prompt in prose_prompts(0.05):
        assert prompt.text.strip() == prompt.text and prompt.text[-1] in ".?!", prompt
        assert "{" not in prompt.text and "}" not in prompt.text, prompt
        assert prompt.text[0].isupper(), prompt


def test_order_is_the_hash_order_and_deterministic():
    first, second = prose_prompts(0.05), prose_prompts(0.05)
    assert first == second
    hashes = [prompt_hash(p.id) for p in first]
    assert hashes == sorted(hashes)


def test_split_fraction_and_stability():
    small, large = prose_prompts(0.05), prose_prompts(0.2)
    for fraction, prompts in ((0.05, small), (0.2, large)):
        share = sum(p.split == "validation" for p in prompts) / len(prompts)
        assert abs(share - fraction) < 0.04  # ~5 standard deviations at 2,600 prompts
    # A prompt's split depends on its id alone: a larger fraction only moves train prompts to validation.
    assert {p.id for p in small if p.split == "validation"} < {p.id for p in large if p.split == "validation"}


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_bad_fraction(fraction):
    with pytest.raises(ValueError, match="validation_fraction"):
        prose_prompts(fraction)


def test_source_description_names_the_counts():
    assert source_description(42) == (f"prose: hand-written natural-language requests, {len(TOPICS)} topics x "
                                      f"{len(TEMPLATES)} task templates (specdec/training/prose_prompts.py), 42 prompts")
