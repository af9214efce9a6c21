"""GrpcClient and AsyncGrpcClient against a real gRPC server over the in-process engine (tiny models)."""

from __future__ import annotations

import asyncio

import pytest

from clients import ClientError
from clients.grpc_client import AsyncGrpcClient, GrpcClient, build_request
from clients.retry import RetryPolicy
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.params import build_params
from engine_backend import EngineBackend, GenerationServicer, free_port, grpc_server

PROMPTS = ["def fibonacci(n):", "Write a haiku about caches.", "SELECT name FROM users WHERE"]


@pytest.fixture(scope="module")
def servicer(tiny_engine):
    return GenerationServicer(EngineBackend(tiny_engine))


@pytest.fixture(scope="module")
def address(servicer):
    with grpc_server(servicer) as address:
        yield address


@pytest.fixture(scope="module")
def client(address):
    with GrpcClient(address, timeout_s=60) as grpc_client:
        yield grpc_client


def engine_ids(tiny_engine, prompt: str, **flags) -> list[int]:
    return tiny_engine.generate(prompt, build_params(**flags)).completions[0].token_ids


# ------------------------------------------------------------------------------------------------
# Requests

def test_build_request():
    request, metadata = build_request("hi", policy="fixed", k=3, temperature=None, stop="\n", session_id="s1")
    assert request.text == "hi" and request.policy == "fixed" and request.k == 3 and list(request.stop) == ["\n"]
    assert not request.HasField("threshold") and not request.HasField("max_new_tokens")
    assert metadata == (("session_id", "s1"),)
    request, metadata = build_request([{"role": "user", "content": "hi"}], chat_template=False)
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]
    assert request.HasField("chat_template") and metadata is None
    assert build_request([])[0].WhichOneof("prompt") == "token_ids"
    with pytest.raises(ValueError):
        build_request("hi", temprature=1.0)  # type: ignore[call-arg]
    for message in ({"role": "user"}, {"content": "hi"}):
        with pytest.raises(InvalidRequestError, match="each chat message needs a role and a content"):
            build_request([message])


def test_a_prompt_given_as_an_iterator_or_bytes_is_not_changed():
    """An iterator of token ids lost its first id (read to tell messages from ids, then sent without
    it); bytes were sent as the token ids of their byte values."""
    assert list(build_request(iter([5, 6, 7]))[0].token_ids.ids) == [5, 6, 7]
    messages = iter([{"role": "user", "content": "hi"}])
    assert [m.content for m in build_request(messages)[0].messages.messages] == ["hi"]
    with pytest.raises(InvalidRequestError, match="a prompt is text, token ids or chat messages, not bytes"):
        build_request(b"hi")


@pytest.mark.parametrize("session_id", ["a\nb", "s\u00e9ance", "a\x7f"])
def test_a_session_id_metadata_cannot_carry_is_refused_before_the_call(session_id):
    """It failed at the call as INTERNAL "Invalid metadata", which named neither the field nor why (and
    gRPC's core logged its own lines on stderr)."""
    with pytest.raises(InvalidRequestError) as info:
        build_request("hi", session_id=session_id)
    assert str(info.value).startswith("session_id must be printable ASCII (it travels as gRPC metadata)")


# ------------------------------------------------------------------------------------------------
# Outputs equal the engine's

def test_generate_equals_engine(client, servicer, tiny_engine):
    flags = {"policy": "fixed", "k": 3, "max_new_tokens": 32}
    response = client.generate(PROMPTS[0], request_id="r-1", session_id="s-1", **flags)
    assert list(response.completions[0].token_ids) == engine_ids(tiny_engine, PROMPTS[0], **flags)
    assert response.request_id == "r-1" and response.stats.generated_tokens == len(response.completions[0].token_ids)
    assert servicer.metadata["session_id"] == "s-1"


@pytest.mark.parametrize("form", ["token_ids", "messages", "raw_text"])
def test_prompt_forms(client, tiny_engine, form):
    params = build_params(max_new_tokens=16, chat_template=form != "raw_text")
    prompt = {"token_ids": tiny_engine.encode_prompt(PROMPTS[1]), "raw_text": PROMPTS[1],
              "messages": [{"role": "user", "content": PROMPTS[1]}]}[form]
    response = client.generate(prompt, max_new_tokens=16, **({"chat_template": False} if form == "raw_text" else {}))
    assert response.completions[0].text == tiny_engine.generate(PROMPTS[1], params).completions[0].text


def test_stream_equals_unary(client):
    flags = {"temperature": 0.8, "seed": 5, "n": 2, "max_new_tokens": 24}
    unary = client.generate(PROMPTS[2], **flags)
    chunks = list(client.generate_stream(PROMPTS[2], **flags))
    for completion in unary.completions:
        mine = [c for c in chunks if c.index == completion.index]
        assert [t for c in mine for t in c.token_ids] == list(completion.token_ids)
        assert "".join(c.text for c in mine) == completion.text
    assert chunks[-1].stats.generated_tokens == unary.stats.generated_tokens
    assert sum(c.HasField("stats") for c in chunks) == 1


def test_leaving_a_stream_early(client):
    stream = client.generate_stream(PROMPTS[0], max_new_tokens=64)
    assert next(stream).token_ids
    stream.close()  # cancels the call
    assert client.generate(PROMPTS[0], max_new_tokens=4).completions[0].token_ids


def test_async_client(address, tiny_engine):
    flags = {"policy": "svip", "max_new_tokens": 20}

    async def run():
        async with AsyncGrpcClient(address, timeout_s=60) as aio:
            unary, many = await asyncio.gather(aio.generate(PROMPTS[0], **flags),
                                               aio.generate(PROMPTS[1], **flags))
            chunks = [chunk async for chunk in aio.generate_stream(PROMPTS[0], **flags)]
            return unary, many, chunks

    unary, many, chunks = asyncio.run(run())
    assert list(unary.completions[0].token_ids) == engine_ids(tiny_engine, PROMPTS[0], **flags)
    assert list(many.completions[0].token_ids) == engine_ids(tiny_engine, PROMPTS[1], **flags)
    assert [t for c in chunks for t in c.token_ids] == list(unary.completions[0].token_ids)


# ------------------------------------------------------------------------------------------------
# Errors: ClientError(status name, the server's one line)

def test_invalid_argument(client):
    for call in (client.generate, lambda *a, **kw: list(client.generate_stream(*a, **kw))):
        with pytest.raises(ClientError) as info:
            call(PROMPTS[0], policy="nope")
        assert info.value.code == "INVALID_ARGUMENT"
        assert str(info.value).startswith("unknown policy 'nope'") and "\n" not in str(info.value)
        assert isinstance(info.value, SpecDecError)


def test_a_top_k_of_minus_one_is_off_as_over_http(client):
    """-1 or 0 = no top-k filter (vLLM's -1), as the OpenAI route and in process: -1 was refused
    here; below -1 is refused on every entry point with the same reason."""
    flags = {"temperature": 1.0, "seed": 3, "max_new_tokens": 8}
    off = client.generate(PROMPTS[0], top_k=-1, **flags).completions[0].token_ids
    assert list(off) == list(client.generate(PROMPTS[0], top_k=0, **flags).completions[0].token_ids)
    with pytest.raises(ClientError) as info:
        client.generate(PROMPTS[0], top_k=-2, **flags)
    assert (info.value.code, str(info.value)) == ("INVALID_ARGUMENT",
                                                  "top-k: Input should be greater than or equal to -1")


def test_a_number_that_is_not_finite_is_refused_as_over_http(client):
    for name in ("temperature", "top_p"):
        with pytest.raises(ClientError) as info:
            client.generate(PROMPTS[0], **{name: float("nan")})
        assert str(info.value) == f"{name.replace('_', '-')}: Input should be a finite number"


def test_async_invalid_argument(address):
    async def run():
        async with AsyncGrpcClient(address) as aio:
            with pytest.raises(ClientError) as unary:
                await aio.generate(PROMPTS[0], temperature=-1.0)
            with pytest.raises(ClientError) as stream:
                _ = [c async for c in aio.generate_stream([])]
            return unary.value, stream.value

    unary, stream = asyncio.run(run())
    assert (unary.code, str(unary)) == ("INVALID_ARGUMENT", "temperature: Input should be greater than or equal to 0")
    assert (stream.code, str(stream)) == ("INVALID_ARGUMENT", "prompt is empty")


def test_unreachable_server():
    address = f"127.0.0.1:{free_port()}"
    with GrpcClient(address, timeout_s=10) as client, pytest.raises(ClientError) as info:
        client.generate("hi")
    assert info.value.code == "UNAVAILABLE"
    assert str(info.value) == f"cannot reach {address}: is `specdec serve` running?"


def test_a_name_that_does_not_resolve_is_not_retried():
    with GrpcClient("nosuchhost.invalid:9000", timeout_s=10, retries=RetryPolicy(retries=3, first_backoff_s=5)) as client:
        with pytest.raises(ClientError) as info:
            client.generate("hi")
    assert str(info.value) == "cannot reach nosuchhost.invalid:9000: is `specdec serve` running?"
