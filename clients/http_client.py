"""Clients of the OpenAI-compatible routes of `specdec serve` (services/openai_api.py), on httpx.

    with HttpClient("http://localhost:8000") as client:
        body = client.complete("def fib(n):", max_tokens=64, policy="fixed", k=4)
        print(body["choices"][0]["text"], body["specdec"]["acceptance_rate"])
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(chunk["choices"][0]["delta"].get("content", "") if chunk["choices"] else "", end="")

Body fields are OpenAI's (max_tokens, temperature, top_p, n, stop, seed, ...) plus the server's
extensions (policy, k, threshold, top_k), sent as given; None values are left out. Streams ask for
the final usage chunk, which carries the "specdec" stats, unless stream_options says otherwise.
`api_key` (default: the SPECDEC_API_KEY environment variable) goes as `Authorization: Bearer`.
Calls that failed retriably (429, 503, a stream cut short) are retried (clients/retry.py); a
retried stream resumes where it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, closing, contextmanager
from typing import Any

import httpx

from clients import ClientError, one_line
from clients.retry import EventReplay, RetryPolicy, pinned_seed, retry_policy

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 600.0  # a whole generation: hundreds of tokens on CPU take minutes
DONE = "[DONE]"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
API_KEY_ENV = "SPECDEC_API_KEY"
# At capacity (429), the serving replica died (503, or that error in a stream), a stream cut short.
RETRIABLE = frozenset({"HTTP 429", "HTTP 503", "overloaded_error", "unavailable_error", "TRANSPORT"})

Messages = Sequence[Mapping[str, Any]]


def request_body(fields: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    body = {key: value for key, value in fields.items() if value is not None}
    if stream:
        return {"stream_options": {"include_usage": True}} | body | {"stream": True}
    return body | {"stream": False}


def parse_sse_line(line: str) -> dict | str | None:
    """One line of an event stream: a chunk, DONE, or None (blank lines, comments, other fields).
    An error event raises ClientError."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == DONE:
        return DONE
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        raise ClientError(error.get("type") or "stream error", one_line(error.get("message") or "the stream failed"))
    return event


def response_error(response: httpx.Response) -> ClientError:
    """An error status as ClientError("HTTP <status>", the server's one-line message); the
    Retry-After header, if any, as `retry_after_s`."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = one_line(response.text) or response.reason_phrase
    try:
        retry_after_s = float(response.headers.get("retry-after", ""))
    except ValueError:
        retry_after_s = None
    return ClientError(f"HTTP {response.status_code}", message, retry_after_s)


def headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"Authorization": f"Bearer {key}"} if key else {}


def retry_delay(policy: RetryPolicy, error: ClientError, attempt: int) -> float | None:
    """Seconds to wait before the next attempt, or None to give up."""
    if attempt >= policy.retries or error.code not in RETRIABLE:
        return None
    return policy.delay(attempt, error.retry_after_s)


@contextmanager
def transport_errors(base_url: str) -> Iterator[None]:
    try:
        yield
    except httpx.ConnectError:
        raise ClientError("UNAVAILABLE", f"cannot reach {base_url}: is `specdec serve` running?") from None
    except httpx.TimeoutException:
        raise ClientError("TIMEOUT", f"{base_url} did not answer in time") from None
    except httpx.HTTPError as exc:
        raise ClientError("TRANSPORT", one_line(str(exc)) or type(exc).__name__) from None


def stream_cut_short(base_url: str) -> ClientError:
    return ClientError("TRANSPORT", f"the stream from {base_url} ended before [DONE]")


class HttpClient:
    """Blocking client; one connection pool per client (reuse it). `retries`: attempts after the
    first for retriable failures (None: 2)."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, retries: int | RetryPolicy | None = None):
        self.base_url = base_url.rstrip("/")
        self.retry = retry_policy(retries)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers(api_key))

    def complete(self, prompt: str | Sequence[int], **fields: Any) -> dict:
        return self._send("POST", COMPLETIONS, self._body({"prompt": prompt, **fields}, stream=False))

    def chat(self, messages: Messages, **fields: Any) -> dict:
        return self._send("POST", CHAT, self._body({"messages": messages, **fields}, stream=False))

    def complete_stream(self, prompt: str | Sequence[int], **fields: Any) -> Iterator[dict]:
        return self._stream(COMPLETIONS, self._body({"prompt": prompt, **fields}, stream=True))

    def chat_stream(self, messages: Messages, **fields: Any) -> Iterator[dict]:
        return self._stream(CHAT, self._body({"messages": messages, **fields}, stream=True))

    def models(self) -> dict:
        return self._send("GET", "/v1/models")

    def health(self) -> dict:
        return self._send("GET", "/health")

    def _body(self, fields: dict[str, Any], stream: bool) -> dict[str, Any]:
        return request_body(pinned_seed(fields, self.retry), stream)

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        for attempt in range(self.retry.retries + 1):
            with transport_errors(self.base_url):
                response = self._http.request(method, path, json=body)
            if not response.is_error:
                return response.json()
            error = response_error(response)
            if (delay := retry_delay(self.retry, error, attempt)) is None:
                raise error
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        replay = EventReplay()
        for attempt in range(self.retry.retries + 1):
            replay.restart()
            try:
                with closing(self._attempt(path, body)) as events:
                    for event in events:
                        if (fresh := replay.fresh(event)) is not None:
                            yield fresh
                return
            except ClientError as error:
                if (delay := retry_delay(self.retry, error, attempt)) is None:
                    raise
            time.sleep(delay)

    def _attempt(self, path: str, body: dict) -> Iterator[dict]:
        with transport_errors(self.base_url), self._http.stream("POST", path, json=body) as response:
            if response.is_error:
                response.read()
                raise response_error(response)
            for line in response.iter_lines():
                if (event := parse_sse_line(line)) == DONE:
                    return
                if event is not None:
                    yield event
        raise stream_cut_short(self.base_url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class AsyncHttpClient:
    """asyncio twin of HttpClient."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, retries: int | RetryPolicy | None = None):
        self.base_url = base_url.rstrip("/")
        self.retry = retry_policy(retries)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=headers(api_key))

    async def complete(self, prompt: str | Sequence[int], **fields: Any) -> dict:
        return await self._send("POST", COMPLETIONS, self._body({"prompt": prompt, **fields}, stream=False))

    async def chat(self, messages: Messages, **fields: Any) -> dict:
        return await self._send("POST", CHAT, self._body({"messages": messages, **fields}, stream=False))

    def complete_stream(self, prompt: str | Sequence[int], **fields: Any) -> AsyncIterator[dict]:
        return self._stream(COMPLETIONS, self._body({"prompt": prompt, **fields}, stream=True))

    def chat_stream(self, messages: Messages, **fields: Any) -> AsyncIterator[dict]:
        return self._stream(CHAT, self._body({"messages": messages, **fields}, stream=True))

    async def models(self) -> dict:
        return await self._send("GET", "/v1/models")

    async def health(self) -> dict:
        return await self._send("GET", "/health")

    def _body(self, fields: dict[str, Any], stream: bool) -> dict[str, Any]:
        return request_body(pinned_seed(fields, self.retry), stream)

    async def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        for attempt in range(self.retry.retries + 1):
            with transport_errors(self.base_url):
                response = await self._http.request(method, path, json=body)
            if not response.is_error:
                return response.json()
            error = response_error(response)
            if (delay := retry_delay(self.retry, error, attempt)) is None:
                raise error
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        replay = EventReplay()
        for attempt in range(self.retry.retries + 1):
            replay.restart()
            try:
                async with aclosing(self._attempt(path, body)) as events:
                    async for event in events:
                        if (fresh := replay.fresh(event)) is not None:
                            yield fresh
                return
            except ClientError as error:
                if (delay := retry_delay(self.retry, error, attempt)) is None:
                    raise
            await asyncio.sleep(delay)

    async def _attempt(self, path: str, body: dict) -> AsyncIterator[dict]:
        with transport_errors(self.base_url):
            async with self._http.stream("POST", path, json=body) as response:
                if response.is_error:
                    await response.aread()
                    raise response_error(response)
                async for line in response.aiter_lines():
                    if (event := parse_sse_line(line)) == DONE:
                        return
                    if event is not None:
                        yield event
        raise stream_cut_short(self.base_url)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncHttpClient:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()
