"""Reliability and access on the served app, end to end on the tiny models (real Ray Serve, real
gRPC through Serve's proxy, real HTTP): bad input over both protocols, the API key on every route
and on the internal round services, request size limits, overload (429 / RESOURCE_EXHAUSTED),
clients that disconnect, and a short load run (benchmarks/load.py; the full load and soak are
commands, docs/reliability.md).

One Ray instance and one app for the module, with the API key on. After every bad input the app
holds no session anywhere (coordinator, draft and verifier replicas) and still serves correctly."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import httpx
import openai
import pytest
import ray
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray import serve

from clients import ClientError
from clients.grpc_client import GrpcClient
from clients.http_client import HttpClient
from services.config import AppConfig, ReplicaConfig
from services.launch import APP_NAME, PROXY_MAX_MESSAGE_ENV
from specdec.builder import EngineConfig
from specdec.params import build_params
from specdec.v1 import common_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc

from benchmarks.load import RssSampler, run_load, wait_until_idle
from engine_backend import local_serve

API_KEY = "test-key-5d1e"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 64 * 1024
PROXY_MAX_MESSAGE_BYTES = 256 * 1024
MAX_ONGOING, MAX_QUEUED = 4, 8  # per coordinator replica; the overload test sends far more at once
CONTEXT = 256  # the tiny models' (tests/tiny.py)
PROMPT = "def fibonacci(n):"
NO_SESSIONS = {"Coordinator": 0, "Draft": 0, "Verifier": 0}


@pytest.fixture(scope="module")
def served(tiny_pair):
    draft_dir, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(
        models=EngineConfig(draft=str(draft_dir), target=str(target_dir)),
        draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
        coordinator=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=MAX_ONGOING),
        ingress=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64),
        max_queued_requests=MAX_QUEUED, api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES)
    with local_serve(config, {PROXY_MAX_MESSAGE_ENV: str(PROXY_MAX_MESSAGE_BYTES)}) as addresses:  # Ray's processes inherit it
        yield addresses


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served["grpc"]) as grpc_channel:
        yield grpc_channel


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


def engine_ids(tiny_engine, prompt: str, **flags) -> list[int]:
    return tiny_engine.generate(prompt, build_params(**flags)).completions[0].token_ids


def assert_one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message and "<class" not in message, message


def assert_no_sessions() -> None:
    assert wait_until_idle(APP_NAME) == NO_SESSIONS


# ------------------------------------------------------------------------------------------------
# Bad input over gRPC: a status and one line, no state, for Generate and GenerateStream

def req(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**({"text": PROMPT} | fields))


NAN, INF = math.nan, math.inf
GRPC_BAD = {
    "no prompt": (generation_pb2.GenerateRequest(), "prompt is empty"),
    "empty text": (req(text=""), "prompt is empty"),
    "blank text": (req(text=" \n\t"), "prompt is empty"),
    "empty token ids": (req(text=None, token_ids=generation_pb2.TokenIds()), "prompt is empty"),
    "token id out of the vocabulary": (req(text=None, token_ids=generation_pb2.TokenIds(ids=[5, 100000])), "token ids"),
    "negative token id": (req(text=None, token_ids=generation_pb2.TokenIds(ids=[-1])), "token ids"),
    "prompt over the context": (req(text="x" * (CONTEXT + 10), chat_template=False), "context holds 256"),
    "no messages": (req(text=None, messages=generation_pb2.ChatMessages()), "messages is empty"),
    "unknown role": (req(text=None, messages=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="tool", content="x")])), "role"),
    "max tokens 0": (req(max_new_tokens=0), "max-new-tokens"),
    "max tokens negative": (req(max_new_tokens=-5), "max-new-tokens"),
    "max tokens over the context": (req(max_new_tokens=10_000), "context holds 256 tokens: the prompt's"),
    "max tokens past the prompt's end of the context": (req(text="x" * (CONTEXT - 3), chat_template=False,
                                                            max_new_tokens=5), "max-new-tokens 5 do not fit"),
    "temperature negative": (req(temperature=-0.5), "temperature"),
    "temperature NaN": (req(temperature=NAN), "temperature"),
    "temperature infinite": (req(temperature=INF), "temperature"),
    "top-p 0": (req(top_p=0.0), "top-p"),
    "top-p over 1": (req(top_p=1.5), "top-p"),
    "top-p NaN": (req(top_p=NAN), "top-p"),
    "top-k below -1": (req(top_k=-2), "top-k"),  # (-1 means off, as 0 does)
    "unknown policy": (req(policy="nope"), "unknown policy 'nope'"),
    "empty policy": (req(policy=""), "policy: String should have at least 1 character"),  # (ran the default)
    "oracle": (req(policy="oracle"), "oracle"),
    "specdec++ without a head": (req(policy="specdec++"), "acceptance head"),
    "k 0": (req(policy="fixed", k=0), "k must be at least 1"),
    "k over the round cap": (req(policy="fixed", k=1000), "k must be at most 64"),
    "threshold 0": (req(policy="svip", threshold=0.0), "threshold must be in (0, 1)"),
    "threshold 1.5": (req(policy="svip", threshold=1.5), "threshold must be in (0, 1)"),
    "threshold NaN": (req(policy="svip", threshold=NAN), "threshold must be in (0, 1)"),
    "n 0": (req(n=0), "n:"),
    "n negative": (req(n=-1), "n:"),
    "n huge": (req(n=2**31 - 1), "n:"),
    "request over the size limit": (req(text="x" * (MAX_REQUEST_BYTES + 1)), "the limit is 65536"),
    "request id over 128 characters": (req(request_id="x" * 129), "request_id must be at most 128 characters"),
    # (quoted whole, the reason outgrew gRPC's 16 KiB trailers: the client got RESOURCE_EXHAUSTED)
    "a draft name of 20,000 characters": (req(draft="x" * 20_000), "unknown draft 'xxx"),
}
RAW_BAD = {  # wire bytes the generated stubs would refuse to send
    "non-UTF-8 text": (b"\x0a\x02\xff\xfe", "UTF-8"),
    "corrupt wire format": (b"\xff\xff\xff\xff\x0f", "not a valid specdec.v1.GenerateRequest"),
    "truncated message": (b"\x0a\x10abc", "not a valid specdec.v1.GenerateRequest"),
}


def raw_calls(channel: grpc.Channel):
    unary = channel.unary_unary("/specdec.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
    stream = channel.unary_stream("/specdec.v1.Generation/GenerateStream", request_serializer=None,
                                  response_deserializer=None)
    return unary, lambda payload, **kw: list(stream(payload, **kw))


def assert_status(call, payload, code: grpc.StatusCode, message: str, metadata=AUTH) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(payload, timeout=30, metadata=metadata)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert_one_line(info.value.details())


@pytest.mark.parametrize("case", list(GRPC_BAD))
def test_bad_input_grpc(stub, case):
    request, message = GRPC_BAD[case]
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
        assert_status(call, request, grpc.StatusCode.INVALID_ARGUMENT, message)
    assert_no_sessions()


@pytest.mark.parametrize("case", list(RAW_BAD))
def test_malformed_grpc_request(channel, case):
    payload, message = RAW_BAD[case]
    for call in raw_calls(channel):
        assert_status(call, payload, grpc.StatusCode.INVALID_ARGUMENT, message)


def test_message_over_the_proxy_limit(stub):
    """Serve's gRPC proxy refuses it before it reaches the app (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE)."""
    request = req(text="x" * (PROXY_MAX_MESSAGE_BYTES + 1))
    assert_status(stub.Generate, request, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")


# ------------------------------------------------------------------------------------------------
# Bad input over HTTP: 400-422 (401, 404, 405, 413, 415 where they fit), OpenAI's error JSON in one line

def body(**fields) -> dict:
    return {"model": "specdec", "prompt": PROMPT, "max_tokens": 8} | fields


JSON = {"content-type": "application/json"}
HTTP_BAD = {
    "empty prompt": ("completions", {"json": body(prompt="")}, 400, "prompt is empty"),
    "blank chat message": ("chat/completions", {"json": {"messages": [{"role": "user", "content": "  "}]}}, 400,
                           "prompt is empty"),
    "empty token prompt": ("completions", {"json": body(prompt=[])}, 400, "prompt is empty"),
    "prompt over the context": ("completions", {"json": body(prompt="x" * (CONTEXT + 10))}, 400, "context holds 256"),
    "prompt over the context, streamed": ("completions", {"json": body(prompt="x" * (CONTEXT + 10), stream=True)},
                                          400, "context holds 256"),
    "prompt of the wrong type": ("completions", {"json": body(prompt=5)}, 400, "prompt: must be a string"),
    "max tokens 0": ("completions", {"json": body(max_tokens=0)}, 400, "max_tokens"),
    "max tokens negative": ("completions", {"json": body(max_tokens=-1)}, 400, "max_tokens"),
    "max tokens over the context": ("completions", {"json": body(max_tokens=10_000)}, 400, "max-new-tokens 10000 do not fit"),
    "max tokens past the prompt's end of the context": ("completions", {"json": body(prompt="x" * (CONTEXT - 3),
                                                                                     max_tokens=5)}, 400, "do not fit"),
    "max tokens true": ("completions", {"json": body(max_tokens=True)}, 400, "max_tokens"),
    "n true": ("completions", {"json": body(n=True)}, 400, "n:"),
    "temperature true": ("completions", {"json": body(temperature=True)}, 400, "temperature"),
    "stream 1": ("completions", {"json": body(stream=1)}, 400, "stream"),
    "max tokens over int32": ("completions", {"json": body(max_tokens=2**40)}, 400, "max_tokens"),
    "temperature negative": ("completions", {"json": body(temperature=-1)}, 400, "temperature"),
    "temperature NaN": ("completions", {"content": b'{"prompt": "x", "temperature": NaN}', "headers": JSON},
                        400, "temperature"),
    "temperature a string": ("completions", {"json": body(temperature="hot")}, 400, "temperature"),
    "top-p 0": ("completions", {"json": body(top_p=0)}, 400, "top_p"),
    "top-p over 1": ("completions", {"json": body(top_p=1.5)}, 400, "top_p"),
    "unknown policy": ("completions", {"json": body(policy="nope")}, 400, "unknown policy 'nope'"),
    "unknown policy, streamed": ("completions", {"json": body(policy="nope", stream=True)}, 400, "unknown policy"),
    "threshold out of range": ("completions", {"json": body(policy="svip", threshold=1.5)}, 400, "threshold must be in (0, 1)"),
    "k 0": ("completions", {"json": body(policy="fixed", k=0)}, 400, "k must be at least 1"),
    "k over the round cap": ("completions", {"json": body(policy="fixed", k=1000)}, 400, "k must be at most 64"),
    "n 0": ("completions", {"json": body(n=0)}, 400, "n:"),
    "n huge": ("completions", {"json": body(n=10**9)}, 400, "n:"),
    "unknown field": ("completions", {"json": body(frobnicate=1)}, 400, "frobnicate: Extra inputs"),
    "no messages": ("chat/completions", {"json": {"messages": []}}, 400, "messages"),
    "unknown role": ("chat/completions", {"json": {"messages": [{"role": "tool", "content": "x"}]}}, 400, "role"),
    "non-UTF-8 body": ("completions", {"content": b'{"prompt": "\xff\xfe"}', "headers": JSON}, 400, "not valid JSON"),
    "malformed JSON": ("completions", {"content": b'{"prompt": ', "headers": JSON}, 400, "not valid JSON"),
    "a JSON array": ("completions", {"json": [PROMPT]}, 400, "body:"),
    "wrong content type": ("completions", {"content": b'{"prompt": "x"}', "headers": {"content-type": "text/plain"}},
                           415, "must be JSON"),
    "no content type": ("completions", {"content": b'{"prompt": "x"}'}, 415, "must be JSON"),
    "body over the size limit": ("completions", {"json": body(prompt="x" * (MAX_REQUEST_BYTES + 1))},
                                 413, "larger than 65536 bytes"),
    "body over the size limit, chunked": ("completions", {"content": lambda: iter([b'{"prompt": "', b"x" * MAX_REQUEST_BYTES,
                                                                                   b'"}']), "headers": JSON},
                                          413, "larger than 65536 bytes"),
    "unknown model": ("completions", {"json": body(model="gpt-4o")}, 404, "does not exist"),
}


@pytest.mark.parametrize("case", list(HTTP_BAD))
def test_bad_input_http(served, case):
    route, kwargs, status, message = HTTP_BAD[case]
    kwargs = {key: value() if callable(value) else value for key, value in kwargs.items()}  # a chunked body: fresh
    headers = HEADERS | kwargs.pop("headers", {})
    response = httpx.post(f"{served['http']}/v1/{route}", headers=headers, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert_one_line(error["message"])
    assert_no_sessions()


def test_wrong_method_and_unknown_route(served):
    for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/models", 405), ("GET", "/nowhere", 404)):
        response = httpx.request(method, f"{served['http']}{path}", headers=HEADERS, timeout=30)
        assert response.status_code == status
        assert_one_line(response.json()["error"]["message"])


def test_still_serves_correctly_after_bad_input(served, tiny_engine):
    fields = {"policy": "fixed", "k": 3, "max_new_tokens": 24}
    with GrpcClient(served["grpc"], timeout_s=60, api_key=API_KEY) as client:
        assert list(client.generate(PROMPT, **fields).completions[0].token_ids) == engine_ids(tiny_engine, PROMPT, **fields)
    expected = tiny_engine.generate(PROMPT, build_params(chat_template=False, **fields)).completions[0].text
    with HttpClient(served["http"], timeout_s=60, api_key=API_KEY) as client:
        assert client.complete(PROMPT, max_tokens=24, policy="fixed", k=3)["choices"][0]["text"] == expected
    assert_no_sessions()


# ------------------------------------------------------------------------------------------------
# Access: with the key on, no route answers without it

HTTP_ROUTES = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
               ("GET", "/docs", None), ("GET", "/openapi.json", None), ("GET", "/redoc", None),
               ("GET", "/nowhere", None), ("POST", "/v1/completions", {"json": body()}),
               ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}]}}),
               ("POST", "/v1/completions", {"content": b"{", "headers": JSON}),
               ("POST", "/v1/completions", {"json": body(prompt="x" * (MAX_REQUEST_BYTES + 1))})]
WRONG_KEYS = [None, "Bearer wrong-key", f"Basic {API_KEY}", f"Bearer {API_KEY}x", "Bearer", API_KEY]


@pytest.mark.parametrize("authorization", WRONG_KEYS)
def test_http_routes_need_the_key(served, authorization):
    for method, path, kwargs in HTTP_ROUTES:
        kwargs = dict(kwargs or {})
        headers = kwargs.pop("headers", {}) | ({"Authorization": authorization} if authorization else {})
        response = httpx.request(method, f"{served['http']}{path}", headers=headers, timeout=30, **kwargs)
        assert response.status_code == 401, (method, path, response.status_code)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert_no_sessions()


def test_http_with_the_key(served):
    assert httpx.get(f"{served['http']}/health", headers=HEADERS, timeout=30).json() == {"status": "ok"}
    with HttpClient(served["http"], timeout_s=60, api_key=API_KEY) as client:
        assert [m["id"] for m in client.models()["data"]] == ["specdec"]
    client = openai.OpenAI(base_url=f"{served['http']}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert client.completions.create(model="specdec", prompt=PROMPT, max_tokens=4).choices[0].finish_reason
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served['http']}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("authorization", WRONG_KEYS)
def test_grpc_needs_the_key(stub, channel, authorization):
    metadata = (("authorization", authorization),) if authorization else ()
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
        assert_status(call, req(max_new_tokens=4), grpc.StatusCode.UNAUTHENTICATED, "API key", metadata)
    for call in raw_calls(channel):  # the key is checked before the request is parsed
        assert_status(call, b"\xff\xff", grpc.StatusCode.UNAUTHENTICATED, "API key", metadata)
    assert_no_sessions()


def test_grpc_client_sends_the_key(served, monkeypatch):
    with pytest.raises(ClientError) as info, GrpcClient(served["grpc"], timeout_s=30, api_key="wrong") as client:
        client.generate(PROMPT, max_new_tokens=4)
    assert info.value.code == "UNAUTHENTICATED"
    monkeypatch.setenv("SPECDEC_API_KEY", API_KEY)  # the clients' default
    with GrpcClient(served["grpc"], timeout_s=60) as client:
        assert client.generate(PROMPT, max_new_tokens=4).completions[0].finish_reason
    with HttpClient(served["http"], timeout_s=60) as client:
        assert client.health() == {"status": "ok"}


def test_reflection_is_off_with_a_key(channel):
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_round_services_need_the_key_and_bind_the_node_address(served):
    """The draft replica's own gRPC server (the direct round transport): on the Ray node's address
    only, and refusing calls without the key."""
    address = serve.get_deployment_handle("Draft", APP_NAME).options(session_id="probe").address.remote().result()
    host, port = address.rsplit(":", 1)
    assert host.strip("[]") == ray.util.get_node_ip_address()
    ref = common_pb2.SessionRefs(session_ids=["nobody"])
    with grpc.insecure_channel(address) as round_channel:
        draft = draft_pb2_grpc.DraftStub(round_channel)
        with pytest.raises(grpc.RpcError) as info:
            draft.Release(ref, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert draft.Release(ref, timeout=10, metadata=AUTH).released == [False]  # unknown session: nothing to free
    if host != "127.0.0.1":
        with grpc.insecure_channel(f"127.0.0.1:{port}") as loopback:
            with pytest.raises(grpc.RpcError) as info:
                draft_pb2_grpc.DraftStub(loopback).Release(ref, timeout=10, metadata=AUTH)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------------------------------
# Overload: refused at once with 429 / RESOURCE_EXHAUSTED, never queued without bound

BURST = 3 * (MAX_ONGOING + MAX_QUEUED)
LONG = {"policy": "fixed", "k": 2, "max_new_tokens": 40}


def test_overload_grpc_is_resource_exhausted(served, tiny_engine):
    """Unary calls and streams alike (a refused stream fails before its first chunk)."""
    async def burst():
        async with grpc.aio.insecure_channel(served["grpc"]) as aio_channel:
            aio_stub = generation_pb2_grpc.GenerationStub(aio_channel)

            async def unary() -> list[int]:
                response = await aio_stub.Generate(req(**LONG), timeout=300, metadata=AUTH)
                return list(response.completions[0].token_ids)

            async def stream() -> list[int]:
                return [t async for chunk in aio_stub.GenerateStream(req(**LONG), timeout=300, metadata=AUTH)
                        for t in chunk.token_ids]

            return await asyncio.gather(*[(unary if i % 2 else stream)() for i in range(BURST)],
                                        return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served_ok = [r for r in results if isinstance(r, list)]
    assert len(refused) + len(served_ok) == BURST and refused  # capacity is a third of the burst
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    for error in refused:
        assert_one_line(error.details())
    assert served_ok and all(ids == engine_ids(tiny_engine, PROMPT, **LONG) for ids in served_ok)
    assert_no_sessions()


def test_overload_http_is_429_with_retry_after(served, tiny_engine):
    async def burst():
        async with httpx.AsyncClient(timeout=300, headers=HEADERS) as client:
            fields = body(max_tokens=LONG["max_new_tokens"], policy="fixed", k=2)
            return await asyncio.gather(*[client.post(f"{served['http']}/v1/completions",
                                                      json=fields | {"stream": bool(i % 2)}) for i in range(BURST)])

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    served_ok = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served_ok) == BURST and refused
    assert all(r.headers["retry-after"] == "1" for r in refused)
    for response in refused:  # ours (the coordinator's queue) in OpenAI's JSON; Serve's proxy's in plain text
        is_json = response.headers["content-type"].startswith("application/json")
        assert_one_line(response.json()["error"]["message"] if is_json else response.text)
    expected = tiny_engine.generate(PROMPT, build_params(chat_template=False, **LONG)).completions[0].text

    def text(response: httpx.Response) -> str:
        if not response.headers["content-type"].startswith("text/event-stream"):
            return response.json()["choices"][0]["text"]
        events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
        assert all("error" not in event for event in events)
        return "".join(c["text"] for event in events for c in event["choices"])

    assert all(text(r) == expected for r in served_ok)
    assert_no_sessions()


def test_client_retries_through_overload(served, tiny_engine):
    """A burst through the client with retries (as many as it takes): every request completes, unchanged."""
    async def burst():
        from clients.grpc_client import AsyncGrpcClient
        from clients.retry import RetryPolicy

        policy = RetryPolicy(retries=10_000, first_backoff_s=0.1, max_backoff_s=0.5)
        async with AsyncGrpcClient(served["grpc"], timeout_s=300, api_key=API_KEY, retries=policy) as client:
            return await asyncio.gather(*[client.generate(PROMPT, **LONG) for _ in range(MAX_ONGOING + MAX_QUEUED + 4)])

    expected = engine_ids(tiny_engine, PROMPT, **LONG)
    assert all(list(r.completions[0].token_ids) == expected for r in asyncio.run(burst()))
    assert_no_sessions()


# ------------------------------------------------------------------------------------------------
# Cancellation: a client that goes away frees its session on every service

def live() -> dict[str, int]:
    from benchmarks.load import live_sessions

    return live_sessions(APP_NAME)


def test_grpc_client_disconnect_frees_sessions(stub):
    call = stub.GenerateStream(req(policy="fixed", k=1, max_new_tokens=200), timeout=120, metadata=AUTH)
    chunks = [next(call) for _ in range(3)]
    assert all(chunk.token_ids for chunk in chunks)
    during = live()
    assert all(during.values()), during  # the session lives on all three while it streams
    call.cancel()
    assert_no_sessions()


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_http_client_disconnect_frees_sessions(served, route):
    fields = {"stream": True, "max_tokens": 200, "policy": "fixed", "k": 1}
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    with httpx.Client(timeout=120, headers=HEADERS) as client:
        with client.stream("POST", f"{served['http']}/v1/{route}", json=prompt | fields) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            assert all('"error"' not in next(lines) for _ in range(3))
            during = live()
            assert all(during.values()), during
    assert_no_sessions()


# ------------------------------------------------------------------------------------------------
# Load (short form; `python -m benchmarks.load --tiny ...` is the full one)

@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_short_load_loses_nothing(served, tiny_engine, protocol):
    fields = {"policy": "fixed", "k": 4, "max_new_tokens": 32}
    prompts = [PROMPT, "Write a haiku about caches.", "SELECT name FROM users WHERE"]
    if protocol == "grpc":
        expected = {p: engine_ids(tiny_engine, p, chat_template=False, **fields) for p in prompts}
        fields = fields | {"chat_template": False}
    else:
        expected = {p: list(tiny_engine.generate(p, build_params(chat_template=False, **fields)).completions[0].text)
                    for p in prompts}
    with RssSampler(every_s=2.0) as rss:
        report = asyncio.run(run_load(served[protocol], protocol, clients=MAX_ONGOING, seconds=6.0, fields=fields,
                                      prompts=prompts, expected=expected, api_key=API_KEY))
    report.rss_mb = rss.samples
    summary = report.summary()
    print(f"\nshort load ({protocol}): {summary}")
    assert report.requests >= MAX_ONGOING and report.tokens > 0
    assert report.errors == {} and report.tokens_lost == 0 and report.mismatched_requests == 0
    assert summary["latency_p50_s"] <= summary["latency_p99_s"]
    assert_no_sessions()
