"""Training prompts from stdlib docstrings: parsed not imported, deterministic, a fixed split."""

from __future__ import annotations

import pytest

from specdec.training.stdlib_prompts import hash_split, prompt_hash, stdlib_prompts

DOC = "Return the number of widgets in the given container, counting nested ones too."


@pytest.fixture
def fake_stdlib(tmp_path):
    (tmp_path / "widgets.py").write_text(
        f'raise SystemExit("never imported")\n\ndef count(box, nested=True):\n    """{DOC}"""\n\n'
        f'def _private(x):\n    """{DOC}"""\n\ndef short():\n    """Too short."""\n\n'
        f'class Box:\n    def add(self, item):\n        """{DOC}"""\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(f'def helper(a):\n    """{DOC}"""\n')
    for skipped in ("test", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "__init__.py").write_text(f'def hidden(a):\n    """{DOC}"""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    return tmp_path


def test_prompts_from_docstrings(fake_stdlib):
    prompts = {p.id: p for p in stdlib_prompts(0.5, root=fake_stdlib)}
    assert set(prompts) == {"widgets:count", "widgets:Box.add", "pkg:helper"}
    assert prompts["widgets:count"].text == f"Write a Python function `count(box, nested=True)`.\n\n{DOC}"
    assert prompts["widgets:Box.add"].text.startswith("Write the method `add(self, item)` of a class `Box`.")
    # the reference answer: the function's own code, dedented, in one fenced block
    assert prompts["widgets:count"].reference == f'```python\ndef count(box, nested=True):\n    """{DOC}"""\n```'
    assert prompts["widgets:Box.add"].reference == f'```python\ndef add(self, item):\n    """{DOC}"""\n```'


def test_order_and_split_are_fixed(fake_stdlib):
    first, second = stdlib_prompts(0.5, root=fake_stdlib), stdlib_prompts(0.5, root=fake_stdlib)
    assert first == second
    assert {p.split for p in first} <= {"train", "validation"}
    # A prompt's split depends on its id only: adding a module moves no existing prompt.
    (fake_stdlib / "extra.py").write_text(f'def more(a):\n    """{DOC}"""\n')
    grown = {p.id: p.split for p in stdlib_prompts(0.5, root=fake_stdlib)}
    assert all(grown[p.id] == p.split for p in first)


def test_bad_fraction(fake_stdlib):
    with pytest.raises(ValueError, match="validation_fraction"):
        stdlib_prompts(1.0, root=fake_stdlib)


def test_hash_split_depends_on_ids_only():
    texts = {f"x:{i}": f"text {i}" for i in range(200)}
    full = {p.id: p.split for p in hash_split(texts, 0.3)}
    half = hash_split({pid: texts[pid] for pid in list(texts)[:100]}, 0.3)
    assert all(full[p.id] == p.split for p in half)
    assert [p.id for p in hash_split(texts, 0.3)] == sorted(texts, key=prompt_hash)
