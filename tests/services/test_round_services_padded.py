"""The round services over gRPC with a draft whose embedding has other padding rows than its
target's (tests/core/test_padded_vocab.py): q travels at the target's width, and served output
equals the engine's, whether the builder fitted the draft in process or a served draft replica's
draft, built without reading the target, fits itself to the width the loop names (ProposeBatch
`target_rows`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.app import live_cap
from services.config import AppConfig
from services.replicas import Draft, Verifier
from services.server import start_server
from services.servicers import DraftServicer
from services.transports import GrpcTransport, HandleTransport
from specdec.builder import EngineConfig, build_draft, build_engine, build_rules
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2
from specdec.workers import DraftWorker
from test_replicas import AddressOnly
from test_round_services import Ring, Servers, propose_item, run
from tiny import byte_tokenizer, tiny_model

TOKENS = len(byte_tokenizer())  # 259 ids
TARGET_ROWS = 272
FIXED = PolicyConfig(name="fixed", k=3)
PROMPT = [5, 72, 101, 108]
GREEDY_AND_SAMPLED = (GenerationParams(max_new_tokens=20, policy=FIXED),
                      GenerationParams(max_new_tokens=20, policy=FIXED, sampling={"temperature": 1.0, "seed": 7}))


def save_model(path, rows: int, hidden: int, layers: int, seed: int, pad_scale: float):
    tokenizer = byte_tokenizer()
    model = tiny_model(rows, hidden, layers, seed, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    with torch.no_grad():  # its padding rows large: an unmasked one would be proposed
        model.model.embed_tokens.weight[len(tokenizer):] *= pad_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return padded_models(tmp_path_factory)


def padded_models(tmp_path_factory) -> dict:
    """A target of 272 rows; drafts of 280 (more) and 264 (fewer) rows, their padding rows large."""
    root = tmp_path_factory.mktemp("padded")
    return {"target": save_model(root / "target", TARGET_ROWS, 32, 2, 2, 1.0),
            "more": save_model(root / "more", 280, 16, 1, 1, 40.0),
            "fewer": save_model(root / "fewer", 264, 16, 1, 1, 40.0)}


def pair(padded, draft: str, fused: bool = False) -> EngineConfig:
    source = str(padded[draft])
    return EngineConfig(draft=f"suffix+{source}" if fused else source, target=str(padded["target"]), head="none")


def test_served_rounds_of_a_padded_pair_equal_the_engine(padded):
    engine = build_engine(pair(padded, "more"), progress=False)
    servers = Servers(engine)
    try:
        for params in GREEDY_AND_SAMPLED:
            loop = RoundLoop(GrpcTransport(*servers.addresses), engine.rules, BatchConfig(overlap="off"))
            [served] = run(loop, [(PROMPT, params)])
            local = engine.generate_ids(PROMPT, params)
            assert served.completions[0].token_ids == local.completions[0].token_ids
            assert served.stats.draft_tokens > 0
    finally:
        servers.stop()


def handle_transport(servers: Servers) -> HandleTransport:
    """`serve-grpc` / `actor`: the calls through Serve deployment handles (test_round_services `Ring`)."""
    return HandleTransport(Ring({servers.addresses[0]: servers.draft}), Ring({servers.addresses[1]: servers.verifier}))


@pytest.mark.parametrize("draft,fused,transport", [("more", False, "grpc"), ("fewer", False, "grpc"),
                                                   ("more", True, "grpc"), ("more", False, "handle")])
def test_a_draft_built_without_its_target_fits_itself_to_the_width_the_loop_names(padded, draft, fused, transport):
    """The draft server's draft built as a served draft replica builds it (build_draft, the target
    unread: its own rows), the loop's rules the served coordinator's (build_rules): the first
    Propose names the target's width and the draft fits itself to it, a fused suffix draft too."""
    config = pair(padded, draft, fused)
    engine = build_engine(config, progress=False)
    unfitted, _ = build_draft(config, progress=False)
    assert unfitted.vocab_size != TARGET_ROWS
    servers = Servers(SimpleNamespace(draft=unfitted, head=None, target=engine.target))
    rules = build_rules(config, progress=False)
    carrier = {"grpc": lambda: GrpcTransport(*servers.addresses),
               "handle": lambda: handle_transport(servers)}[transport]
    try:
        for params in GREEDY_AND_SAMPLED:
            [served] = run(RoundLoop(carrier(), rules, BatchConfig(overlap="off")), [(PROMPT, params)])
            assert not isinstance(served, Exception), served
            local = engine.generate_ids(PROMPT, params)
            assert served.completions[0].token_ids == local.completions[0].token_ids
            assert served.stats.draft_tokens > 0
    finally:
        servers.stop()
    assert unfitted.vocab_size == TARGET_ROWS
    if fused:
        assert unfitted.suffix.vocab_size == TARGET_ROWS


def test_a_draft_asked_for_a_second_width_refuses_the_call_and_keeps_serving_the_first(padded):
    draft, _ = build_draft(pair(padded, "more"), progress=False)
    servicer = DraftServicer(DraftWorker(draft))
    server, address = start_server(draft=servicer)

    def batch(session_id: str, rows: int, tokens: int = TOKENS, **history) -> draft_pb2.ProposeBatch:
        return draft_pb2.ProposeBatch(items=[propose_item(session_id=session_id, **history)], target_rows=rows,
                                      target_tokens=tokens)

    try:
        with grpc.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            [first] = stub.Propose(batch("first", TARGET_ROWS)).proposals
            assert len(first.candidates) == 3 and draft.vocab_size == TARGET_ROWS
            for rows in (280, 300):  # its own rows, and a third width: neither is the one it fitted to
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Propose(batch("other", rows))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"{rows} token rows" in refused.value.details() and "\n" not in refused.value.details()
            assert "other" not in servicer.sessions and draft.vocab_size == TARGET_ROWS
            history = first.candidates[:1]  # the first session goes on where it was
            [again] = stub.Propose(batch("first", TARGET_ROWS, history=common_pb2.HistoryDelta(
                history_length=3 + len(history), tail=history))).proposals
            assert not again.session_missing and not again.error and len(again.candidates) == 3
            [unsaid] = stub.Propose(batch("first", 0, 0)).proposals  # a coordinator that names none: as it is
            assert not unsaid.error
            with pytest.raises(grpc.RpcError, match="both positive or both unset"):
                stub.Propose(batch("first", TARGET_ROWS, 0))
    finally:
        server.stop(None)


def test_the_served_replicas_of_a_padded_pair_equal_the_engine(padded):
    """The replicas' own classes outside Serve (services/replicas.py): a Draft replica builds its
    draft without the target, the loop runs beside the verifier (its rules the served coordinator's,
    `coordinator`), and its Propose calls reach the draft's replica over gRPC (DirectTransport)."""
    config = AppConfig(models=pair(padded, "more"), loop_placement="verifier")
    engine = build_engine(config.models, progress=False)
    draft = Draft(config)
    verifier = Verifier(config, drafts={"default": AddressOnly(draft._address)}, cap=live_cap(config))

    async def generate(params: GenerationParams) -> tuple[list[int], int]:
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=PROMPT), max_new_tokens=params.max_new_tokens, policy="fixed", k=3,
            temperature=params.sampling.temperature, seed=params.sampling.seed or 0)
        response = generation_pb2.GenerateResponse.FromString(await verifier.generate(request.SerializeToString()))
        return list(response.completions[0].token_ids), response.stats.draft_tokens

    async def both() -> list[tuple[list[int], int]]:  # (one event loop: the transport's channels live on it)
        try:
            return [await generate(params) for params in GREEDY_AND_SAMPLED]
        finally:
            await verifier.coordinator.loop.calls.transport.close()

    try:
        for params, (served, drafted) in zip(GREEDY_AND_SAMPLED, asyncio.run(both())):
            assert served == engine.generate_ids(PROMPT, params).completions[0].token_ids and drafted > 0
        assert draft.servicer.worker.draft.vocab_size == TARGET_ROWS
    finally:
        for replica in (draft, verifier):
            replica._server.stop(None)
            replica._executor.shutdown()
