"""The prose test set: enough distinct prompts, none about a training topic."""

from __future__ import annotations

from specdec.prompts import PROSE_TEST_PROMPTS, prose_test_prompts
from specdec.training.prose_prompts import TOPICS


def test_prose_test_set_is_large_and_distinct():
    assert len(PROSE_TEST_PROMPTS) >= 40
    assert len(set(PROSE_TEST_PROMPTS)) == len(PROSE_TEST_PROMPTS)
    assert all(text.strip() == text and text[-1] in ".?!" for text in PROSE_TEST_PROMPTS)


def test_prose_test_set_mentions_no_training_topic():
    leaks = [(topic, text) for text in PROSE_TEST_PROMPTS for topic in TOPICS if topic.lower() in text.lower()]
    assert leaks == []


def test_prose_test_prompts_limit():
    assert prose_test_prompts() == list(PROSE_TEST_PROMPTS)
    assert prose_test_prompts(3) == list(PROSE_TEST_PROMPTS[:3])
