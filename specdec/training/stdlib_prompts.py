"""Training and validation prompts from Python's standard library docstrings (real text, offline).

HumanEval is the test set (specdec/prompts.py): the head and its threshold must never see it. The
training prompts are coding instructions made from the public functions, classes and methods of the
stdlib's pure-Python modules that carry a docstring:

    Write a Python function `dedent(text)`.

    Remove any common leading whitespace from every line in `text`. ...

The source files are parsed with `ast`, never imported: importing every stdlib module has side
effects (`antigravity` opens a browser, `this` prints), and parsing gives the same list on every
machine with the same Python version, which the manifest records.

Order and split are fixed by a hash of each prompt's id (`module:qualname`): sorting by it spreads
any prefix of the list over all modules, and the validation split is the ids whose hash falls in the
first `validation_fraction` of the range, so it does not move when other prompts come or go.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SOURCE_NAME = "stdlib-docstrings"
# Packages whose docstrings are tests, demos, or not code at all.
EXCLUDED_TOP_LEVEL = frozenset({"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                                "antigravity", "this", "__phello__", "site-packages"})
MIN_DOCSTRING_CHARS = 40  # shorter docstrings ("Return self.") describe nothing worth writing
MAX_DOCSTRING_CHARS = 1200
HASH_BUCKETS = 1 << 32


@dataclass(frozen=True)
class Prompt:
    id: str  # "module:qualname", e.g. "textwrap:dedent"
    text: str
    split: str  # "train" or "validation"
    # A reference answer, where the source has one (the stdlib function's own code): a features
    # dataset may take it as a train prompt's response instead of the target's (training/data.py).
    reference: str | None = None


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_description(count: int) -> str:
    """The string the manifest records: what the prompts are and where they came from."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return (f"{SOURCE_NAME}: instructions from the docstrings of public functions, classes and methods in "
            f"CPython {version}'s standard library (ast over {stdlib_root()}), {count} prompts")


def stdlib_prompts(validation_fraction: float, root: Path | None = None) -> list[Prompt]:
    """All prompts, in hash order, each tagged with its split."""
    check_fraction(validation_fraction)  # before the scan: a bad config fails at once
    found: dict[str, str] = {}
    references: dict[str, str] = {}
    for prompt_id, text, reference in documented_functions(root or stdlib_root()):
        if prompt_id not in found:
            found[prompt_id], references[prompt_id] = text, reference
    return hash_split(found, validation_fraction, references)


def documented_functions(root: Path, package: str | None = None, docstring_in_reference: bool = True):
    """(id, instruction, reference answer) of every documented public function and method in the
    source files under `root` (module names relative to it, under `package` when given), in module
    order. Without `docstring_in_reference` a reference is the code alone (the instruction already
    holds the docstring), and a function with no code past its docstring (abstract, `pass`) has none."""
    for module, path in _module_files(root):
        if package is not None:
            module = f"{package}.{module}" if module else package
        yield from _file_prompts(module, path, docstring_in_reference)


def hash_split(texts: dict[str, str], validation_fraction: float,
               references: dict[str, str] | None = None) -> list[Prompt]:
    """Prompts sorted by the hash of their id; an id whose hash falls in the first
    `validation_fraction` of the range is validation, so a prompt's split depends on its id alone."""
    check_fraction(validation_fraction)
    cut = int(validation_fraction * HASH_BUCKETS)
    ordered = sorted(texts, key=prompt_hash)
    references = references or {}
    return [Prompt(pid, texts[pid], "validation" if prompt_hash(pid) < cut else "train", references.get(pid))
            for pid in ordered]


def check_fraction(validation_fraction: float) -> None:
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction}")


def prompt_hash(prompt_id: str) -> int:
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:4], "big")


def instruction(signature: str, docstring: str, owner: str | None = None) -> str:
    what = f"the method `{signature}` of a class `{owner}`" if owner else f"a Python function `{signature}`"
    return f"Write {what}.\n\n{docstring}"


def _module_files(root: Path):
    """(dotted module name, file) for every public stdlib source file, sorted; prunes excluded trees."""
    found = []
    for folder, subdirs, files in os.walk(root):
        rel = Path(folder).relative_to(root).parts
        subdirs[:] = [d for d in subdirs if not (rel == () and d in EXCLUDED_TOP_LEVEL) and d not in ("test", "tests")
                      and not d.startswith(("_", ".")) and (Path(folder, d, "__init__.py").is_file())]
        for name in files:
            if name.endswith(".py") and (name == "__init__.py" or not name.startswith("_")):
                parts = (*rel, name[:-3])
                if parts[0] not in EXCLUDED_TOP_LEVEL:
                    found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), Path(folder, name)))
    return sorted(found)


def _file_prompts(module: str, path: Path, docstring_in_reference: bool = True):
    """(id, instruction, reference answer) of each documented public function and method."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or bytes
        return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield from _function_prompt(module, None, node, source, docstring_in_reference)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield from _function_prompt(module, node.name, item, source, docstring_in_reference)


def _function_prompt(module: str, owner: str | None, node: ast.FunctionDef | ast.AsyncFunctionDef, source: str,
                     docstring_in_reference: bool = True):
    docstring = ast.get_docstring(node, clean=True)
    if not docstring or not MIN_DOCSTRING_CHARS <= len(docstring) <= MAX_DOCSTRING_CHARS:
        return
    if not docstring_in_reference and not _has_code(node):
        return
    qualname = f"{owner}.{node.name}" if owner else node.name
    yield (f"{module}:{qualname}", instruction(f"{node.name}({ast.unparse(node.args)})", docstring, owner),
           reference_answer(source, node, docstring_in_reference))


def _has_code(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the body holds more than its docstring and one placeholder statement."""
    body = node.body[1:]
    return bool(body) and not (len(body) == 1 and _is_placeholder(body[0]))


def _is_placeholder(stmt: ast.stmt) -> bool:
    """`pass`, `...` or `raise NotImplementedError`: a statement that says the code is elsewhere."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value is Ellipsis
    return isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt))


def reference_answer(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef, docstring: bool = True) -> str:
    """The function's own code as a chat answer writes it: one fenced Python block; without its
    docstring's lines when `docstring` is off."""
    code = ast.get_source_segment(source, node, padded=True) or ast.unparse(node)
    doc = node.body[0]
    if not docstring and doc.lineno > node.lineno:  # (a docstring on the `def` line stays)
        lines = code.splitlines()
        after = lines[doc.end_lineno - node.lineno + 1:]
        while after and not after[0].strip():  # the blank line that followed the docstring
            after = after[1:]
        code = "\n".join(lines[:doc.lineno - node.lineno] + after)
    return f"```python\n{textwrap.dedent(code).strip()}\n```"
