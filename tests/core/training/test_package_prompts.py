"""Training prompts from installed packages' docstrings: ids under the package, code-only references, copies once."""

from __future__ import annotations

from specdec.training.package_prompts import package_prompts, package_roots

DOC = "Return the number of widgets in the given container, counting nested ones too."
BODY = "    return sum(1 for _ in box)\n"


def test_prompts_from_a_package(tmp_path):
    (tmp_path / "widgets").mkdir()
    (tmp_path / "widgets" / "__init__.py").write_text(f'def count(box):\n    """{DOC}"""\n\n{BODY}')
    (tmp_path / "widgets" / "copies.py").write_text(  # the same code again: a copy, kept once
        f'def count(box):\n    """{DOC}"""\n\n{BODY}\n\nclass Box:\n    def abstract(self):\n        """{DOC}"""\n'
        f'        raise NotImplementedError\n\n    def size(self):\n        """{DOC}"""\n        return 3\n')
    prompts = {p.id: p for p in package_prompts(0.5, roots=[("widgets", tmp_path / "widgets", "1.0")])}
    # ids under the package; a method with nothing past its docstring but a placeholder has no prompt
    assert set(prompts) == {"widgets:count", "widgets.copies:Box.size"}
    # the instruction holds the docstring, the reference answer the code alone
    assert prompts["widgets:count"].text == f"Write a Python function `count(box)`.\n\n{DOC}"
    assert prompts["widgets:count"].reference == f"```python\ndef count(box):\n{BODY}```"
    assert prompts["widgets.copies:Box.size"].reference == "```python\ndef size(self):\n    return 3\n```"


def test_missing_packages_are_skipped():
    roots = package_roots((("specdec", "specdec-ray"), ("no_such_package_here", "nothing")))
    assert [name for name, _, _ in roots] == ["specdec"]
