"""Retries of calls that failed in a way that can succeed again, and streams resumed without
losing or repeating a token.

Retried: the server is at capacity (gRPC RESOURCE_EXHAUSTED, HTTP 429) or the replica serving the
request died (UNAVAILABLE, HTTP 503, an `unavailable_error` event or a stream cut short). A server
that cannot be reached at all, bad input and bugs are not retried.

A retried request is computed again from the start. Greedy requests give the same tokens again,
and seeded ones where their rounds repeat (the server derives every round's randomness from the
seed; under the cost-aware default or the suffix draft the rounds' lengths follow live measures:
docs/reliability.md), so a retried stream skips what was already delivered, checks that it
matches, and goes on, or fails with DATA_LOSS where it does not match. For that a sampled request
without a seed gets a random one from the client when retries are on: the same distribution as
the server's fresh seed, but fixed across attempts.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

from clients import ClientError
from specdec.errors import InvalidRequestError
from specdec.v1 import generation_pb2

SEED_BITS = 62  # fits the proto's int64 and OpenAI's seed
MAX_RETRY_AFTER_S = 60.0  # the longest wait a server's Retry-After may ask for


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2  # attempts after the first (0: never retry)
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self):
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise InvalidRequestError(f"retries must be a whole number >= 0, not {self.retries!r}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s < math.inf:
            raise InvalidRequestError("backoffs must be finite, 0 <= first_backoff_s <= max_backoff_s")

    def delay(self, attempt: int, retry_after_s: float | None = None) -> float:
        """The backoff, or the server's Retry-After where it asks for longer, up to
        MAX_RETRY_AFTER_S (longer, negative or not a number: the backoff; the openai package too
        ignores a Retry-After past a minute)."""
        backoff = min(self.first_backoff_s * 2.0 ** min(attempt, 64), self.max_backoff_s)
        if retry_after_s is not None and 0 < retry_after_s <= MAX_RETRY_AFTER_S:
            return max(backoff, retry_after_s)
        return backoff


def retry_policy(retries: int | RetryPolicy | None) -> RetryPolicy:
    if isinstance(retries, RetryPolicy):
        return retries
    return RetryPolicy() if retries is None else RetryPolicy(retries=retries)


def pinned_seed(fields: dict[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """`fields` with a seed when the request samples without one and may be retried."""
    if policy.retries and fields.get("temperature") and fields.get("seed") is None:
        return fields | {"seed": secrets.randbits(SEED_BITS)}
    return fields


def diverged() -> ClientError:
    return ClientError("DATA_LOSS", "the retried stream differs from the part already delivered")


class ChunkReplay:
    """What a gRPC stream has delivered per sample (token ids, characters of text, finish); on a
    retried attempt, `fresh` returns only the part of each chunk not delivered yet (None: nothing)."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.chars: dict[int, int] = {}
        self.finished: set[int] = set()
        self.done = False  # the stats chunk, the last of a complete attempt, was delivered
        self.restart()

    def restart(self) -> None:
        self._seen_tokens: dict[int, int] = {}
        self._seen_chars: dict[int, int] = {}

    def fresh(self, chunk: generation_pb2.GenerateChunk) -> generation_pb2.GenerateChunk | None:
        if chunk.HasField("stats"):  # once: an attempt cut after it delivered its stats is not counted twice
            fresh, self.done = not self.done, True
            return chunk if fresh else None
        index, ids = chunk.index, list(chunk.token_ids)
        delivered, position = self.tokens.setdefault(index, []), self._seen_tokens.get(index, 0)
        overlap = max(0, min(len(ids), len(delivered) - position))
        if ids[:overlap] != delivered[position:position + overlap]:
            raise diverged()
        self._seen_tokens[index] = position + len(ids)
        text_position, have = self._seen_chars.get(index, 0), self.chars.get(index, 0)
        skip = max(0, min(len(chunk.text), have - text_position))
        self._seen_chars[index] = text_position + len(chunk.text)
        new_ids, new_text = ids[overlap:], chunk.text[skip:]
        finish = "" if index in self.finished else chunk.finish_reason
        if not new_ids and not new_text and not finish:
            return None
        delivered.extend(new_ids)
        self.chars[index] = have + len(new_text)
        if finish:
            self.finished.add(index)
        out = generation_pb2.GenerateChunk()
        out.CopyFrom(chunk)
        del out.token_ids[:]
        out.token_ids.extend(new_ids)
        out.text, out.finish_reason = new_text, finish
        return out


class EventReplay:
    """The same for OpenAI stream chunks (text only: `text`, or a chat `delta`'s content): a
    retried attempt's text is checked against what was delivered, as far as it overlaps."""

    def __init__(self):
        self.texts: dict[int, list[str]] = {}  # the text delivered per sample, in its chunks
        self.finished: set[int] = set()
        self.started: set[int] = set()
        self.done = False  # the usage chunk, the last of a complete attempt, was delivered
        self.restart()

    def restart(self) -> None:
        self._seen: dict[int, int] = {}
        self._delivered = {index: "".join(parts) for index, parts in self.texts.items()}

    def fresh(self, event: dict) -> dict | None:
        if not event.get("choices"):  # the usage chunk: once (an attempt cut after it is not counted twice)
            fresh, self.done = not self.done, True
            return event if fresh else None
        choices = [c for c in (self._fresh_choice(choice) for choice in event["choices"]) if c is not None]
        return event | {"choices": choices} if choices else None

    def _fresh_choice(self, choice: dict) -> dict | None:
        index, chat = choice["index"], "delta" in choice
        text = (choice["delta"].get("content") if chat else choice.get("text")) or ""
        position, delivered = self._seen.get(index, 0), self._delivered.get(index, "")
        skip = max(0, min(len(text), len(delivered) - position))
        if text[:skip] != delivered[position:position + skip]:
            raise diverged()
        self._seen[index] = position + len(text)
        new_text = text[skip:]
        finish = None if index in self.finished else choice.get("finish_reason")
        first = index not in self.started
        if not new_text and not finish and not first:
            return None
        self.texts.setdefault(index, []).append(new_text)
        self.started.add(index)
        if finish:
            self.finished.add(index)
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": new_text} if new_text or first else {})
            return choice | {"delta": delta, "finish_reason": finish}
        return choice | {"text": new_text, "finish_reason": finish}
