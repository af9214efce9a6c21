"""The served system end to end on the tiny models: real Ray Serve (draft, verifier, coordinator,
ingress deployments), real gRPC (Serve's proxy; inter-deployment transport), real HTTP.

One Ray instance and one app per module (startup takes ~30 s on 2 cores)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import grpc
import httpx
import openai
import pytest
import ray
from ray import serve

from clients.grpc_client import GrpcClient
from clients.http_client import HttpClient
from clients.retry import RetryPolicy
from specdec.builder import EngineConfig
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import build_params
from specdec.v1 import generation_pb2, generation_pb2_grpc
from services.config import AppConfig, ReplicaConfig
from services.launch import APP_NAME
from benchmarks.load import wait_until_idle
from engine_backend import local_serve

PROMPTS = ["def fibonacci(n):", "Write a haiku about caches.", "SELECT name FROM users WHERE"]
MIXED = [("svip", None), ("fixed", 3), ("heuristic", 2), ("confidence", None), ("target-only", None),
         ("fixed", 1), ("svip", 4), ("heuristic", None)]


@pytest.fixture(scope="module")
def served(tiny_pair):
    draft_dir, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(  # every round drafted ahead where it may be: the served overlap under every test here
        models=EngineConfig(draft=str(draft_dir), drafts={"suffix": "suffix"}, target=str(target_dir),
                            batch=BatchConfig(overlap="on")),
        draft=ReplicaConfig(**replica), verifier=ReplicaConfig(num_replicas=2, **replica),
        coordinator=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64),
        ingress=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64))
    with local_serve(config) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served["grpc"]) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def engine_ids(tiny_engine, prompt: str, **flags) -> list[int]:
    return tiny_engine.generate(prompt, build_params(**flags)).completions[0].token_ids


def request(prompt: str, **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=prompt, **fields)


# ------------------------------------------------------------------------------------------------
# Output equals the in-process engine's

@pytest.mark.parametrize(("policy", "k"), [("svip", None), ("fixed", 3), ("target-only", None), ("heuristic", None)])
def test_grpc_unary_greedy_equals_engine(stub, tiny_engine, policy, k):
    fields = {"policy": policy, "max_new_tokens": 40} | ({"k": k} if k else {})
    response = stub.Generate(request(PROMPTS[0], **fields), timeout=60)
    assert list(response.completions[0].token_ids) == engine_ids(tiny_engine, PROMPTS[0], **fields)
    assert response.completions[0].finish_reason in ("stop", "length")
    assert response.stats.generated_tokens == len(response.completions[0].token_ids)
    assert response.stats.transport_bytes > 0 and response.request_id


@pytest.mark.parametrize(("policy", "k"), [("specdec++cost", None), ("fixed", 4)])
def test_the_suffix_draft_served_equals_target_greedy(stub, tiny_engine, policy, k):
    """A draft replica of the suffix draft (no model) beside the model draft's."""
    prompt = "abcabcabcabcabcabc, abcabcabc"
    fields = {"policy": policy, "max_new_tokens": 40} | ({"k": k} if k else {})
    response = stub.Generate(request(prompt, draft="suffix", **fields), timeout=60)
    assert list(response.completions[0].token_ids) == engine_ids(tiny_engine, prompt, policy="target-only",
                                                                   max_new_tokens=40)
    assert response.stats.draft_forward_passes == 0 and (policy != "fixed" or response.stats.draft_tokens > 0)
    sampled = stub.Generate(request(prompt, draft="suffix", temperature=1.0, seed=3, n=2, **fields), timeout=60)
    assert len(sampled.completions) == 2 and all(c.token_ids for c in sampled.completions)  # q one-hot on the wire


def test_grpc_stream_equals_unary_and_engine(stub, tiny_engine):
    fields = {"policy": "fixed", "k": 4, "max_new_tokens": 48}
    chunks = list(stub.GenerateStream(request(PROMPTS[1], **fields), timeout=60))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == engine_ids(tiny_engine, PROMPTS[1], **fields)
    assert len(chunks) > 2 and chunks[-1].stats.generated_tokens == len(ids)
    unary = stub.Generate(request(PROMPTS[1], **fields), timeout=60)
    assert "".join(c.text for c in chunks) == unary.completions[0].text


def test_seeded_sampling_equals_engine(stub, tiny_engine):
    """Served as in process with the same overlap: the int8 draft's draws depend on how its passes are
    cut (specdec/loop.py), and a round drafted ahead cuts them otherwise."""
    fields = {"policy": "svip", "temperature": 0.8, "top_p": 0.95, "seed": 7, "max_new_tokens": 32, "n": 2}
    response = stub.Generate(request(PROMPTS[2], **fields), timeout=60)
    params = build_params(**fields)
    loop = RoundLoop(tiny_engine.loop.calls.transport, tiny_engine.rules, BatchConfig(overlap="on"))
    expected = asyncio.run(loop.generate(tiny_engine.encode_prompt(PROMPTS[2], params.chat_template), params))
    assert [list(c.token_ids) for c in response.completions] == [c.token_ids for c in expected.completions]
    assert response.stats.rounds_ahead == expected.stats.rounds_ahead > 0


def test_http_and_openai_client_equal_engine(served, tiny_engine):
    expected = tiny_engine.generate(PROMPTS[0], build_params(policy="svip", max_new_tokens=32, chat_template=False))
    body = {"model": "specdec", "prompt": PROMPTS[0], "max_tokens": 32, "policy": "svip"}
    response = httpx.post(f"{served['http']}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.completions[0].text

    client = openai.OpenAI(base_url=f"{served['http']}/v1", api_key="unused")
    completion = client.completions.create(model="specdec", prompt=PROMPTS[0], max_tokens=32, extra_body={"policy": "svip"})
    assert completion.choices[0].text == expected.completions[0].text
    streamed = client.completions.create(model="specdec", prompt=PROMPTS[0], max_tokens=32, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"policy": "svip"})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.completions[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.completions[0].token_ids)

    chat_expected = tiny_engine.generate(PROMPTS[1], build_params(policy="svip", max_new_tokens=24))
    chat = client.chat.completions.create(model="specdec", messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=24, extra_body={"policy": "svip"})
    assert chat.choices[0].message.content == chat_expected.completions[0].text
    assert [m.id for m in client.models.list().data] == ["specdec"]
    assert httpx.get(f"{served['http']}/health", timeout=10).status_code == 200


def test_our_metrics_reach_the_metrics_endpoint(served, stub):
    """Ray exports an app's metrics through OpenTelemetry every few seconds and drops, with only a
    log line, one whose name OpenTelemetry refuses (ours had a colon: none ever reached /metrics)."""
    stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[0], policy="fixed", k=2, max_new_tokens=8), timeout=60)
    # (the names docs/operations.md gives: a counter's ends in _total)
    wanted = ("ray_specdec_requests_total{", "ray_specdec_target_forward_passes_total{", "ray_specdec_round_call_ms_bucket{")
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{served['http']}/metrics", timeout=10).text
        missing = [name for name in wanted if name not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, missing


def test_eight_concurrent_sessions_with_mixed_policies(served, tiny_engine):
    def fields(i: int) -> dict:
        policy, k = MIXED[i]
        return {"policy": policy, "max_new_tokens": 32} | ({"k": k} if k else {})

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(served["grpc"]) as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)
            calls = [aio_stub.Generate(request(PROMPTS[i % 3], **fields(i)), timeout=120) for i in range(8)]
            return [list(r.completions[0].token_ids) for r in await asyncio.gather(*calls)]

    results = asyncio.run(run())
    for i, ids in enumerate(results):
        assert ids == engine_ids(tiny_engine, PROMPTS[i % 3], **fields(i)), MIXED[i]


# ------------------------------------------------------------------------------------------------
# Bad input: a status and one line, over both protocols

@pytest.mark.parametrize(("fields", "message"), [
    ({"temperature": -1.0}, "temperature"),
    ({"policy": "nope"}, "policy"),
    ({"policy": "specdec++"}, "head"),
    ({"n": 0}, "n:"),
    ({"policy": "oracle"}, "oracle"),
])
def test_bad_parameters_grpc(stub, fields, message):
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as info:
            call(request(PROMPTS[0], **fields), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert message in details and "\n" not in details and "Traceback" not in details


def test_empty_prompt_grpc(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(generation_pb2.GenerateRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()


@pytest.mark.parametrize("stream", [False, True])
def test_bad_parameters_http(served, stream):
    body = {"model": "specdec", "prompt": PROMPTS[0], "max_tokens": 8, "policy": "nope", "stream": stream}
    response = httpx.post(f"{served['http']}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "policy" in message and "\n" not in message and "Traceback" not in message


# ------------------------------------------------------------------------------------------------
# Faults: a draft or verifier replica that dies costs time, not tokens; a coordinator that dies
# fails the call retriably and the client's retry resumes the stream

def replica_names(deployment: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if f"#{deployment}#" in a["name"] and APP_NAME in a["name"])


def kill_all(deployment: str) -> list[str]:
    """Kills every replica (the session must survive a restart, not just a re-route); returns their names."""
    before = replica_names(deployment)
    for name in before:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return before


def wait_replaced(deployment: str, before: list[str]) -> None:
    deadline = time.time() + 180
    while replica_names(deployment) == before or not replica_names(deployment):
        assert time.time() < deadline, "Serve did not replace the killed replicas"
        time.sleep(0.5)


def kill_points(seed: int, count: int, low: int, high: int) -> list[int]:
    """`count` random token counts in [low, high), ascending: where a stream's kills land."""
    return sorted(random.Random(seed).sample(range(low, high), count))


# A client that keeps retrying while a replacement replica starts (seconds on 2 loaded cores).
PATIENT = RetryPolicy(retries=30, first_backoff_s=0.2, max_backoff_s=2.0)
LONG = {"policy": "fixed", "k": 1, "max_new_tokens": 150}


def test_draft_and_verifier_killed_at_random_rounds_keep_the_output(tiny_engine, served):
    """The draft, every verifier, then both, killed at random points of one greedy stream (no client
    retries: the coordinator recovers): output unchanged, no token lost or repeated.

    Greedy only: a sampled round drawn again on a rebuilt cache is still an exact sample, but one
    prefill and many one-token steps differ in the last bits of the logits, so seeded output after
    a replica loss need not be bit-identical."""
    expected = engine_ids(tiny_engine, PROMPTS[1], **LONG)
    assert len(expected) > 120  # enough rounds for every kill to land mid-generation
    victims = [("Draft",), ("Verifier",), ("Draft", "Verifier")]
    points = kill_points(seed=7, count=len(victims), low=5, high=100)
    ids, kills = [], []
    with GrpcClient(served["grpc"], timeout_s=300, retries=0) as client:
        for chunk in client.generate_stream(PROMPTS[1], **LONG):
            ids.extend(chunk.token_ids)
            if len(kills) < len(points) and len(ids) >= points[len(kills)]:
                kills.append([(deployment, kill_all(deployment)) for deployment in victims[len(kills)]])
    assert ids == expected
    assert len(kills) == len(victims)
    for round_kills in kills:
        for deployment, before in round_kills:
            wait_replaced(deployment, before)
    replicas = sum(len(before) for round_kills in kills for _, before in round_kills)
    print(f"\nfaults: {replicas} draft/verifier replicas killed at tokens {points}; {len(ids)} tokens, 0 lost")


def streams_with_a_kill(address: str, prompts: list[str], kill_at: int, kill: Callable[[], object],
                        leaves: tuple[int, int] | None = None) -> dict[int, list[int]]:
    """Greedy streams of `prompts` (LONG) at once, each a client of its own without retries; `kill()`
    runs once, when the first stream has `kill_at` tokens; `leaves` (i, n): client i goes away after
    n tokens. Each stream's token ids by its index."""
    results: dict[int, list[int]] = {}
    killed = threading.Event()

    def stream(i: int) -> None:
        ids = []
        with GrpcClient(address, timeout_s=300, retries=0) as client:
            for chunk in client.generate_stream(prompts[i], **LONG):
                ids.extend(chunk.token_ids)
                if leaves is not None and i == leaves[0] and len(ids) >= leaves[1]:
                    break  # the client goes away: its session leaves the batch
                if i == 0 and len(ids) >= kill_at and not killed.is_set():
                    killed.set()
                    kill()
        results[i] = ids

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert killed.is_set()
    return results


def test_replicas_killed_while_four_sessions_share_steps(tiny_engine, served):
    """Four greedy streams at once share the coordinator's steps (one batched call per role per
    step, split over the two verifier replicas). One client goes away midway; the draft and every
    verifier are killed while the others run. The three others give the engine's output, and no
    session is left anywhere."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
    expected = [engine_ids(tiny_engine, prompt, **LONG) for prompt in prompts]
    killed: list[str] = []
    results = streams_with_a_kill(served["grpc"], prompts, 50, lambda: killed.extend(kill_all("Draft") + kill_all("Verifier")),
                                  leaves=(1, 20))
    assert len(results[1]) >= 20
    for i in (0, 2, 3):
        assert results[i] == expected[i], i
    for deployment in ("Draft", "Verifier"):
        wait_replaced(deployment, [name for name in killed if f"#{deployment}#" in name])
    assert wait_until_idle(APP_NAME) == {"Coordinator": 0, "Draft": 0, "Verifier": 0}


def test_health_is_503_naming_the_deployment_while_none_of_its_replicas_runs(served):
    """Every verifier killed: /health answers 503 naming the Verifier until a replacement runs (it said
    200 throughout, while every request failed or waited), then 200."""
    before = kill_all("Verifier")
    deadline = time.time() + 120
    while (response := httpx.get(f"{served['http']}/health", timeout=30)).status_code == 200:
        assert time.time() < deadline, "/health never said the verifier was gone"
        time.sleep(0.2)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == "no replica of Verifier is running yet"
    wait_replaced("Verifier", before)
    deadline = time.time() + 180
    while (response := httpx.get(f"{served['http']}/health", timeout=30)).status_code != 200:
        assert time.time() < deadline, response.text
        time.sleep(0.5)
    assert response.json() == {"status": "ok"}


def test_killed_coordinator_is_retried_to_the_same_result(tiny_engine, served):
    """Twice in one gRPC stream, once in a unary call, once in an HTTP stream: each call fails with
    a retriable status (UNAVAILABLE / 503: the clients retry nothing else), and the retry gives
    every token once, in order."""
    expected = engine_ids(tiny_engine, PROMPTS[0], **LONG)
    points = kill_points(seed=3, count=2, low=5, high=120)
    ids, kills = [], 0
    with GrpcClient(served["grpc"], timeout_s=300, retries=PATIENT) as client:
        for chunk in client.generate_stream(PROMPTS[0], **LONG):
            ids.extend(chunk.token_ids)
            if kills < len(points) and len(ids) >= points[kills]:
                kill_all("Coordinator")
                kills += 1
    assert ids == expected and kills == 2

    result = {}

    def unary() -> None:
        with GrpcClient(served["grpc"], timeout_s=300, retries=PATIENT) as unary_client:
            result["ids"] = list(unary_client.generate(PROMPTS[0], **LONG).completions[0].token_ids)

    thread = threading.Thread(target=unary)
    thread.start()
    handle = serve.get_deployment_handle("Coordinator", APP_NAME)
    while not handle.live_sessions.remote().result():  # wait until the call is being decoded
        time.sleep(0.05)
    kill_all("Coordinator")
    thread.join()
    assert result["ids"] == expected

    text_expected = tiny_engine.generate(PROMPTS[0], build_params(chat_template=False, **LONG)).completions[0].text
    text, killed = "", False
    with HttpClient(served["http"], timeout_s=300, retries=PATIENT) as client:
        for event in client.complete_stream(PROMPTS[0], max_tokens=150, policy="fixed", k=1):
            text += "".join(c["text"] for c in event["choices"])
            if not killed and len(text) >= 20:
                kill_all("Coordinator")
                killed = True
    assert killed and text == text_expected
    print(f"\nfaults: coordinator killed 4 times (gRPC stream at tokens {points}, unary, HTTP stream); "
          "every call retried to the same output, 0 tokens lost")
