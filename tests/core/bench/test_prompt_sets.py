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


def test_editing_is_forty_edits_of_humaneval_solutions_and_twenty_conversations(tiny_engine):
    from specdec.prompts import EDIT_KINDS, EDITS_PER_KIND, humaneval_problems

    prompts = load_prompts("editing")
    edits, conversations = [p for p in prompts if isinstance(p, str)], [p for p in prompts if not isinstance(p, str)]
    assert len(edits) == len(EDIT_KINDS) * EDITS_PER_KIND == 40 and len(conversations) == 20
    assert all("```python\n" in p for p in edits)
    solutions = [p["canonical_solution"] for p in humaneval_problems()]
    # each edit quotes a HumanEval solution whole, but the planted bugs, which quote one changed
    fixes = [p for p in edits if p.startswith(EDIT_KINDS["fix"][:30])]
    assert len(fixes) == EDITS_PER_KIND
    assert all(any(s in p for s in solutions) for p in edits if p not in fixes)
    assert not any(any(s in p for s in solutions) for p in fixes)
    first = load_prompts("editing", limit=len(EDIT_KINDS) + 1)  # the first prompts hold every kind
    assert {p[:20] for p in first[:-1]} == {text[:20] for text in EDIT_KINDS.values()} and not isinstance(first[-1], str)
    for conversation in conversations:  # the second turn revisits the first answer
        assert [m["role"] for m in conversation] == ["user", "assistant", "user"]
        assert any(s in conversation[1]["content"] for s in solutions)
    assert len(set(map(str, prompts))) == 60
    # a conversation is encoded through the chat template as its messages
    assert tiny_engine.encode_prompt(conversations[0]) == tiny_engine.rules.encode_messages(conversations[0])


def test_a_prompts_file_that_is_not_text_and_a_limit_below_one_are_refused_in_one_line(tmp_path):
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\x00\xb1\xff\x86 prompt")
    with pytest.raises(InvalidRequestError, match="not UTF-8 text"):
        load_prompts(str(binary))
    with pytest.raises(InvalidRequestError, match="--limit must be at least 1, got -1"):
        load_prompts("prose", limit=-1)


def test_a_prompts_files_bad_line_is_named_by_its_line_number_and_a_directory_as_one(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "hi"}\n\n{"prompt": "  "}\n')
    with pytest.raises(InvalidRequestError, match=r"prompts.jsonl:3: the prompt is empty"):  # (blank line 2 counted)
        load_prompts(str(jsonl))
    jsonl.write_text('"hi"\n\nnot json\n')
    with pytest.raises(InvalidRequestError, match=r"prompts.jsonl:3: not JSON"):
        load_prompts(str(jsonl))
    with pytest.raises(InvalidRequestError, match="a directory; use humaneval"):
        load_prompts(str(tmp_path))
