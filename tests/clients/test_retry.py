"""Client retries against real gRPC and HTTP servers over the in-process engine (tiny models) whose
first attempt fails the way a dying replica or a full queue makes it fail: the retried call gives
the engine's output, and a retried stream delivers every token once."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest

from clients import ClientError
from clients.grpc_client import AsyncGrpcClient, GrpcClient
from clients.http_client import HttpClient
from clients.retry import ChunkReplay, EventReplay, RetryPolicy, pinned_seed
from services.openai_api import create_app
from specdec.errors import InvalidRequestError, Overloaded, Unavailable
from specdec.params import build_params
from specdec.v1 import generation_pb2
from engine_backend import EngineBackend, GenerationServicer, grpc_server, http_server

PROMPT = "def fibonacci(n):"
FAST = RetryPolicy(retries=3, first_backoff_s=0.01, max_backoff_s=0.05)
FIELDS = {"policy": "fixed", "k": 2, "max_new_tokens": 40}
CLIENT_SEED = 1234  # a sampled stream of FIELDS from the tiny pair that runs past `after` chunks


class FlakyBackend:
    """The engine, but the first `failures` calls fail with `error` after `after` chunks (streams)."""

    def __init__(self, engine, error: Exception, failures: int = 1, after: int = 3, other_prompt: str | None = None):
        self.backend, self.error, self.failures, self.after = EngineBackend(engine), error, failures, after
        self.other_prompt, self.requests = other_prompt, []

    async def generate(self, request):
        self.requests.append(request)
        if len(self.requests) <= self.failures:
            raise self.error
        return await self.backend.generate(request)

    async def generate_stream(self, request):
        self.requests.append(request)
        failing = len(self.requests) <= self.failures
        if failing and self.other_prompt is not None:  # a first attempt that streamed something else
            request = generation_pb2.GenerateRequest(text=self.other_prompt, max_new_tokens=request.max_new_tokens)
        sent = 0
        async for chunk in self.backend.generate_stream(request):
            if failing and sent == self.after:
                raise self.error
            sent += 1
            yield chunk


def engine_ids(tiny_engine, prompt: str, **flags) -> list[int]:
    return tiny_engine.generate(prompt, build_params(**flags)).completions[0].token_ids


@pytest.mark.parametrize("error", [Unavailable("the replica serving this request failed; retry"),
                                   Overloaded("the server is at capacity; retry later")])
def test_grpc_unary_is_retried(tiny_engine, error):
    backend = FlakyBackend(tiny_engine, error, failures=2)
    with grpc_server(GenerationServicer(backend)) as address, GrpcClient(address, timeout_s=60, retries=FAST) as client:
        response = client.generate(PROMPT, **FIELDS)
    assert list(response.completions[0].token_ids) == engine_ids(tiny_engine, PROMPT, **FIELDS)
    assert len(backend.requests) == 3


def test_grpc_stream_resumes_without_loss_or_repeat(tiny_engine):
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), failures=2, after=3)
    with grpc_server(GenerationServicer(backend)) as address, GrpcClient(address, timeout_s=60, retries=FAST) as client:
        chunks = list(client.generate_stream(PROMPT, **FIELDS))
    ids = [t for chunk in chunks for t in chunk.token_ids]
    assert ids == engine_ids(tiny_engine, PROMPT, **FIELDS)
    expected_text = tiny_engine.generate(PROMPT, build_params(**FIELDS)).completions[0].text
    assert "".join(chunk.text for chunk in chunks) == expected_text
    assert sum(bool(chunk.finish_reason) for chunk in chunks) == 1 and chunks[-1].HasField("stats")
    assert len(backend.requests) == 3


def test_sampled_stream_gets_a_seed_and_resumes(tiny_engine, monkeypatch):
    """The client gives a sampled stream a seed, and its replay after a failure mid-stream draws the
    same tokens. The seed the client draws is fixed here: with some seeds the tiny model samples EOS
    within the first chunks and the stream ends before the failure (1 request, not 2)."""
    monkeypatch.setattr(secrets, "randbits", lambda bits: CLIENT_SEED)
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), after=4)
    fields = FIELDS | {"temperature": 0.9}

    async def run() -> list[int]:
        async with AsyncGrpcClient(address, timeout_s=60, retries=FAST) as client:
            return [t async for chunk in client.generate_stream(PROMPT, **fields) for t in chunk.token_ids]

    with grpc_server(GenerationServicer(backend)) as address:
        ids = asyncio.run(run())
    seeds = {request.seed for request in backend.requests}
    assert len(backend.requests) == 2 and len(seeds) == 1 and all(r.HasField("seed") for r in backend.requests)
    assert ids == engine_ids(tiny_engine, PROMPT, **fields, seed=seeds.pop())


def test_a_replay_that_differs_is_data_loss(tiny_engine):
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), after=3, other_prompt="SELECT name FROM users")
    with grpc_server(GenerationServicer(backend)) as address, GrpcClient(address, timeout_s=60, retries=FAST) as client:
        with pytest.raises(ClientError) as info:
            list(client.generate_stream(PROMPT, **FIELDS))
    assert info.value.code == "DATA_LOSS"


@pytest.mark.parametrize("route", ["complete", "chat"])
def test_an_http_replay_that_differs_is_data_loss(tiny_engine, route):
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), after=3, other_prompt="SELECT name FROM users")
    with http_server(create_app(lambda: backend, "specdec")) as url, HttpClient(url, timeout_s=60, retries=FAST) as client:
        with pytest.raises(ClientError) as info:
            if route == "complete":
                list(client.complete_stream(PROMPT, max_tokens=40, policy="fixed", k=2))
            else:
                list(client.chat_stream([{"role": "user", "content": PROMPT}], max_tokens=40, policy="fixed", k=2))
    assert info.value.code == "DATA_LOSS" and len(backend.requests) == 2


def test_bad_input_is_not_retried(tiny_engine):
    backend = FlakyBackend(tiny_engine, InvalidRequestError("prompt is empty"), failures=5)
    with grpc_server(GenerationServicer(backend)) as address, GrpcClient(address, timeout_s=60, retries=FAST) as client:
        with pytest.raises(ClientError) as info:
            client.generate(PROMPT)
    assert info.value.code == "INVALID_ARGUMENT" and len(backend.requests) == 1


def test_retries_run_out(tiny_engine):
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), failures=10)
    with grpc_server(GenerationServicer(backend)) as address, GrpcClient(address, timeout_s=60, retries=FAST) as client:
        with pytest.raises(ClientError) as info:
            client.generate(PROMPT)
    assert info.value.code == "UNAVAILABLE" and len(backend.requests) == FAST.retries + 1


@pytest.mark.parametrize("route", ["complete", "chat"])
def test_http_stream_resumes_after_an_error_event(tiny_engine, route):
    backend = FlakyBackend(tiny_engine, Unavailable("lost"), after=3)
    with http_server(create_app(lambda: backend, "specdec")) as url, HttpClient(url, timeout_s=60, retries=FAST) as client:
        if route == "complete":
            events = list(client.complete_stream(PROMPT, max_tokens=40, policy="fixed", k=2))
            text = "".join(c["text"] for e in events for c in e["choices"])
            expected = tiny_engine.generate(PROMPT, build_params(chat_template=False, **FIELDS)).completions[0].text
        else:
            events = list(client.chat_stream([{"role": "user", "content": PROMPT}], max_tokens=40, policy="fixed", k=2))
            deltas = [c["delta"] for e in events for c in e["choices"]]
            text = "".join(d.get("content", "") for d in deltas)
            assert [d.get("role") for d in deltas].count("assistant") == 1
            expected = tiny_engine.generate(PROMPT, build_params(**FIELDS)).completions[0].text
    assert text == expected and len(backend.requests) == 2
    assert events[-1]["usage"]["completion_tokens"] == len(engine_ids(tiny_engine, PROMPT, **FIELDS))


def test_http_429_is_retried_after_retry_after(tiny_engine):
    backend = FlakyBackend(tiny_engine, Overloaded("the server is at capacity; retry later"))
    with http_server(create_app(lambda: backend, "specdec")) as url, HttpClient(url, timeout_s=60, retries=FAST) as client:
        body = client.complete(PROMPT, max_tokens=8)
    assert body["choices"][0]["text"] and len(backend.requests) == 2


# ------------------------------------------------------------------------------------------------
# The replay rules on their own

def chunk(index: int, ids: list[int], text: str, finish: str = "") -> generation_pb2.GenerateChunk:
    return generation_pb2.GenerateChunk(index=index, token_ids=ids, text=text, finish_reason=finish)


def test_chunk_replay_with_different_chunk_boundaries():
    replay = ChunkReplay()
    first = [replay.fresh(c) for c in (chunk(0, [1, 2], "ab"), chunk(1, [7], "x"), chunk(0, [3], "c"))]
    assert [list(c.token_ids) for c in first] == [[1, 2], [7], [3]]
    replay.restart()
    again = [replay.fresh(c) for c in (chunk(0, [1], "a"), chunk(0, [2, 3, 4], "bcd"), chunk(1, [7, 8], "xy", "stop"),
                                       chunk(0, [5], "e", "length"))]
    assert again[0] is None
    assert [(list(c.token_ids), c.text, c.finish_reason) for c in again[1:]] == \
        [([4], "d", ""), ([8], "y", "stop"), ([5], "e", "length")]
    replay.restart()
    with pytest.raises(ClientError) as info:
        replay.fresh(chunk(0, [1, 9], "ax"))
    assert info.value.code == "DATA_LOSS"


def test_event_replay_keeps_one_role_and_the_usage_chunk():
    replay = EventReplay()
    delta = lambda content, role=False, finish=None: {"choices": [{"index": 0, "delta": ({"role": "assistant"} if role else {}) | {"content": content}, "finish_reason": finish}]}  # noqa: E731
    assert replay.fresh(delta("He", role=True))["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    replay.restart()
    assert replay.fresh(delta("H", role=True)) is None
    assert replay.fresh(delta("ello", finish="stop"))["choices"][0] == {"index": 0, "delta": {"content": "llo"},
                                                                         "finish_reason": "stop"}
    assert replay.fresh({"choices": [], "usage": {"completion_tokens": 3}})["usage"] == {"completion_tokens": 3}


def test_an_attempt_cut_after_its_last_chunk_delivers_that_chunk_once():
    events, chunks = EventReplay(), ChunkReplay()
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    last = generation_pb2.GenerateChunk(stats=generation_pb2.Stats(generated_tokens=3))
    assert events.fresh(usage) == usage and chunks.fresh(last) == last
    events.restart(), chunks.restart()  # (the stream broke before [DONE] / its status)
    assert events.fresh(usage) is None and chunks.fresh(last) is None


def test_an_event_replay_checks_the_text_it_skips():
    replay = EventReplay()
    text = lambda t: {"choices": [{"index": 0, "text": t, "finish_reason": None}]}  # noqa: E731
    assert replay.fresh(text("abc"))["choices"][0]["text"] == "abc"
    replay.restart()
    assert replay.fresh(text("ab")) is None
    assert replay.fresh(text("cde"))["choices"][0]["text"] == "de"
    replay.restart()
    with pytest.raises(ClientError) as info:
        replay.fresh(text("abd"))
    assert info.value.code == "DATA_LOSS"


@pytest.mark.parametrize("retries", [-1, 1.5, True])
def test_a_retry_count_below_0_or_not_whole_is_refused(retries):
    with pytest.raises(InvalidRequestError, match="retries must be a whole number >= 0"):
        RetryPolicy(retries=retries)


def test_pinned_seed_only_for_unseeded_sampling_with_retries():
    assert "seed" in pinned_seed({"temperature": 0.7}, RetryPolicy())
    assert pinned_seed({"temperature": 0.7, "seed": 3}, RetryPolicy()) == {"temperature": 0.7, "seed": 3}
    assert pinned_seed({"temperature": 0.0}, RetryPolicy()) == {"temperature": 0.0}
    assert pinned_seed({"temperature": 0.7}, RetryPolicy(retries=0)) == {"temperature": 0.7}


class IngressDiesOnce(GenerationServicer):
    """As Serve's gRPC proxy answers when the ingress replica died under the call (Ray 2.60)."""

    async def Generate(self, request, context):
        if not getattr(self, "died", False):
            self.died = True
            await context.abort(grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.\n"
                                                           "\tclass_name: ServeReplica:specdec:Ingress\n\tpid: 9780")
        return await super().Generate(request, context)


def test_an_ingress_replica_lost_under_the_call_is_retried(tiny_engine):
    """Serve's proxies answer gRPC INTERNAL with Ray's "actor died" text, or a plain-text HTTP 500,
    where docs/reliability.md promises a retriable loss: the clients retry them (our own 500s, bugs,
    are JSON and are not retried)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    with grpc_server(IngressDiesOnce(EngineBackend(tiny_engine))) as address, \
            GrpcClient(address, timeout_s=60, retries=FAST) as client:
        assert client.generate(PROMPT, **FIELDS).completions[0].token_ids == engine_ids(tiny_engine, PROMPT, **FIELDS)

    answers = [PlainTextResponse("Internal Server Error", status_code=500), JSONResponse({"status": "ok"})]
    proxy = Starlette(routes=[Route("/health", lambda request: answers.pop(0))])
    with http_server(proxy) as url, HttpClient(url, retries=FAST) as client:
        assert client.health() == {"status": "ok"} and not answers


# ------------------------------------------------------------------------------------------------
# Found by a bug hunt of the clients

class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_connection_reset_under_a_call_is_retried_and_a_refused_one_is_not():
    """"Connection reset" holds "connect": it read as a server that is not there, never retried."""
    from clients.grpc_client import client_error, retriable

    reset = client_error(RpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer (104))"),
                         "h:1")
    assert retriable(reset) and "reset" in reset.message
    for details in ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused",
                    "DNS resolution failed for nosuchhost.invalid:9000"):
        refused = client_error(RpcError(grpc.StatusCode.UNAVAILABLE, details), "h:1")
        assert not retriable(refused) and refused.message.startswith("cannot reach h:1")


def test_retry_after_is_honoured_up_to_a_minute_and_read_as_a_date_too():
    import email.utils
    import time

    from clients.http_client import retry_after

    policy = RetryPolicy(retries=5, first_backoff_s=0.5, max_backoff_s=8.0)
    assert policy.delay(0, 2.0) == 2.0 and policy.delay(0, 0.1) == 0.5
    for absurd in (3600.0, float("inf"), float("nan"), -5.0):  # (an hour's sleep, an OverflowError before)
        assert policy.delay(0, absurd) == 0.5
    assert RetryPolicy(retries=5000).delay(1100) == 8.0  # (2 ** 1100 overflowed)
    in_4_s = email.utils.formatdate(time.time() + 4, usegmt=True)
    assert 2.0 < retry_after(in_4_s) <= 4.0 and retry_after("7") == 7.0
    assert retry_after("soon") is None and retry_after(None) is None


def test_an_event_is_read_at_the_blank_line_that_ends_it():
    """A stream cut inside an event reads as cut short (retried), not as a malformed answer."""
    from clients.http_client import DONE, EventLines

    lines = EventLines()
    assert [lines.feed(line) for line in ('data: {"a": 1}', "", ": a comment", "data: [DONE]", "")] == \
        [None, {"a": 1}, None, None, DONE]
    assert EventLines().feed('data: {"choices": [{"te') is None


def test_an_http_call_whose_connection_drops_is_retried():
    import httpx

    answers = []

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append(request.url.path)
        if len(answers) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"object": "list", "data": []})

    client = HttpClient("http://server", retries=FAST)
    client._http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    assert client.models() == {"object": "list", "data": []} and answers == ["/v1/models", "/v1/models"]
