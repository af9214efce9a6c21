"""The prompts a bench run decodes: a test set (HumanEval for code, the prose set for natural
language), a validation split (where thresholds are chosen), or a file.

    humaneval         the 164 HumanEval problems as chat instructions (specdec/prompts.py)
    validation        the validation split of the head's stdlib training prompts
                      (specdec/training/stdlib_prompts.py, the split fraction of
                      cluster/training/default-pair.yaml); the head never trained on it
    prose             the hand-written natural-language test set (PROSE_TEST_PROMPTS in specdec/prompts.py)
    prose-validation  the validation split of the prose training prompts (specdec/training/prose_prompts.py,
                      the same fraction), for choosing thresholds on natural language
    editing           40 edits of HumanEval's solutions and 20 conversations revisiting one
                      (specdec/prompts.py `editing_prompts`): answers that repeat their prompt
    PATH              a .jsonl file (one JSON string, or object with "prompt", per line) or a text file
                      (one prompt per line)
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import InvalidRequestError

PROMPT_SETS = ("humaneval", "validation", "prose", "prose-validation", "editing")
VALIDATION_FRACTION = 0.05  # data.prompts.validation_fraction in cluster/training/default-pair.yaml


def load_prompts(source: str, limit: int | None = None) -> list[str | list[dict]]:
    """The set's prompts: texts, and for `editing` also conversations (lists of chat messages); the
    first `limit` of them."""
    if limit is not None and limit < 1:
        raise InvalidRequestError(f"--limit must be at least 1, got {limit}")
    if source == "humaneval":
        from specdec.prompts import humaneval_prompts

        prompts = humaneval_prompts()
    elif source == "validation":
        from specdec.training.stdlib_prompts import stdlib_prompts

        prompts = [p.text for p in stdlib_prompts(VALIDATION_FRACTION) if p.split == "validation"]
    elif source == "prose":
        from specdec.prompts import prose_test_prompts

        prompts = prose_test_prompts()
    elif source == "editing":
        from specdec.prompts import editing_prompts

        prompts = editing_prompts()
    elif source == "prose-validation":
        from specdec.training.prose_prompts import prose_prompts

        prompts = [p.text for p in prose_prompts(VALIDATION_FRACTION) if p.split == "validation"]
    else:
        prompts = _file_prompts(Path(source))
    if not prompts:
        raise InvalidRequestError(f"prompt set {source!r} holds no prompts")
    return prompts[:limit]


def _file_prompts(path: Path) -> list[str]:
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise InvalidRequestError(f"--prompts {path}: {what}; use {', '.join(PROMPT_SETS)} or a file")
    try:
        lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if line.strip()]
    except UnicodeDecodeError:
        raise InvalidRequestError(f"--prompts {path}: not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for number, line in lines:  # (numbered as an editor numbers them, blank lines counted)
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise InvalidRequestError(f"--prompts {path}:{number}: not JSON") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"--prompts {path}:{number}: expected a string or an object with \"prompt\"")
        if not prompt.strip():
            raise InvalidRequestError(f"--prompts {path}:{number}: the prompt is empty")
        prompts.append(prompt)
    return prompts
