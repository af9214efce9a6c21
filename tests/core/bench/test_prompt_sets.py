"""The named prompt sets a bench run can decode (the prose ones; no models)."""

from __future__ import annotations

import pytest

from specdec.bench.prompt_sets import PROMPT_SETS, VALIDATION_FRACTION, load_prompts
from specdec.errors import InvalidRequestError
from specdec.prompts import PROSE_TEST_PROMPTS
from specdec.training.prose_prompts import prose_prompts


def test_prose_is_the_test_set():
    assert "prose" in PROMPT_SETS
    assert load_prompts("prose") == list(PROSE_TEST_PROMPTS)
    assert load_prompts("prose", limit=5) == list(PROSE_TEST_PROMPTS[:5])


def test_prose_validation_is_the_validation_split_only():
    assert "prose-validation" in PROMPT_SETS
    split = {p.text: p.split for p in prose_prompts(VALIDATION_FRACTION)}
    prompts = load_prompts("prose-validation")
    assert prompts and all(split[text] == "validation" for text in prompts)
    assert len(prompts) == sum(s == "validation" for s in split.values())
    assert not set(prompts) & set(PROSE_TEST_PROMPTS)
    assert load_prompts("prose-validation", limit=3) == prompts[:3]


def test_unknown_name_is_a_missing_file(tmp_path):
    with pytest.raises(InvalidRequestError, match="prose-validation"):
        load_prompts(str(tmp_path / "no-such-set"))
