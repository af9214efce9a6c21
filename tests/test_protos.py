"""The gRPC contracts (protos/specdec/v1/) and their generated code (specdec/v1/): not stale, the
messages round-trip, the public request and stats track the engine's parameters and metrics, and a
real gRPC server on loopback serves them (unary, streaming, INVALID_ARGUMENT)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import json_format

from specdec.metrics import RequestStats
from specdec.v1 import common_pb2, draft_pb2, generation_pb2, generation_pb2_grpc, verifier_pb2

REPO = Path(__file__).resolve().parent.parent
GENERATOR = REPO / "protos" / "generate.py"
GENERATED_DIR = Path("specdec", "v1")


def load_generator():
    spec = importlib.util.spec_from_file_location("protos_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def files_under(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()
            if path.is_file() and path.suffix in (".py", ".pyi")}


# ------------------------------------------------------------------------------------------------
# Generated code


def test_generated_code_is_not_stale(tmp_path):
    proc = subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"python protos/generate.py failed: {proc.stderr.strip()}"
    fresh, committed = files_under(tmp_path / GENERATED_DIR), files_under(REPO / GENERATED_DIR)
    assert fresh, "the generator wrote nothing"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"specdec/v1/ differs from protos/ ({', '.join(stale)}): run python protos/generate.py"


def test_grpcio_tools_pin_is_the_same_everywhere():
    pin = f"grpcio-tools=={load_generator().GRPCIO_TOOLS_VERSION}"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pin in pyproject["build-system"]["requires"]
    assert pin in pyproject["project"]["optional-dependencies"]["test"]


def test_generated_imports_are_package_qualified():
    stub = (REPO / GENERATED_DIR / "draft_pb2_grpc.py").read_text()
    assert "from specdec.v1 import draft_pb2 as" in stub
    assert "Do not edit" in (REPO / GENERATED_DIR / "__init__.py").read_text()


# ------------------------------------------------------------------------------------------------
# Messages

STOP = ("\n\n", "```")


def full_request(**prompt) -> generation_pb2.GenerateRequest:
    """A GenerateRequest with every field set (prompt: text=..., token_ids=... or messages=...)."""
    return generation_pb2.GenerateRequest(
        **prompt, chat_template=False, policy="fixed", k=5, threshold=0.3, temperature=0.7, top_p=0.9,
        top_k=40, seed=0, max_new_tokens=64, n=2, stop=STOP, request_id="req-1", draft="feature", suffix_cache=True)


PROMPT_FIELDS = {"text", "token_ids", "messages"}


@pytest.mark.parametrize("prompt", [
    {"text": "def add(a, b):"},
    {"token_ids": generation_pb2.TokenIds(ids=[151643, 0, 42])},
    {"messages": generation_pb2.ChatMessages(messages=[
        generation_pb2.ChatMessage(role="system", content="Be brief."),
        generation_pb2.ChatMessage(role="user", content="def add(a, b):")])}])
def test_generate_request_round_trip_with_every_field(prompt):
    request = full_request(**prompt)
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    other_prompt = PROMPT_FIELDS - set(prompt)
    every_field = {f.name for f in generation_pb2.GenerateRequest.DESCRIPTOR.fields} - other_prompt
    assert {f.name for f, _ in parsed.ListFields()} == every_field
    assert parsed.WhichOneof("prompt") == next(iter(prompt))


def test_unset_differs_from_zero_where_the_default_is_not_zero():
    empty = generation_pb2.GenerateRequest.FromString(
        generation_pb2.GenerateRequest(text="hi").SerializeToString())
    zeros = generation_pb2.GenerateRequest.FromString(generation_pb2.GenerateRequest(
        text="hi", chat_template=False, k=0, threshold=0.0, top_p=0.0, seed=0, max_new_tokens=0,
        n=0, policy="", draft="").SerializeToString())
    for name in ("chat_template", "policy", "k", "threshold", "top_p", "seed", "max_new_tokens", "n", "draft"):
        assert not empty.HasField(name) and zeros.HasField(name), name


def request_flags(request: generation_pb2.GenerateRequest) -> dict:
    """The request as `specdec.engine.build_params` flags, unset fields as None: the mapping a
    servicer needs is mechanical because the field names are the command line's (but
    `suffix_cache`: the server names the cache, its key's: GenerationParams.cache_scope)."""
    flags = {}
    for field in generation_pb2.GenerateRequest.DESCRIPTOR.fields:
        if field.name in PROMPT_FIELDS | {"request_id", "suffix_cache"}:
            continue
        value = getattr(request, field.name)
        if field.has_presence:
            flags[field.name] = value if request.HasField(field.name) else None
        else:
            flags[field.name] = (tuple(value) or None) if field.name == "stop" else value
    return flags


def test_request_fields_are_the_command_lines_parameters():
    from specdec.params import GenerationParams, build_params

    assert build_params(**request_flags(generation_pb2.GenerateRequest(text="hi"))) == GenerationParams()
    params = build_params(**request_flags(full_request(text="hi")))
    assert (params.chat_template, params.max_new_tokens, params.n, params.stop) == (False, 64, 2, STOP)
    assert params.draft == "feature"
    assert (params.policy.name, params.policy.k, params.policy.threshold) == ("fixed", 5, 0.3)
    sampling = params.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.7, 0.9, 40, 0)


def recorded_stats() -> RequestStats:
    """Stats after a few rounds, as the engine records them."""
    stats = RequestStats()
    for num_candidates, num_accepted in [(3, 3), (3, 1), (2, 0), (0, 0)]:
        stats.record_round(num_candidates, num_accepted)
        stats.generated_tokens += num_accepted + 1
        stats.draft_forward_passes += num_candidates
    stats.draft_time_s, stats.target_time_s, stats.wall_time_s = 0.25, 1.5, 1.875
    return stats


def test_stats_has_a_field_for_every_metric():
    fields = {f.name for f in generation_pb2.Stats.DESCRIPTOR.fields}
    missing = sorted(set(RequestStats().to_dict()) - fields)
    assert not missing, f"Stats lacks {missing}: add them to protos/specdec/v1/generation.proto"


def test_stats_filled_from_request_stats_round_trips():
    metrics = recorded_stats().to_dict()
    message = json_format.ParseDict(metrics, generation_pb2.Stats())  # k_histogram's str keys included
    parsed = generation_pb2.Stats.FromString(message.SerializeToString())
    assert parsed.k_histogram == {3: 2, 2: 1, 0: 1}
    expected = {**metrics, "transport_bytes": str(metrics["transport_bytes"])}  # proto3 JSON: int64 as a string
    assert json_format.MessageToDict(parsed, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True) == expected


def test_round_messages_round_trip():
    q = np.array([0.625, 0.25, 0.125], dtype=np.float32).tobytes()  # as a draft sends them: fp32
    probs = [common_pb2.Distribution(token_ids=np.array([7, 3, 9], dtype=np.int32).tobytes(), probs=q)]
    history = common_pb2.HistoryDelta(history_length=10, tail=[4, 5, 6])
    seed = common_pb2.RoundSeed(request_seed=2**64 - 1, sample_index=1, round_index=3)
    sampling = common_pb2.SamplingParams(temperature=0.7, top_k=0, top_p=0.95)
    messages = [
        draft_pb2.ProposeRequest(
            session_id="req-1/1", history=history, policy=draft_pb2.PolicyConfig(name="heuristic", k=4),
            sampling=sampling, max_candidates=20, num_generated=6,
            rounds=[draft_pb2.RoundOutcome(num_candidates=4, num_accepted=2)], seed=seed),
        draft_pb2.ProposalBatch(proposals=[draft_pb2.Proposal(candidates=[7], draft_probs=probs, forward_passes=2),
                                           draft_pb2.Proposal(session_missing=True),
                                           draft_pb2.Proposal(error="top-p: must be in (0, 1]")], draft_ms=12.5),
        verifier_pb2.VerifyRequest(session_id="req-1/1", history=history, candidates=[7], draft_probs=probs,
                                   sampling=sampling, seed=seed),
        verifier_pb2.VerdictBatch(verdicts=[verifier_pb2.Verdict(num_accepted=1, next_token=3),
                                            verifier_pb2.Verdict(session_missing=True)], target_ms=40.25),
        common_pb2.SessionRefs(session_ids=["req-1/1", "req-1/2"]),
        common_pb2.ReleaseResponse(released=[True, False]),
    ]
    for message in messages:
        assert type(message).FromString(message.SerializeToString()) == message
    parsed = verifier_pb2.VerifyRequest.FromString(messages[2].SerializeToString())
    assert parsed.draft_probs[0].probs == q  # exactly the q the draft sampled from
    assert not draft_pb2.PolicyConfig(name="svip").HasField("k")


# ------------------------------------------------------------------------------------------------
# A real gRPC server on loopback


class EchoGeneration(generation_pb2_grpc.GenerationServicer):
    """Generation without a model: the "completion" is the prompt's first max_new_tokens bytes."""

    def _prompt(self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext) -> list[int]:
        if request.WhichOneof("prompt") is None or (request.HasField("text") and not request.text.strip()):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if request.HasField("n") and request.n < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be at least 1, got {request.n}")
        return list(request.token_ids.ids) if request.HasField("token_ids") else list(request.text.encode())

    def _outputs(self, request, prompt) -> list[list[int]]:
        n = request.n if request.HasField("n") else 1
        limit = request.max_new_tokens if request.HasField("max_new_tokens") else 128
        return [prompt[:limit] for _ in range(n)]

    @staticmethod
    def _stats(outputs: list[list[int]]) -> generation_pb2.Stats:
        generated = sum(map(len, outputs))
        return generation_pb2.Stats(generated_tokens=generated, rounds=generated, target_forward_passes=generated,
                                    verification_rate=1.0, k_histogram={0: generated})

    def Generate(self, request, context):
        prompt = self._prompt(request, context)
        outputs = self._outputs(request, prompt)
        return generation_pb2.GenerateResponse(
            completions=[generation_pb2.Completion(text=bytes(ids).decode(), token_ids=ids, finish_reason="length",
                                                   index=i) for i, ids in enumerate(outputs)],
            stats=self._stats(outputs), prompt_tokens=len(prompt), request_id=request.request_id or "assigned")

    def GenerateStream(self, request, context) -> Iterator[generation_pb2.GenerateChunk]:
        prompt = self._prompt(request, context)  # abort before the first chunk
        outputs = self._outputs(request, prompt)
        for i, ids in enumerate(outputs):
            for j, token in enumerate(ids):
                yield generation_pb2.GenerateChunk(index=i, token_ids=[token], text=chr(token),
                                                   finish_reason="length" if j == len(ids) - 1 else "")
        yield generation_pb2.GenerateChunk(stats=self._stats(outputs), prompt_tokens=len(prompt))


@pytest.fixture(scope="module")
def generation_stub() -> Iterator[generation_pb2_grpc.GenerationStub]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(EchoGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield generation_pb2_grpc.GenerationStub(channel)
    server.stop(grace=None)


def test_unary_generate(generation_stub):
    response = generation_stub.Generate(generation_pb2.GenerateRequest(text="hello", max_new_tokens=4, n=2),
                                        timeout=10)
    assert [c.text for c in response.completions] == ["hell", "hell"]
    assert [c.index for c in response.completions] == [0, 1]
    assert list(response.completions[0].token_ids) == list(b"hell")
    assert response.prompt_tokens == 5 and response.request_id == "assigned"
    assert response.stats.generated_tokens == 8 and response.stats.k_histogram[0] == 8


def test_streaming_generate(generation_stub):
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(b"abc")), n=2)
    chunks = list(generation_stub.GenerateStream(request, timeout=10))
    *tokens, last = chunks
    for index in (0, 1):
        mine = [c for c in tokens if c.index == index]
        assert "".join(c.text for c in mine) == "abc"
        assert [c.finish_reason for c in mine] == ["", "", "length"]
    assert not any(c.HasField("stats") for c in tokens)
    assert last.HasField("stats") and last.stats.generated_tokens == 6 and last.prompt_tokens == 3


@pytest.mark.parametrize("call", ["Generate", "GenerateStream"])
@pytest.mark.parametrize(("request_", "details"), [
    (generation_pb2.GenerateRequest(), "prompt is empty"),
    (generation_pb2.GenerateRequest(text="hi", n=0), "n: must be at least 1, got 0"),
])
def test_invalid_argument_reaches_the_client_as_one_line(generation_stub, call, request_, details):
    with pytest.raises(grpc.RpcError) as caught:
        if call == "Generate":
            generation_stub.Generate(request_, timeout=10)
        else:
            list(generation_stub.GenerateStream(request_, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == details
