"""HttpClient and AsyncHttpClient against services.openai_api served by uvicorn (real HTTP) over
the in-process engine (tiny models)."""

from __future__ import annotations

import asyncio

import pytest

from clients import ClientError
from clients.http_client import DONE, AsyncHttpClient, HttpClient, parse_sse_line
from specdec.params import build_params
from specdec.v1 import generation_pb2
from services.openai_api import create_app
from engine_backend import EngineBackend, free_port, http_server

PROMPTS = ["def fibonacci(n):", "Write a haiku about caches."]


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    with http_server(create_app(lambda: EngineBackend(tiny_engine), "specdec")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with HttpClient(base_url, timeout_s=60) as http_client:
        yield http_client


def stream_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
                   for c in chunks if c["choices"])


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    with pytest.raises(ClientError) as info:
        parse_sse_line('data: {"error": {"message": "boom\\nmore", "type": "internal_error"}}')
    assert (info.value.code, str(info.value)) == ("internal_error", "boom")


def test_complete_and_chat_equal_engine(client, tiny_engine):
    expected = tiny_engine.generate(PROMPTS[0], build_params(policy="fixed", k=3, max_new_tokens=32, chat_template=False))
    body = client.complete(PROMPTS[0], max_tokens=32, policy="fixed", k=3, threshold=None)
    assert body["choices"][0]["text"] == expected.completions[0].text
    assert body["specdec"]["generated_tokens"] == len(expected.completions[0].token_ids)

    chat_expected = tiny_engine.generate(PROMPTS[1], build_params(max_new_tokens=16, top_k=5))
    chat = client.chat([{"role": "user", "content": PROMPTS[1]}], max_tokens=16, top_k=5)
    assert chat["choices"][0]["message"]["content"] == chat_expected.completions[0].text


@pytest.mark.parametrize("chat", [False, True])
def test_streams_equal_unary(client, chat):
    if chat:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        unary, chunks = client.chat(messages, max_tokens=24), list(client.chat_stream(messages, max_tokens=24))
        unary_text = unary["choices"][0]["message"]["content"]
    else:
        unary, chunks = client.complete(PROMPTS[0], max_tokens=24), list(client.complete_stream(PROMPTS[0], max_tokens=24))
        unary_text = unary["choices"][0]["text"]
    assert stream_text(chunks) == unary_text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == unary["usage"]  # usage asked for by default
    assert chunks[-1]["specdec"]["generated_tokens"] == unary["usage"]["completion_tokens"]


def test_stream_without_usage(client):
    chunks = list(client.complete_stream(PROMPTS[1], max_tokens=8, stream_options={"include_usage": False}))
    assert chunks and all(c["choices"] for c in chunks)


def test_models_and_health(client):
    assert [m["id"] for m in client.models()["data"]] == ["specdec"]
    assert client.health() == {"status": "ok"}


def test_async_client(base_url):
    async def run():
        async with AsyncHttpClient(base_url, timeout_s=60) as aio:
            unary, chat = await asyncio.gather(aio.complete(PROMPTS[0], max_tokens=16),
                                               aio.chat([{"role": "user", "content": PROMPTS[1]}], max_tokens=8))
            chunks = [c async for c in aio.complete_stream(PROMPTS[0], max_tokens=16)]
            with pytest.raises(ClientError) as error:
                await aio.chat([], max_tokens=8)
            return unary, chat, chunks, error.value, await aio.health()

    unary, chat, chunks, error, health = asyncio.run(run())
    assert stream_text(chunks) == unary["choices"][0]["text"] and chat["choices"][0]["message"]["role"] == "assistant"
    assert error.code == "HTTP 400" and str(error).startswith("messages: List should have at least 1 item")
    assert health == {"status": "ok"}


# ------------------------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("stream", [False, True])
def test_http_errors(client, stream):
    call = (lambda **kw: list(client.complete_stream(PROMPTS[0], **kw))) if stream else \
        (lambda **kw: client.complete(PROMPTS[0], **kw))
    with pytest.raises(ClientError) as info:
        call(temperature=-1)
    assert (info.value.code, str(info.value)) == ("HTTP 400", "temperature: Input should be greater than or equal to 0")
    with pytest.raises(ClientError) as info:
        call(model="other")
    assert (info.value.code, str(info.value)) == ("HTTP 404", "The model `other` does not exist.")


class BrokenBackend:
    """Streams one chunk, then fails."""

    async def generate(self, request):
        raise RuntimeError("bug")

    async def generate_stream(self, request):
        yield generation_pb2.GenerateChunk(index=0, text="ab", token_ids=[97, 98])
        raise RuntimeError("bug")


def test_error_event_mid_stream():
    with http_server(create_app(BrokenBackend, "specdec")) as url, HttpClient(url) as client:
        stream = client.complete_stream("x")
        assert next(stream)["choices"][0]["text"] == "ab"
        with pytest.raises(ClientError) as info:
            next(stream)
        assert (info.value.code, str(info.value)) == ("internal_error", "internal error")
        with pytest.raises(ClientError) as info:
            client.complete("x")
        assert (info.value.code, str(info.value)) == ("HTTP 500", "internal error")


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    with HttpClient(url) as client, pytest.raises(ClientError) as info:
        client.health()
    assert (info.value.code, str(info.value)) == ("UNAVAILABLE", f"cannot reach {url}: is `specdec serve` running?")


def test_a_server_that_does_not_answer_json(tmp_path):
    """Another server on the port (here one serving files): one-line errors, not a decoder's traceback."""
    import functools
    import http.server
    import threading

    (tmp_path / "health").write_text("<html>not specdec</html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with HttpClient(url, retries=0) as client:
            with pytest.raises(ClientError) as info:
                client.health()
            assert info.value.code == "BAD_RESPONSE" and "not JSON" in str(info.value)
            with pytest.raises(ClientError) as info:
                client.models()
            assert (info.value.code, str(info.value)) == ("HTTP 404", f"404 File not found at {url}/v1/models")
    finally:
        server.shutdown()
        server.server_close()


def test_an_openai_style_base_url_works(base_url):
    with HttpClient(base_url + "/v1/", timeout_s=60) as client:
        assert client.health()["status"] == "ok" and client.base_url == base_url
