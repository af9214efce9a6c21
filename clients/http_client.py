"""Clients of the OpenAI-compatible routes of `specdec serve` (services/openai_api.py), on httpx.

    with HttpClient("http://localhost:8000") as client:
        body = client.complete("def fib(n):", max_tokens=64, policy="fixed", k=4)
        print(body["choices"][0]["text"], body["specdec"]["acceptance_rate"])
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1):
            print(chunk["choices"][0]["delta"].get("content", "") if chunk["choices"] else "", end="")

Body fields are OpenAI's (max_tokens, temperature, top_p, n, stop, seed, ...) plus the server's
extensions (policy, k, threshold, top_k), sent as given; None values are left out. Streams ask for
the final usage chunk, which carries the "specdec" stats, unless stream_options says otherwise.
`base_url` is the server's root (an OpenAI-style base URL ending in /v1 works too). `api_key`
(default: the SPECDEC_API_KEY environment variable) goes as `Authorization: Bearer`.
Calls that failed retriably (429, 503, a stream cut short) are retried (clients/retry.py); a
retried stream resumes where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, closing, contextmanager
from typing import Any

import httpx

from clients import ClientError, one_line, resolve_api_key, time_limit
from clients.retry import EventReplay, RetryPolicy, pinned_seed, retry_policy
from specdec.errors import InvalidRequestError

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT_S = 600.0  # a whole generation: hundreds of tokens on CPU take minutes
DONE = "[DONE]"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# At capacity (429), the serving replica died (503, or that error in a stream), a stream cut short.
JSON_BODY = {"Content-Type": "application/json"}
RETRIABLE = frozenset({"HTTP 429", "HTTP 503", "overloaded_error", "unavailable_error", "TRANSPORT"})

Messages = Sequence[Mapping[str, Any]]


def request_body(fields: Mapping[str, Any], stream: bool) -> bytes:
    """The JSON body; a value JSON cannot carry (NaN, bytes, a lone surrogate) is refused here."""
    body = {key: value for key, value in fields.items() if value is not None}
    if stream:
        body = {"stream_options": {"include_usage": True}} | body | {"stream": True}
    else:
        body |= {"stream": False}
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, TypeError) as exc:  # (UnicodeEncodeError is a ValueError)
        raise InvalidRequestError(f"the request cannot be sent: {one_line(str(exc))}") from None


def json_of(text: str | bytes) -> Any:
    """A JSON answer; anything else is not `specdec serve` speaking (a proxy's page, another server)."""
    try:
        return json.loads(text)
    except ValueError:
        raise ClientError("BAD_RESPONSE", f"the server's answer is not JSON: {one_line(text[:200])!r}") from None


class EventLines:
    """An event stream's lines to its events: an event counts at the blank line that ends it (SSE's
    rule), so a stream cut inside one drops it and reads as cut short, not as a malformed answer."""

    def __init__(self):
        self._data: str | None = None

    def feed(self, line: str) -> dict | str | None:
        """A chunk or DONE where `line` ends an event, else None (comments, other fields)."""
        if line.startswith("data:"):
            self._data = line
        elif not line and self._data is not None:
            data, self._data = self._data, None
            return parse_sse_line(data)
        return None


def parse_sse_line(line: str) -> dict | str | None:
    """One line of an event stream: a chunk, DONE, or None (blank lines, comments, other fields).
    An error event raises ClientError."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == DONE:
        return DONE
    event = json_of(data)
    if "error" in event:
        error = event["error"]
        raise ClientError(error.get("type") or "stream error", one_line(error.get("message") or "the stream failed"))
    return event


def response_error(response: httpx.Response) -> ClientError:
    """An error status as ClientError("HTTP <status>", the server's one-line message); the
    Retry-After header, if any, as `retry_after_s`."""
    lost = False
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not our error body (a proxy's page, a wrong path)
        message = f"{response.status_code} {response.reason_phrase} at {response.url}"
        lost = response.status_code == 500  # Serve's proxy: the ingress replica died under the call
    return ClientError(f"HTTP {response.status_code}", message, retry_after(response.headers.get("retry-after")),
                       lost=lost)


def retry_after(value: str | None) -> float | None:
    """Retry-After's seconds: a number, or an HTTP date (RFC 9110); None where it is neither."""
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # (an HTTP date is GMT)
        when = when.replace(tzinfo=datetime.timezone.utc)
    return (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


def connection(base_url: str, timeout_s: float | None, key: str | None) -> dict[str, Any]:
    """httpx client arguments: the server's root URL checked, the time limit and the key's header."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise InvalidRequestError(f"{ascii(base_url)} is not a URL: {one_line(str(exc))}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidRequestError(f"{ascii(base_url)} is not an http:// or https:// URL (e.g. {DEFAULT_BASE_URL})")
    if url.port is not None and not 0 < url.port < 65536:
        raise InvalidRequestError(f"{ascii(base_url)}: port {url.port} is not a port")
    key = resolve_api_key(key)
    return {"base_url": base_url, "timeout": time_limit(timeout_s),
            "headers": {"Authorization": f"Bearer {key}"} if key else {}}


def retry_delay(policy: RetryPolicy, error: ClientError, attempt: int) -> float | None:
    """Seconds to wait before the next attempt, or None to give up."""
    if attempt >= policy.retries or not (error.code in RETRIABLE or error.lost):
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
        self.retry = retry_policy(retries)
        self._http = httpx.Client(**connection(base_url, timeout_s, api_key))
        self.base_url = str(self._http.base_url).rstrip("/")

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

    def _body(self, fields: dict[str, Any], stream: bool) -> bytes:
        return request_body(pinned_seed(fields, self.retry), stream)

    def _send(self, method: str, path: str, body: bytes | None = None) -> dict:
        for attempt in range(self.retry.retries + 1):
            try:
                with transport_errors(self.base_url):
                    response = self._http.request(method, path, content=body, headers=JSON_BODY if body else None)
                if not response.is_error:
                    return json_of(response.text)
                raise response_error(response)
            except ClientError as error:  # (a connection dropped under the call: TRANSPORT, as a stream's)
                if (delay := retry_delay(self.retry, error, attempt)) is None:
                    raise
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _stream(self, path: str, body: bytes) -> Iterator[dict]:
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

    def _attempt(self, path: str, body: bytes) -> Iterator[dict]:
        with transport_errors(self.base_url), self._http.stream("POST", path, content=body, headers=JSON_BODY) as response:
            if response.is_error:
                response.read()
                raise response_error(response)
            lines = EventLines()
            for line in response.iter_lines():
                if (event := lines.feed(line)) == DONE:
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
        self.retry = retry_policy(retries)
        self._http = httpx.AsyncClient(**connection(base_url, timeout_s, api_key))
        self.base_url = str(self._http.base_url).rstrip("/")

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

    def _body(self, fields: dict[str, Any], stream: bool) -> bytes:
        return request_body(pinned_seed(fields, self.retry), stream)

    async def _send(self, method: str, path: str, body: bytes | None = None) -> dict:
        for attempt in range(self.retry.retries + 1):
            try:
                with transport_errors(self.base_url):
                    response = await self._http.request(method, path, content=body,
                                                        headers=JSON_BODY if body else None)
                if not response.is_error:
                    return json_of(response.text)
                raise response_error(response)
            except ClientError as error:
                if (delay := retry_delay(self.retry, error, attempt)) is None:
                    raise
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _stream(self, path: str, body: bytes) -> AsyncIterator[dict]:
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

    async def _attempt(self, path: str, body: bytes) -> AsyncIterator[dict]:
        with transport_errors(self.base_url):
            async with self._http.stream("POST", path, content=body, headers=JSON_BODY) as response:
                if response.is_error:
                    await response.aread()
                    raise response_error(response)
                lines = EventLines()
                async for line in response.aiter_lines():
                    if (event := lines.feed(line)) == DONE:
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
