"""Forward-time curves t_draft(k) and t_target(k): median time of one pass over k tokens with a warm
KV cache (a prompt already cached), the k a verification pass feeds being K + 1."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from specdec.models.runtime import Feed, Runtime

PROMPT_TOKENS = 200  # a typical HumanEval chat prompt's length with the Qwen tokenizer
DEFAULT_KS = (1, 2, 4, 8, 16)
DEFAULT_REPEATS = 5


def synthetic_tokens(count: int, vocab_size: int, offset: int = 0) -> list[int]:
    """Deterministic ids spread over the vocabulary (forward time does not depend on which)."""
    return [((offset + i) * 7919 + 100) % vocab_size for i in range(count)]


class TimedForward:
    """Wraps a runtime's `_forward` (or another method that runs its passes: a feature draft's
    `_outputs` and `chain`) to add up its wall time and count its passes (a pass returns once its
    outputs are ready): the loop's time outside them is its host work. With `describe(*args)`, each
    call's (seconds, description) is also kept in `log`, e.g. the longest feed of a `_forward`
    (`longest_feed`), to tell a prefill from a decoding step."""

    def __init__(self, runtime: Runtime, method: str = "_forward", describe=None):
        self.inner, self.seconds, self.calls = getattr(runtime, method), 0.0, 0
        self.describe, self.log = describe, []
        setattr(runtime, method, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            self.seconds += seconds
            self.calls += 1
            if self.describe is not None:
                self.log.append((seconds, self.describe(*args, **kwargs)))

    def reset(self) -> None:
        self.seconds, self.calls, self.log = 0.0, 0, []


def longest_feed(feeds: list[Feed]) -> int:
    """`TimedForward`'s description of a `_forward`: the most tokens one session fed."""
    return max((len(f.tokens) for f in feeds), default=0)


def time_pass(runtime: Runtime, k: int, repeats: int = DEFAULT_REPEATS,
              prompt_tokens: int = PROMPT_TOKENS, sessions: int = 1, outputs: int | None = None) -> float:
    """Median seconds of one pass in which each of `sessions` sessions feeds k tokens after its own
    cached prompt and reads the outputs of its last `outputs` (default all k: a verification; 1: a
    prefill or catch-up); the first pass, a warm-up, is not counted; the prompt is shortened where
    the model's context is smaller."""
    prompt_tokens = max(1, min(prompt_tokens, runtime.max_context - k - 1))
    held = [runtime.new_session() for _ in range(sessions)]
    for i, session in enumerate(held):
        runtime._forward([Feed(session, synthetic_tokens(prompt_tokens, runtime.vocab_size, offset=i), 1)])
    times = []
    for r in range(repeats + 1):
        feeds = [Feed(session, synthetic_tokens(k, runtime.vocab_size, offset=31 * (r + 1) + i), outputs or k)
                 for i, session in enumerate(held)]
        start = time.perf_counter()
        runtime._forward(feeds)
        times.append(time.perf_counter() - start)
        for session in held:
            runtime.rollback(session, prompt_tokens)
    return statistics.median(times[1:])


def forward_time_curve(runtime: Runtime, ks: Sequence[int] = DEFAULT_KS, repeats: int = DEFAULT_REPEATS,
                       prompt_tokens: int = PROMPT_TOKENS) -> dict[int, float]:
    """{k: median seconds per pass}; 0 for a model-free draft, which runs none."""
    if getattr(runtime, "model_free", False):
        return {k: 0.0 for k in ks}
    return {k: time_pass(runtime, k, repeats, prompt_tokens) for k in ks}
