"""A served suffix-draft replica (`--draft suffix`) builds its draft without resolving the target:
the suffix draft has no model, and the target's vocabulary width (its one-hot q's) is all it
reads of it, which every Propose names (ProposeBatch `target_rows`). Resolving the target there
would fetch, assemble or convert it on whatever node the replica, which takes no CPU, landed on."""

from __future__ import annotations

import grpc
import pytest

import specdec.builder
from services.config import AppConfig
from services.convert import unpack_distribution
from services.replicas import Draft, draft_worker
from services.server import start_server
from services.servicers import DraftServicer
from services.transports import GrpcTransport
from specdec.builder import EngineConfig, build_engine, build_rules
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import DEFAULT_DRAFT
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from test_round_services import PROMPTS, Servers, propose_item, run
from test_round_services_padded import GREEDY_AND_SAMPLED
from tiny import byte_tokenizer

REPEATS = PROMPTS[1] * 3  # the suffix draft continues its repeats


def unresolvable(source, *args, **kwargs):
    raise AssertionError(f"the suffix draft's replica resolved a model ({source})")


def test_a_served_suffix_replica_builds_without_its_target_and_equals_the_engine(tiny_pair, monkeypatch):
    """The Draft replica's own class (services/replicas.py, outside Serve) builds its suffix draft
    while no model source resolves, its width unknown; the loop's rules are the served
    coordinator's (build_rules), whose first Propose names the width: served rounds over gRPC equal
    the in-process engine's, greedy and sampled, the suffix's candidates proposed."""
    config = AppConfig(models=EngineConfig(draft="suffix", target=str(tiny_pair[1])))
    engine = build_engine(config.models, progress=False)
    rules = build_rules(config.models, progress=False)
    with monkeypatch.context() as patched:
        for name in ("resolve_model", "resolve_gguf"):  # every backend's way to a model's files
            patched.setattr(specdec.builder, name, unresolvable)
        replica = Draft(config)
    draft = replica.servicer.worker.draft
    assert draft.vocab_size is None  # unsized until a call names the target's width
    servers = Servers(engine)  # the verifier's server (the draft's calls go to the replica)
    try:
        for params in GREEDY_AND_SAMPLED:
            loop = RoundLoop(GrpcTransport(replica._address, servers.addresses[1]), rules, BatchConfig(overlap="off"))
            [served] = run(loop, [(REPEATS, params)])
            assert not isinstance(served, Exception), served
            local = engine.generate_ids(REPEATS, params)
            assert served.completions[0].token_ids == local.completions[0].token_ids
            assert served.stats.draft_tokens > 0 and served.stats.draft_forward_passes == 0
    finally:
        servers.stop()
        replica._server.stop(None)
        replica._executor.shutdown()
    assert draft.vocab_size == rules.vocab_size == engine.draft.vocab_size


def test_an_unsized_suffix_draft_refuses_a_call_naming_no_width_and_serves_the_next(tmp_path):
    """Its worker built as a replica builds it, the target a path only the coordinator would have:
    a Propose naming no width (a coordinator of an earlier version, rules without a tokenizer) is
    refused whole in one line, the start-up probe and the session left for the next call, which
    names the width and is served at it; once sized, a call naming none is served as it is."""
    config = AppConfig(models=EngineConfig(draft="suffix", target=str(tmp_path / "only-on-the-coordinator")))
    worker = draft_worker(config, DEFAULT_DRAFT, None)
    server, address = start_server(draft=DraftServicer(worker))
    rows, tokens = 300, len(byte_tokenizer())
    sampled = common_pb2.SamplingParams(temperature=1.0, top_p=1.0)

    def batch(session_id: str, rows: int = 0, tokens: int = 0, **fields) -> draft_pb2.ProposeBatch:
        item = propose_item(session_id=session_id, sampling=sampled, history=common_pb2.HistoryDelta(
            history_length=5, tail=[1, 2, 3, 1, 2], full=True), **fields)
        return draft_pb2.ProposeBatch(items=[item], target_rows=rows, target_tokens=tokens)

    try:
        with grpc.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Propose(batch("early"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "names no target" in refused.value.details() and "\n" not in refused.value.details()
            assert "early" not in worker.sessions and worker.draft.vocab_size is None and not worker.timings
            reply = stub.Propose(batch("named", rows, tokens))
            [proposal] = reply.proposals
            assert not proposal.error and list(proposal.candidates) == [3, 1, 2]  # (the repeat continued)
            q = unpack_distribution(proposal.draft_probs[0], rows)  # one-hot, at the width named
            assert q.shape == (rows,) and float(q[3]) == 1.0
            assert worker.draft.vocab_size == rows and any(timing.probe for timing in reply.passes)
            [unnamed] = stub.Propose(batch("later")).proposals  # sized now: as any fitted draft
            assert not unnamed.error and len(unnamed.candidates) == 3
    finally:
        server.stop(None)
