"""OpenAI-compatible HTTP routes over any GenerationBackend. No Ray here: services/ingress.py mounts
this app on the Serve ingress, the tests mount it on the in-process engine.

    POST /v1/completions, /v1/chat/completions   (stream=true: server-sent events, `data: [DONE]` last)
    GET  /v1/models, /v1/models/{model}, /health, /metrics

Where this differs from OpenAI's API, on purpose:
- temperature unset = 0 (greedy), as `specdec generate` (OpenAI's default is 1); max_tokens unset = 128;
- extension fields in the body, as vLLM's `extra_body`: policy, k, threshold, top_k (-1 or 0 = off),
  draft (which of the server's drafts: GenerateRequest.draft), suffix_cache (the suffix draft also
  reads the earlier responses of the server's API key: GenerateRequest.suffix_cache); the
  speculative ones also grouped as `speculative: {draft, policy, k, threshold, suffix_cache}` (e.g.
  `{"draft": "suffix"}` on a server with the suffix draft), the same field twice with two values refused;
- stream_options without stream is refused (400), as OpenAI and vLLM do; a flag sent as null is false;
- fields that would change the output and that we cannot honour (echo, logprobs, suffix, logit_bias,
  presence/frequency penalties, best_of != n), and unknown fields, are refused with 400, never ignored;
- every result carries "specdec": the request's Stats (protos/specdec/v1/generation.proto), on the
  response, or on the usage chunk of a stream with stream_options.include_usage.
Errors are OpenAI's JSON: {"error": {"message": one line, "type", "param", "code"}}: 400 bad
parameters, 401 missing key, 404 unknown model, 413 body too large, 415 not JSON, 429 at capacity
(Retry-After), 503 the replica serving the request died (retriable), 500 a bug ("internal error").
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from google.protobuf import json_format
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError, PydanticKnownError
from starlette.authentication import AuthenticationBackend, AuthenticationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.authentication import AuthenticationMiddleware

from specdec.errors import one_line
from specdec.params import few_stops
from specdec.sampling import MAX_SAMPLES_PER_REQUEST
from specdec.v1 import generation_pb2
from services.auth import MISSING_KEY, key_matches
from services.errors import TABLE, Unauthenticated, describe, retry_after

__all__ = ["GenerationBackend", "create_app"]

logger = logging.getLogger(__name__)

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # the proto fields' ranges: larger values cannot be sent on
# Accepted only at their neutral value (None, false, 0, "" or {}): anything else asks for output we do not produce.
NEUTRAL_ONLY = ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "presence_penalty", "frequency_penalty")


class GenerationBackend(Protocol):
    """Raises InvalidRequestError (one line) for bad parameters, possibly only when the stream is first
    iterated, Overloaded when it cannot take more work, Unavailable when the work was lost."""

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse: ...

    def generate_stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateChunk]: ...


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# ------------------------------------------------------------------------------------------------
# Requests

def unicode_text(value: str) -> str:
    """A string that reaches the wire as UTF-8: JSON can escape a lone UTF-16 surrogate ("\\ud800"),
    which has no UTF-8 form."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("unicode", "must be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return value


def non_empty(value: str) -> str:
    """GenerationParams' own reason for an empty string, refused here in this layer's form (`stop[0]`, with
    its param). (Not min_length: a constrained string's lone surrogate gets pydantic's reason, above.)"""
    if not value:
        raise PydanticKnownError("string_too_short", {"min_length": 1})
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
# A stop string: GenerationParams' domain ("" would stop before the first token; `few_stops` of them).
StopText = Annotated[Text, AfterValidator(non_empty)]
# A policy's or a draft's name: "" names none. (A string with constraints is checked as Unicode by
# pydantic itself: "Input should be a valid string, unable to parse raw data as a unicode string".)
Name = Annotated[str, Field(min_length=1)]
# A flag sent as null is its default (OpenAI's schema takes `boolean | null`; clients send every field).
Flag = Annotated[bool, Field(strict=True), BeforeValidator(lambda value: False if value is None else value)]


def single_prompt(value: Any) -> Any:
    """One request is one prompt: "text", [token ids], or a batch of exactly one of those."""
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if len(value) > 1:
            raise PydanticCustomError("batch", "batched prompts are not supported: send one prompt per request")
        value = value[0]
    if isinstance(value, str):
        return unicode_text(value)
    if isinstance(value, list) and all(type(v) is int for v in value):
        if not all(0 <= v <= INT32_MAX for v in value):  # (the vocabulary's bound is checked where it is known)
            raise PydanticCustomError("prompt", f"token ids must be in [0, {INT32_MAX}]")
        return value
    raise PydanticCustomError("prompt", "must be a string or a list of token ids")


def text_content(value: Any) -> Any:
    """OpenAI's content parts: text parts are joined by newlines (as vLLM does); others are refused."""
    if value is None:
        return ""
    if isinstance(value, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise PydanticCustomError("content", "only text content parts are supported")
        return "\n".join(p["text"] for p in value)
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Flag = False


class GenerationFields(BaseModel):
    """What both routes take: OpenAI's sampling fields and our extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, strict=True)  # unset = 128
    temperature: float | None = Field(None, ge=0, strict=True, allow_inf_nan=False)  # unset = 0, greedy
    top_p: float | None = Field(None, gt=0, le=1, strict=True, allow_inf_nan=False)
    n: int | None = Field(None, ge=1, le=MAX_SAMPLES_PER_REQUEST, strict=True)
    stop: Annotated[Annotated[list[StopText], AfterValidator(few_stops)] | None,
                    BeforeValidator(lambda value: [value] if isinstance(value, str) else value)] = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX, strict=True)
    stream: Flag = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM-style extra_body)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, strict=True)  # -1 or 0 = off (SamplingParams)
    policy: Name | None = None
    k: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX, strict=True)
    threshold: float | None = Field(None, strict=True)
    draft: Name | None = None
    suffix_cache: bool | None = Field(None, strict=True)
    speculative: SpeculativeOptions | None = None


class SpeculativeOptions(BaseModel):
    """The request's speculation, grouped (`speculative`): the same as the flat extension fields."""

    model_config = ConfigDict(extra="forbid")

    draft: Name | None = None
    policy: Name | None = None
    k: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX, strict=True)
    threshold: float | None = Field(None, strict=True)
    suffix_cache: bool | None = Field(None, strict=True)


SPECULATIVE_FIELDS = tuple(SpeculativeOptions.model_fields)


class CompletionRequest(GenerationFields):
    prompt: Annotated[str | list[int], BeforeValidator(single_prompt)]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send back assistant messages with refusal, tool_calls...

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, BeforeValidator(text_content), AfterValidator(unicode_text)] = ""


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, strict=True)
    logprobs: bool | None = None
    top_logprobs: int | None = None


def check_supported(body: GenerationFields) -> None:
    for name in NEUTRAL_ONLY:
        value = getattr(body, name, None)
        # (a completion's `logprobs: 0` still asks for the sampled tokens' log-probabilities)
        if value or (name == "logprobs" and isinstance(body, CompletionRequest) and value is not None):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        raise ApiError(400, "best_of is not supported by this server (only best_of = n)", param="best_of")


def generate_request(body: GenerationFields, max_tokens: int | None, request_id: str) -> generation_pb2.GenerateRequest:
    """The fields both routes share; unset stays unset (the server's default)."""
    check_supported(body)
    fields = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "n": body.n,
              "seed": body.seed, "top_k": body.top_k}
    for name in SPECULATIVE_FIELDS:  # flat, or grouped under `speculative`
        flat, grouped = getattr(body, name), getattr(body.speculative, name, None)
        if flat is not None and grouped is not None and flat != grouped:
            raise ApiError(400, f"{name} and speculative.{name} disagree: give one", param="speculative")
        fields[name] = flat if flat is not None else grouped
    return generation_pb2.GenerateRequest(stop=body.stop or [], request_id=request_id,
                                          **{key: value for key, value in fields.items() if value is not None})


def completion_to_proto(body: CompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """Completions never apply the chat template (as OpenAI's legacy route: the prompt is raw text)."""
    request = generate_request(body, body.max_tokens, request_id)
    if isinstance(body.prompt, str):
        request.text, request.chat_template = body.prompt, False
    else:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(body.prompt)
    return request


def chat_to_proto(body: ChatRequest, request_id: str) -> generation_pb2.GenerateRequest:
    request = generate_request(body, body.max_completion_tokens or body.max_tokens, request_id)
    request.messages.messages.extend(generation_pb2.ChatMessage(role=m.role, content=m.content) for m in body.messages)
    return request


# ------------------------------------------------------------------------------------------------
# Responses

def stats_dict(stats: generation_pb2.Stats) -> dict:
    return json_format.MessageToDict(stats, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True, unquote_int64_if_possible=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, text: str, finish_reason: str | None, chat: bool) -> dict:
    body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": index, **body, "finish_reason": finish_reason or None, "logprobs": None}


def stream_choice(chunk: generation_pb2.GenerateChunk, chat: bool, first: bool) -> dict:
    """A chat sample's first delta names the role."""
    if not chat:
        return choice(chunk.index, chunk.text, chunk.finish_reason, chat=False)
    delta = ({"role": "assistant"} if first else {}) | ({"content": chunk.text} if chunk.text or first else {})
    return {"index": chunk.index, "delta": delta, "finish_reason": chunk.finish_reason or None, "logprobs": None}


def response_json(response: generation_pb2.GenerateResponse, head: dict, chat: bool) -> dict:
    choices = [choice(c.index, c.text, c.finish_reason, chat) for c in response.completions]
    completion_tokens = sum(len(c.token_ids) for c in response.completions)
    return head | {"choices": choices, "usage": usage(response.prompt_tokens, completion_tokens),
                   "specdec": stats_dict(response.stats)}


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


async def sse_events(first: generation_pb2.GenerateChunk | None, chunks: AsyncIterator[generation_pb2.GenerateChunk],
                     head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The backend's chunks as OpenAI stream chunks; a failure after the headers went out becomes one
    error event, and the stream ends without [DONE]."""
    null_usage = {"usage": None} if include_usage else {}
    started: set[int] = set()
    completion_tokens, last = 0, None
    try:
        chunk = first
        while chunk is not None:
            completion_tokens += len(chunk.token_ids)
            if chunk.text or chunk.finish_reason:
                yield sse(head | {"choices": [stream_choice(chunk, chat, chunk.index not in started)]} | null_usage)
                started.add(chunk.index)
            if chunk.HasField("stats"):
                last = chunk
            chunk = await anext(chunks, None)
        if include_usage:
            final = last or generation_pb2.GenerateChunk()
            yield sse(head | {"choices": [], "usage": usage(final.prompt_tokens, completion_tokens),
                              "specdec": stats_dict(final.stats)})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
        yield sse(error_of(exc)[1])
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()  # a client that went away cancels its generation


# ------------------------------------------------------------------------------------------------
# Errors

def error_json(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_of(exc: Exception) -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) for any exception (services/errors.py's table); bugs are logged
    there and never described to the client."""
    if isinstance(exc, ApiError):
        return exc.status, error_json(one_line(exc.message), param=exc.param, code=exc.code), {}
    status, reason = describe(exc)
    wait = retry_after(exc)
    return status.http, error_json(reason, status.kind), {} if wait is None else {"Retry-After": str(wait)}


def error_response(exc: Exception) -> JSONResponse:
    status, body, headers = error_of(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first error as one line: `temperature: Input should be greater than or equal to 0`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    loc = [part for part in error["loc"] if part != "body"]
    # a key the client sent (logit_bias's) may hold a newline: quoted, it stays on the line
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if str(p).isprintable() else f"[{json.dumps(str(p))}]"
                    for p in loc).lstrip(".")
    param = str(loc[0]) if loc else None
    return ApiError(400, f"{where or 'body'}: {one_line(error['msg'])}", param=param)


def is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# ------------------------------------------------------------------------------------------------
# Access

class ApiKeyBackend(AuthenticationBackend):
    """`Authorization: Bearer <key>` on every request. Starlette's AuthenticationMiddleware rather
    than a FastAPI dependency: dependencies run after routing and after the body is read and
    parsed, so a client without the key would still get 404/400/413 answers (and make us read its
    body); the middleware refuses before any of that, on every path."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def authenticate(self, conn):
        if not key_matches(self.api_key, conn.headers.get("authorization")):
            raise AuthenticationError(MISSING_KEY)
        return None


def unauthorized(_conn, exc: AuthenticationError) -> Response:
    status = TABLE[Unauthenticated]
    return JSONResponse(error_json(str(exc), status.kind, code="invalid_api_key"), status_code=status.http,
                        headers={"WWW-Authenticate": "Bearer"})


def body_too_large(max_body_bytes: int) -> JSONResponse:
    return JSONResponse(error_json(f"the request body is larger than {max_body_bytes} bytes"), status_code=413)


class BodyLimit:
    """413 for a body over the limit: at once when its Content-Length says so, else as soon as the
    bytes read pass it (the route's body reading re-raises the HTTPException, which becomes our
    error JSON). Not FastAPI's max_body_size: for a declared length it answers in plain text, which
    OpenAI clients cannot read."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await body_too_large(self.max_body_bytes)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise StarletteHTTPException(413)
            return message

        return await self.app(scope, limited_receive, send)


# ------------------------------------------------------------------------------------------------
# The app

def create_app(backend_factory: Callable[[], GenerationBackend], model_name: str,
               metrics_text: Callable[[], Awaitable[str]] | None = None, api_key: str | None = None,
               max_body_bytes: int | None = None, readiness: Callable[[], Awaitable[None]] | None = None
               ) -> FastAPI:
    """`backend_factory` is called once, on the first request that needs it (inside a Serve replica
    it looks up a deployment handle, which needs the running replica). With `api_key` every path
    (the OpenAPI docs, /health and /metrics included) answers 401 without it; `max_body_bytes` caps
    request bodies (413). `readiness` raises specdec.errors' Unavailable, with why, where a request
    could not be served now (/health then answers 503; None: the process answering is enough)."""
    app = FastAPI(title="specdec")
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    if api_key:  # added last: runs first
        app.add_middleware(AuthenticationMiddleware, backend=ApiKeyBackend(api_key), on_error=unauthorized)
    backend = functools.cache(backend_factory)
    created = int(time.time())

    async def respond(work: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return error_response(exc)

    def check_model(name: str) -> None:
        if name != model_name:
            shown = name.encode("unicode_escape").decode()  # one line whatever the client sent
            raise ApiError(404, f"The model `{shown}` does not exist.", param="model", code="model_not_found")

    async def generate(body: GenerationFields, request: generation_pb2.GenerateRequest, chat: bool) -> Response:
        if body.model is not None:
            check_model(body.model)
        def head(request_id: str, object_: str) -> dict:
            return {"id": ("chatcmpl-" if chat else "cmpl-") + request_id, "object": object_,
                    "created": int(time.time()), "model": model_name}

        if not body.stream:
            response = await backend().generate(request)
            object_ = "chat.completion" if chat else "text_completion"
            return JSONResponse(response_json(response, head(response.request_id or request.request_id, object_), chat))
        chunks = aiter(backend().generate_stream(request))
        first = await anext(chunks, None)  # a bad request fails here, while a status can still say so
        object_ = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse_events(first, chunks, head((first and first.request_id) or request.request_id, object_),
                            chat, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await respond(lambda: generate(body, completion_to_proto(body, uuid.uuid4().hex), chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> Response:
        return await respond(lambda: generate(body, chat_to_proto(body, uuid.uuid4().hex), chat=True))

    model = {"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/v1/models/{name:path}")  # (`path`: a model's name may hold a slash, e.g. org/model)
    async def retrieve_model(name: str) -> Response:
        async def found() -> Response:
            check_model(name)
            return JSONResponse(model)
        return await respond(found)

    @app.get("/health")
    async def health() -> Response:
        async def ready() -> Response:
            if readiness is not None:
                await readiness()
            return JSONResponse({"status": "ok"})
        return await respond(ready)

    @app.get("/metrics")
    async def metrics() -> Response:
        async def text() -> Response:
            if metrics_text is None:
                raise ApiError(404, "metrics are not exported by this server")
            return PlainTextResponse(await metrics_text(), media_type="text/plain; version=0.0.4")
        return await respond(text)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> Response:
        if request.method == "POST" and not is_json(request.headers.get("content-type")):
            return error_response(ApiError(415, "the request body must be JSON (Content-Type: application/json)"))
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413 and max_body_bytes is not None:
            return body_too_large(max_body_bytes)
        message = one_line(str(exc.detail))
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            message = "the request body is not valid JSON (UTF-8)"
            if isinstance(exc.__cause__, RecursionError):  # (Python's JSON parser stops at its recursion limit)
                message = "the request body's JSON is nested too deeply to parse"
        return JSONResponse(error_json(message), status_code=exc.status_code, headers=exc.headers)

    return app
