"""The OpenAI-compatible routes on the in-process engine (tiny models): outputs equal the engine's,
OpenAI's shapes (also through the official `openai` client), and one-line errors."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from fastapi.testclient import TestClient

from specdec.errors import InvalidRequestError
from specdec.params import build_params
from specdec.v1 import generation_pb2
from services.openai_api import create_app
from specdec.errors import Overloaded, Unavailable
from engine_backend import EngineBackend, http_server

PROMPTS = ["def fibonacci(n):", "Write a haiku about caches.", "SELECT name FROM users WHERE"]
MODEL = "specdec"


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(lambda: EngineBackend(tiny_engine), MODEL)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def openai_client(tiny_engine):
    with http_server(create_app(lambda: EngineBackend(tiny_engine), MODEL)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def expected_completion(tiny_engine, prompt: str, **flags):
    return tiny_engine.generate(prompt, build_params(chat_template=False, **flags))


def expected_chat(tiny_engine, messages: list[dict], **flags):
    return tiny_engine.generate_ids(tiny_engine.rules.encode_messages(messages), build_params(**flags))


def sse_events(response) -> list:
    """data payloads of an event stream, [DONE] as the string."""
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines]


# ------------------------------------------------------------------------------------------------
# Outputs equal the engine's

def test_completion_equals_engine(client, tiny_engine):
    expected = expected_completion(tiny_engine, PROMPTS[0], policy="fixed", k=3, max_new_tokens=32)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 32,
                                                    "policy": "fixed", "k": 3, "draft": "default"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    (choice,) = body["choices"]
    completion = expected.completions[0]
    assert choice == {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}
    assert body["usage"] == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": len(completion.token_ids),
                             "total_tokens": expected.prompt_tokens + len(completion.token_ids)}
    assert body["specdec"]["generated_tokens"] == len(completion.token_ids)
    assert body["specdec"]["k_histogram"] and "acceptance_by_position" in body["specdec"]


def test_speculative_options_are_the_flat_fields_grouped(client, tiny_engine):
    expected = expected_completion(tiny_engine, PROMPTS[0], policy="fixed", k=3, max_new_tokens=16)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "k": 3,
                                                    "speculative": {"policy": "fixed", "k": 3, "draft": "default"}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.completions[0].text
    assert max(map(int, response.json()["specdec"]["k_histogram"])) == 3  # fixed:3 ran


def test_token_id_prompt_and_defaults(client, tiny_engine):
    """Unset temperature is greedy and unset max_tokens is 128, as `specdec generate`."""
    ids = tiny_engine.encode_prompt(PROMPTS[2], chat_template=False)
    expected = tiny_engine.generate_ids(ids, build_params()).completions[0]
    body = client.post("/v1/completions", json={"prompt": [ids]}).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


def test_chat_equals_engine(client, tiny_engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[1]}]
    expected = expected_chat(tiny_engine, messages, max_new_tokens=24).completions[0]
    wire = [messages[0], {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    body = client.post("/v1/chat/completions", json={"messages": wire, "max_completion_tokens": 24}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": expected.text},
                                "finish_reason": expected.finish_reason, "logprobs": None}]


def test_n_seeded_samples(client, tiny_engine):
    flags = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "n": 2, "max_new_tokens": 16}
    expected = expected_completion(tiny_engine, PROMPTS[2], **flags)
    body = client.post("/v1/completions", json={"prompt": PROMPTS[2], "temperature": 0.9, "top_p": 0.95, "seed": 7,
                                                "n": 2, "max_tokens": 16}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [c.text for c in expected.completions]
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in expected.completions)


def test_stop_string(client, tiny_engine):
    full = expected_completion(tiny_engine, PROMPTS[0], max_new_tokens=40).completions[0].text
    stop = next(ch for ch in full if ch not in (full[0], "\ufffd"))  # first occurs mid-text
    expected = expected_completion(tiny_engine, PROMPTS[0], max_new_tokens=40, stop=(stop,)).completions[0]
    choice = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 40, "stop": stop}).json()["choices"][0]
    assert choice["text"] == expected.text == full[:full.index(stop)]
    assert choice["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------------
# Streaming

@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_unary_with_usage(client, chat):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": PROMPTS[0]}]} if chat else {"prompt": PROMPTS[0]}
    body = prompt | {"max_tokens": 48, "policy": "fixed", "k": 4}
    unary = client.post(route, json=body).json()
    response = client.post(route, json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_events(response)
    assert done == "[DONE]"
    assert chunks and all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert len({c["id"] for c in chunks + [usage]}) == 1
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == unary["choices"][0]["message"]["content"]
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks) == unary["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == \
        [unary["choices"][0]["finish_reason"]]
    assert usage["choices"] == [] and usage["usage"] == unary["usage"]
    assert usage["specdec"]["generated_tokens"] == unary["usage"]["completion_tokens"]


def test_stream_without_usage_and_n2(client):
    response = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12, "n": 2,
                                                    "temperature": 1.0, "seed": 3, "stream": True})
    *chunks, done = sse_events(response)
    assert done == "[DONE]" and all("usage" not in c and "specdec" not in c for c in chunks)
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


# ------------------------------------------------------------------------------------------------
# Bad input: 400 and one line naming the field

@pytest.mark.parametrize(("route", "body", "message", "param"), [
    ("completions", {"temperature": -1}, "temperature: Input should be greater than or equal to 0", "temperature"),
    ("completions", {"n": 0}, "n: Input should be greater than or equal to 1", "n"),
    ("completions", {"temperature": float("nan")}, "temperature: Input should be a finite number", "temperature"),
    ("completions", {"top_k": -2}, "top_k: Input should be greater than or equal to -1", "top_k"),
    ("completions", {"policy": "nope"}, "unknown policy 'nope'", None),
    ("completions", {"policy": ""}, "policy: String should have at least 1 character", "policy"),
    ("completions", {"policy": "nope", "stream": True}, "unknown policy 'nope'", None),
    ("completions", {"draft": "eagle"}, "unknown draft 'eagle'; this engine has 'default'", None),
    ("completions", {"speculative": {"draft": "eagle"}}, "unknown draft 'eagle'; this engine has 'default'", None),
    ("completions", {"speculative": {"k": 2}, "k": 3}, "k and speculative.k disagree", "speculative"),
    ("completions", {"speculative": {"tree": 2}}, "speculative.tree: Extra inputs are not permitted", "speculative"),
    # JSON's true is no number (as vLLM's and OpenAI's), here and in process (GenerationParams, PolicyConfig)
    ("completions", {"k": True}, "k: Input should be a valid integer", "k"),
    ("completions", {"speculative": {"policy": "fixed", "k": True}}, "speculative.k: Input should be a valid integer",
     "speculative"),
    ("completions", {"policy": "svip", "threshold": True}, "threshold: Input should be a valid number", "threshold"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True},
     "max_completion_tokens: Input should be a valid integer", "max_completion_tokens"),
    ("completions", {"suffix_cache": True}, "a cache of earlier responses is kept per API key: this server has none",
     None),
    ("completions", {"speculative": {"suffix_cache": True}}, "kept per API key", None),
    ("completions", {"echo": True}, "echo is not supported", "echo"),
    ("completions", {"logprobs": 2}, "logprobs is not supported", "logprobs"),
    ("completions", {"logprobs": 0}, "logprobs is not supported", "logprobs"),  # (0: the sampled tokens' own)
    # stop's domain is the engine's (GenerationParams), refused in this layer's own form: `stop[i]`, param
    # stop (the engine's "stop.0: ..." without a param), with the engine's reason for too many
    ("completions", {"stop": [str(i) for i in range(17)]}, "stop: at most 16 stop strings, got 17", "stop"),
    ("completions", {"stop": ""}, "stop[0]: String should have at least 1 character", "stop"),
    ("completions", {"stop": ["x", ""]}, "stop[1]: String should have at least 1 character", "stop"),
    ("completions", {"best_of": 3}, "best_of is not supported", "best_of"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty is not supported", "presence_penalty"),
    ("completions", {"prompt": ["a", "b"]}, "prompt: batched prompts are not supported", "prompt"),
    ("completions", {"prompt": 5}, "prompt: must be a string or a list of token ids", "prompt"),
    ("completions", {"prompt": ""}, "prompt is empty", None),  # (raw text of blanks is a prompt, as OpenAI's)
    ("completions", {"prompt": [[4294967296]]}, "prompt: token ids must be in [0, 2147483647]", "prompt"),
    ("completions", {"prompt": "hi \ud800"}, "prompt: must be valid Unicode (it holds a lone UTF-16 surrogate)",
     "prompt"),
    ("completions", {"stop": ["x", "\udc80"]}, "stop[1]: must be valid Unicode", "stop"),
    ("completions", {"stop": "\ud800"}, "stop[0]: must be valid Unicode", "stop"),
    ("completions", {"policy": "\ud800"}, "policy: Input should be a valid string, unable to parse raw data as a "
     "unicode string", "policy"),
    ("completions", {"speculative": {"draft": "\ud800"}}, "speculative.draft: Input should be a valid string",
     "speculative"),
    ("completions", {"stream": True, "stream_options": {"foo": 1}}, "stream_options.foo: Extra inputs are not permitted",
     "stream_options"),
    ("completions", {"repetition_penalty": 1.1}, "repetition_penalty: Extra inputs are not permitted", "repetition_penalty"),
    ("completions", {"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1", "max_tokens"),
    ("chat/completions", {"messages": []}, "messages: List should have at least 1 item", "messages"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role: Input should be", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content: only text content parts are supported", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "logprobs is not supported", "logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options is only allowed when stream is true",
     "stream_options"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]},
     "messages[0].content: must be valid Unicode", "messages"),
])
def test_bad_requests(client, route, body, message, param):
    defaults = {"prompt": PROMPTS[0]} if route == "completions" else {}
    payload = json.dumps(defaults | body | {"max_tokens": body.get("max_tokens", 4)})  # (a lone surrogate escaped)
    response = client.post(f"/v1/{route}", content=payload, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None


def test_a_top_k_of_minus_one_is_off_as_zero(client):
    """-1 or 0 = no top-k filter (vLLM's -1), over gRPC and in process too: the engine's
    SamplingParams reads -1 as off, and this route sends it as given."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 3}
    off = client.post("/v1/completions", json=body | {"top_k": -1})
    assert off.status_code == 200, off.text
    assert off.json()["choices"] == client.post("/v1/completions", json=body | {"top_k": 0}).json()["choices"]


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "echo": False, "logprobs": None, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "user": "someone", "top_k": -1,
            "stream": None, "stream_options": None}  # (OpenAI's schema: `stream: boolean | null`)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
    streamed = client.post("/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and '"usage"' not in streamed.text


def test_a_key_with_a_newline_is_quoted_in_the_one_line_error(client):
    """Found by the fuzz test: a logit_bias key "\n" put a newline in the message."""
    response = client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"\n": None}})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == 'logit_bias["\\n"]: Input should be a valid number'


def test_invalid_json(client):
    response = client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "the request body is not valid JSON"


def test_a_body_nested_too_deeply_says_so(client):
    """Python's JSON parser gives up at its recursion limit: such a body was "not valid JSON (UTF-8)",
    which it is. A body that is not UTF-8 still says that."""
    deep = b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body, message in ((deep, "the request body's JSON is nested too deeply to parse"),
                          (b'{"prompt": "\xff"}', "the request body is not valid JSON (UTF-8)")):
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["message"] == message


def test_model_mismatch_is_404(client):
    response = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"] == {"message": "The model `gpt-4o` does not exist.", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}


def test_models_health_metrics(client, tiny_engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [(MODEL, "model", "specdec")]
    assert client.get(f"/v1/models/{MODEL}").json() == models["data"][0]  # (the client's models.retrieve)
    long = client.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "x"})  # (not reflected whole)
    assert long.status_code == 404 and len(long.json()["error"]["message"]) <= 1000
    unknown = client.get("/v1/models/org/gpt-4o")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "The model `org/gpt-4o` does not exist."
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 404
    assert client.get("/nowhere").json()["error"]["message"] == "Not Found"

    async def metrics() -> str:
        return "specdec_rounds_total 3\n"
    with TestClient(create_app(lambda: EngineBackend(tiny_engine), MODEL, metrics)) as other:
        response = other.get("/metrics")
    assert response.status_code == 200 and response.text == "specdec_rounds_total 3\n"


# ------------------------------------------------------------------------------------------------
# Backend failures

class FailingBackend:
    """Raises `error` on generate; streams `before` chunks, then raises."""

    def __init__(self, error: Exception, before: int = 0):
        self.error, self.before = error, before

    async def generate(self, request):
        raise self.error

    async def generate_stream(self, request):
        for _ in range(self.before):
            yield generation_pb2.GenerateChunk(index=0, text="ab", token_ids=[97, 98])
        raise self.error


def test_health_answers_503_with_why_while_the_app_cannot_serve(tiny_engine):
    """/health asks the app whether a request could be served now (a served app: every deployment
    has a replica running); where not, a 503 says why, with the retry the error table gives."""
    waiting = ["Verifier"]

    async def readiness() -> None:
        if waiting:
            raise Unavailable(f"no replica of {waiting[0]} is running yet")

    with TestClient(create_app(lambda: EngineBackend(tiny_engine), MODEL, readiness=readiness)) as test_client:
        response = test_client.get("/health")
        assert response.status_code == 503 and response.headers["retry-after"] == "0"
        assert response.json()["error"] == {"message": "no replica of Verifier is running yet",
                                             "type": "unavailable_error", "param": None, "code": None}
        waiting.clear()
        assert test_client.get("/health").json() == {"status": "ok"}


def test_the_app_is_ready_where_each_deployment_runs_a_replica_or_needs_none():
    """services.ingress.app_ready reads Serve's status: a deployment being replaced or still loading
    holds the app back; one autoscaled to zero replicas (min_replicas 0) does not."""
    from ray.serve.schema import DeploymentStatus as S, DeploymentStatusOverview, DeploymentStatusTrigger, ReplicaState

    from services.ingress import not_serving

    def deployment(status: S, **replicas: int) -> DeploymentStatusOverview:
        return DeploymentStatusOverview(status, DeploymentStatusTrigger.UNSPECIFIED,
                                        {ReplicaState[state]: n for state, n in replicas.items()}, "")

    assert not_serving({"Draft": deployment(S.HEALTHY, RUNNING=1), "Verifier": deployment(S.UPSCALING, RUNNING=1),
                        "Idle": deployment(S.HEALTHY)}) == []
    assert not_serving({"Verifier": deployment(S.UNHEALTHY, STARTING=2), "Draft": deployment(S.UPDATING),
                        "Coordinator": deployment(S.UPSCALING, STARTING=1)}) == ["Coordinator", "Draft", "Verifier"]


def test_backend_is_built_lazily_once(tiny_engine):
    built = []

    def factory():
        built.append(1)
        return EngineBackend(tiny_engine)
    with TestClient(create_app(factory, MODEL)) as test_client:
        assert test_client.get("/health").status_code == 200 and not built
        for _ in range(2):
            assert test_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert len(built) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_429_with_retry_after(stream):
    app = create_app(lambda: FailingBackend(Overloaded("the server is at capacity; retry later")), MODEL)
    response = TestClient(app).post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == "the server is at capacity; retry later"


@pytest.mark.parametrize("stream", [False, True])
def test_bug_is_500_without_details(stream, caplog):
    app = create_app(lambda: FailingBackend(RuntimeError("secret detail")), MODEL)
    with caplog.at_level(logging.ERROR, logger="services.openai_api"):
        response = TestClient(app).post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal error", "type": "internal_error", "param": None, "code": None}}
    assert any(r.exc_info and "secret detail" in str(r.exc_info[1]) for r in caplog.records)


def test_failure_after_the_stream_started_is_an_error_event(caplog):
    app = create_app(lambda: FailingBackend(InvalidRequestError("late\nsecond line"), before=2), MODEL)
    response = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                  "stream": True})
    assert response.status_code == 200
    *chunks, error = sse_events(response)
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "ab"}, {"content": "ab"}]
    assert error == {"error": {"message": "late", "type": "invalid_request_error", "param": None, "code": None}}


# ------------------------------------------------------------------------------------------------
# The official client

def test_openai_client(openai_client, tiny_engine):
    expected = expected_completion(tiny_engine, PROMPTS[0], policy="svip", max_new_tokens=32).completions[0]
    completion = openai_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32,
                                                  extra_body={"policy": "svip"})
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.model_extra["specdec"]["generated_tokens"] == len(expected.token_ids)

    stream = openai_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"policy": "svip"})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_expected = expected_chat(tiny_engine, messages, max_new_tokens=24).completions[0]
    chat = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    assert chat.choices[0].message.content == chat_expected.text
    chat_stream = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream) == chat_expected.text
    assert [m.id for m in openai_client.models.list().data] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_bad_request(openai_client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=stream,
                                         extra_body={"policy": "svip", "threshold": 1.5})
    assert info.value.body["message"] == "threshold must be in (0, 1), got 1.5"
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="other", prompt="x")


def test_a_request_for_the_suffix_cache_reads_the_one_of_the_servers_key():
    """Named by a digest of the key (the key itself reaches no replica), one per key."""
    from services.auth import cache_scope
    from services.convert import params_from_request
    from specdec.policies import PolicyConfig
    from specdec.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(text="hi", suffix_cache=True)
    params = params_from_request(request, PolicyConfig(), api_key="secret")
    assert params.cache_scope == cache_scope("secret") != cache_scope("other")
    assert "secret" not in params.cache_scope
    assert params_from_request(generation_pb2.GenerateRequest(text="hi"), PolicyConfig(), "secret").cache_scope is None
