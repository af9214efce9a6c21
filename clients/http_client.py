"""Clients of the OpenAI-compatible routes of `specdec serve` (services/openai_api.py), on httpx.

    with HttpClient("http://localhost:8000") as client:
        body = client.complete("def fib(n):", max_tokens=64, policy="fixed", k=4)
        print(body["choices"][0]["text"], body["specdec"]["acceptance_rate"])
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(chunk["choices"][0]["delta"].get("content", "") if chunk["choices"] else "", end="")

Body fields are OpenAI's (max_tokens, temperature, top_p, n, stop, seed, ...) plus the server's
extensions (policy, k, threshold, top_k), sent as given; None values are left out. Streams ask for
the final usage chunk, which carries the "specdec" stats, unless stream_options says otherwise.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from clients import ClientError, one_line

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 600.0  # a whole generation: hundreds of tokens on CPU take minutes
DONE = "[DONE]"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

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
    """An error status as ClientError("HTTP <status>", the server's one-line message)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = one_line(response.text) or response.reason_phrase
    return ClientError(f"HTTP {response.status_code}", message)


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
    """Blocking client; one connection pool per client (reuse it)."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def complete(self, prompt: str | Sequence[int], **fields: Any) -> dict:
        return self._send("POST", COMPLETIONS, request_body({"prompt": prompt, **fields}, stream=False))

    def chat(self, messages: Messages, **fields: Any) -> dict:
        return self._send("POST", CHAT, request_body({"messages": messages, **fields}, stream=False))

    def complete_stream(self, prompt: str | Sequence[int], **fields: Any) -> Iterator[dict]:
        return self._stream(COMPLETIONS, request_body({"prompt": prompt, **fields}, stream=True))

    def chat_stream(self, messages: Messages, **fields: Any) -> Iterator[dict]:
        return self._stream(CHAT, request_body({"messages": messages, **fields}, stream=True))

    def models(self) -> dict:
        return self._send("GET", "/v1/models")

    def health(self) -> dict:
        return self._send("GET", "/health")

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        with transport_errors(self.base_url):
            response = self._http.request(method, path, json=body)
        if response.is_error:
            raise response_error(response)
        return response.json()

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
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

    def __init__(self, base_url: str = DEFAULT_BASE_URL, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def complete(self, prompt: str | Sequence[int], **fields: Any) -> dict:
        return await self._send("POST", COMPLETIONS, request_body({"prompt": prompt, **fields}, stream=False))

    async def chat(self, messages: Messages, **fields: Any) -> dict:
        return await self._send("POST", CHAT, request_body({"messages": messages, **fields}, stream=False))

    def complete_stream(self, prompt: str | Sequence[int], **fields: Any) -> AsyncIterator[dict]:
        return self._stream(COMPLETIONS, request_body({"prompt": prompt, **fields}, stream=True))

    def chat_stream(self, messages: Messages, **fields: Any) -> AsyncIterator[dict]:
        return self._stream(CHAT, request_body({"messages": messages, **fields}, stream=True))

    async def models(self) -> dict:
        return await self._send("GET", "/v1/models")

    async def health(self) -> dict:
        return await self._send("GET", "/health")

    async def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        with transport_errors(self.base_url):
            response = await self._http.request(method, path, json=body)
        if response.is_error:
            raise response_error(response)
        return response.json()

    async def _stream(self, path: str, body: dict) -> AsyncIterator[dict]:
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
