"""Training prompts from the docstrings of installed Python packages, with their code as reference answers.

The stdlib prompts (specdec/training/stdlib_prompts.py) hold 2,778 train prompts, all written into
the feature draft's data; the draft's acceptance on code grows with code text (docs/training.md), and
a reference answer costs one teacher-forced pass (~2 s here) where a response of the target's costs
a decode (~15 s). The packages this project installs (and theirs) hold eight times as many documented
functions. Their prompts are made by the stdlib prompts' rule (`documented_functions`, the same
instruction and the function's own code as its reference), ids `package.module:qualname`.

Only packages that `pip install -e .[test]` brings are listed, so every machine that runs the project
finds them; one that is missing is skipped, and the manifest records each found package's version.
Code copied between modules (transformers' `# Copied from` methods: the same code under another
class) is kept once, at its first module in name order: a copy teaches nothing new. Order and split
come from the hash of the id, as the other sources'.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from specdec.training.stdlib_prompts import Prompt, documented_functions, hash_split

SOURCE_NAME = "package-docstrings"
# (import name, distribution name): general Python first in spirit (algorithms, parsers, clients),
# then the ML stack this project runs on.
PACKAGES = (("networkx", "networkx"), ("sympy", "sympy"), ("numpy", "numpy"), ("pandas", "pandas"),
            ("jinja2", "Jinja2"), ("click", "click"), ("packaging", "packaging"), ("yaml", "PyYAML"),
            ("requests", "requests"), ("urllib3", "urllib3"), ("aiohttp", "aiohttp"), ("fsspec", "fsspec"),
            ("_pytest", "pytest"), ("hypothesis", "hypothesis"), ("setuptools", "setuptools"),
            ("tqdm", "tqdm"), ("pydantic", "pydantic"), ("starlette", "starlette"), ("fastapi", "fastapi"),
            ("uvicorn", "uvicorn"), ("matplotlib", "matplotlib"), ("pyarrow", "pyarrow"),
            ("huggingface_hub", "huggingface_hub"), ("openai", "openai"), ("grpc", "grpcio"),
            ("torch", "torch"), ("accelerate", "accelerate"), ("transformers", "transformers"), ("ray", "ray"))


def package_roots(packages=PACKAGES) -> list[tuple[str, Path, str]]:
    """(import name, source folder, version) of each listed package that is installed, in list order."""
    found = []
    for name, distribution in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        found.append((name, Path(next(iter(spec.submodule_search_locations))), version))
    return found


def package_prompts(validation_fraction: float, roots: list[tuple[str, Path, str]] | None = None) -> list[Prompt]:
    """All prompts, in hash order, each tagged with its split; `roots` as package_roots' (tests)."""
    found: dict[str, str] = {}
    references: dict[str, str] = {}
    seen_code: set[str] = set()
    for name, root, _ in package_roots() if roots is None else roots:
        for prompt_id, text, reference in documented_functions(root, package=name, docstring_in_reference=False):
            if prompt_id not in found and reference not in seen_code:
                found[prompt_id], references[prompt_id] = text, reference
                seen_code.add(reference)
    return hash_split(found, validation_fraction, references)


def source_description(count: int) -> str:
    """The string the manifest records: what the prompts are and where they came from."""
    versions = ", ".join(f"{name} {version}" for name, _, version in package_roots())
    return (f"{SOURCE_NAME}: instructions from the docstrings of public functions, classes and methods of "
            f"installed packages ({versions}), their code as reference answers, {count} prompts")
