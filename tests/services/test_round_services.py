"""The draft and verifier services over real gRPC (127.0.0.1) against the in-process engine."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.convert import dense_to_sparse, history_from_delta, sparse_to_dense, sparsify_logits
from services.draft_servicer import DraftServicer, SparsifyingDraft
from services.local_coordinator import LocalCoordinator
from services.server import start_server
from services.sessions import SessionStore
from services.verifier_servicer import VerifierServicer
from specdec.engine import SpecDecEngine
from specdec.params import build_params
from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc

torch.set_num_threads(1)

PROMPTS = ([5, 72, 101, 108, 108, 111, 44, 32], list(range(40, 61)))
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def services(tiny_engine):
    """(draft servicer, verifier servicer, coordinator) on two real gRPC servers."""
    draft, verifier = DraftServicer(tiny_engine.draft, tiny_engine.head), VerifierServicer(tiny_engine.target)
    draft_server, draft_address = start_server(draft=draft)
    verifier_server, verifier_address = start_server(verifier=verifier)
    channels = [grpc.insecure_channel(draft_address), grpc.insecure_channel(verifier_address)]
    coordinator = LocalCoordinator(draft_pb2_grpc.DraftStub(channels[0]), verifier_pb2_grpc.VerifierStub(channels[1]),
                                   max_context=tiny_engine.max_context, eos_token_ids=tiny_engine.eos_token_ids)
    yield draft, verifier, coordinator
    for channel in channels:
        channel.close()
    draft_server.stop(None)
    verifier_server.stop(None)


def engine_ids(engine: SpecDecEngine, prompt, params) -> tuple[list[int], str]:
    completion = engine.generate_ids(prompt, params).completions[0]
    return completion.token_ids, completion.finish_reason


@pytest.mark.parametrize("policy,k", [("target-only", None), ("fixed", 3), ("svip", 4), ("heuristic", 2)])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_engine(services, tiny_engine, prompt, policy, k):
    draft, verifier, coordinator = services
    params = build_params(policy=policy, k=k, max_new_tokens=MAX_NEW_TOKENS)
    result = coordinator.generate_ids(prompt, params)
    assert (result.token_ids, result.finish_reason) == engine_ids(tiny_engine, prompt, params)
    assert result.resends == 0
    assert all(r.draft is None for r in result.rounds) == (policy == "target-only")
    # the prompt travels once; after that only each round's committed tokens (n + 1)
    calls = [[r.verify] + ([r.draft] if r.draft else []) for r in result.rounds]
    assert all(call.history_tokens == len(prompt) for call in calls[0])
    for previous, current in zip(result.rounds, calls[1:]):
        assert all(call.history_tokens == previous.num_accepted + 1 for call in current)
    assert len(draft.sessions) == len(verifier.sessions) == 0  # released at the end


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.9)])
def test_seeded_sampling_matches_engine(services, tiny_engine, top_k, top_p):
    _, _, coordinator = services
    params = build_params(policy="fixed", k=3, temperature=1.0, top_k=top_k, top_p=top_p, seed=1234,
                          max_new_tokens=MAX_NEW_TOKENS)
    result = coordinator.generate_ids(PROMPTS[0], params)
    assert (result.token_ids, result.finish_reason) == engine_ids(tiny_engine, PROMPTS[0], params)
    assert any(r.num_candidates for r in result.rounds)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_evicted_sessions_are_resent_in_full(services, tiny_engine, temperature):
    draft, verifier, coordinator = services
    params = build_params(policy="heuristic", k=2, temperature=temperature, seed=7, max_new_tokens=MAX_NEW_TOKENS)
    session = "evict-me"
    ref = common_pb2.SessionRef(session_id=session)

    def evict(round_index: int) -> None:
        if round_index == 1:
            assert coordinator.draft.Release(ref).released
        if round_index == 2:
            verifier.sessions.clear()
        if round_index == 3:
            draft.sessions.clear()
            assert coordinator.verifier.Release(ref).released

    result = coordinator.generate_ids(PROMPTS[1], params, session_id=session, between_rounds=evict)
    assert (result.token_ids, result.finish_reason) == engine_ids(tiny_engine, PROMPTS[1], params)
    assert len(result.rounds) > 4
    assert [r.draft.attempts for r in result.rounds[1:5]] == [1, 2, 1, 2]
    assert [r.verify.attempts for r in result.rounds[1:5]] == [1, 1, 2, 2]
    assert result.resends == 4
    # a full resend carries the whole history again
    assert result.rounds[2].draft.history_tokens == result.rounds[1].num_accepted + 1 + len(PROMPTS[1]) + sum(
        r.num_accepted + 1 for r in result.rounds[:2])


def test_sparsified_draft_is_exact_for_what_it_sends(tiny_engine):
    """A draft that truncates q before sampling sends exactly that q: served output equals the
    in-process engine running the same truncated draft, and fewer bytes travel."""
    params = build_params(policy="fixed", k=3, temperature=0.7, seed=99, max_new_tokens=24)
    min_prob = 2e-3
    draft = DraftServicer(tiny_engine.draft, sparsify_below=min_prob)
    truncated = SpecDecEngine(SparsifyingDraft(tiny_engine.draft, params.sampling, min_prob), tiny_engine.target,
                              eos_token_ids=tiny_engine.eos_token_ids)
    exact_draft = DraftServicer(tiny_engine.draft)
    verifier = VerifierServicer(tiny_engine.target)
    servers = [start_server(draft=draft), start_server(draft=exact_draft), start_server(verifier=verifier)]
    channels = [grpc.insecure_channel(address) for _, address in servers]
    try:
        stubs = [draft_pb2_grpc.DraftStub(channels[0]), draft_pb2_grpc.DraftStub(channels[1])]
        verifier_stub = verifier_pb2_grpc.VerifierStub(channels[2])
        results = [LocalCoordinator(stub, verifier_stub, tiny_engine.max_context, tiny_engine.eos_token_ids)
                   .generate_ids(PROMPTS[0], params) for stub in stubs]
    finally:
        for channel in channels:
            channel.close()
        for server, _ in servers:
            server.stop(None)
    assert (results[0].token_ids, results[0].finish_reason) == engine_ids(truncated, PROMPTS[0], params)
    assert (results[1].token_ids, results[1].finish_reason) == engine_ids(tiny_engine, PROMPTS[0], params)
    per_candidate = [sum(r.draft.bytes_received for r in res.rounds) / sum(r.num_candidates for r in res.rounds)
                     for res in results]
    assert per_candidate[0] < per_candidate[1]


# ------------------------------------------------------------------------------------------------
# Bad input

def assert_invalid(call, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert fragment in details and "\n" not in details and "Traceback" not in details


def propose_request(**overrides) -> draft_pb2.ProposeRequest:
    fields = dict(session_id="bad", history=common_pb2.HistoryDelta(history_length=3, tail=[1, 2, 3], full=True),
                  policy=draft_pb2.PolicyConfig(name="fixed"), sampling=common_pb2.SamplingParams(top_p=1.0),
                  max_candidates=3, seed=common_pb2.RoundSeed(request_seed=1))
    fields.update(overrides)
    return draft_pb2.ProposeRequest(**fields)


def test_invalid_parameters_are_invalid_argument(services):
    _, _, coordinator = services
    draft, verifier = coordinator.draft, coordinator.verifier
    assert_invalid(lambda: draft.Propose(propose_request(sampling=common_pb2.SamplingParams(top_p=0.0))), "top-p")
    assert_invalid(lambda: draft.Propose(propose_request(
        sampling=common_pb2.SamplingParams(temperature=-1.0, top_p=1.0))), "temperature")
    assert_invalid(lambda: draft.Propose(propose_request(policy=draft_pb2.PolicyConfig(name="nope"))), "unknown policy")
    assert_invalid(lambda: draft.Propose(propose_request(policy=draft_pb2.PolicyConfig(name="fixed", k=0))),
                   "at least 1")
    assert_invalid(lambda: draft.Propose(propose_request(
        history=common_pb2.HistoryDelta(history_length=4, tail=[1, 2], full=True))), "full history")
    assert_invalid(lambda: draft.Propose(propose_request(
        history=common_pb2.HistoryDelta(history_length=1, tail=[10 ** 6], full=True))), "token ids")
    verify = verifier_pb2.VerifyRequest(
        session_id="bad", history=common_pb2.HistoryDelta(history_length=2, tail=[1, 2], full=True), candidates=[3],
        sampling=common_pb2.SamplingParams(temperature=float("nan"), top_p=1.0))
    assert_invalid(lambda: verifier.Verify(verify), "temperature")
    verify.sampling.temperature = 1.0
    assert_invalid(lambda: verifier.Verify(verify), "one draft distribution per candidate")
    verify.draft_probs.add(token_ids=[3, 3], probs=[0.5, 0.5])
    assert_invalid(lambda: verifier.Verify(verify), "distinct")
    # through the coordinator: specdec++ without a head
    assert_invalid(lambda: coordinator.generate_ids([1, 2, 3], build_params(policy="specdec++")), "acceptance head")


def test_missing_session_is_reported_not_guessed(services):
    draft, verifier, coordinator = services
    delta = common_pb2.HistoryDelta(history_length=5, tail=[4, 5], full=False)
    assert coordinator.draft.Propose(propose_request(session_id="never", history=delta)).session_missing
    reply = coordinator.verifier.Verify(verifier_pb2.VerifyRequest(
        session_id="never", history=delta, sampling=common_pb2.SamplingParams(top_p=1.0)))
    assert reply.session_missing and not reply.next_token
    assert "never" not in draft.sessions and "never" not in verifier.sessions


def test_expired_or_unknown_session_leaves_nothing_behind(tiny_engine):
    clock = FakeClock()
    draft = DraftServicer(tiny_engine.draft, sessions=SessionStore(max_sessions=4, ttl_s=10.0, clock=clock))
    server, address = start_server(draft=draft)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            assert not stub.Propose(propose_request(session_id="s")).session_missing
            clock.now = 11.0  # idle past the TTL: expired
            delta = common_pb2.HistoryDelta(history_length=5, tail=[4, 5], full=False)
            assert stub.Propose(propose_request(session_id="s", history=delta)).session_missing
            assert len(draft.sessions) == 0
            assert not stub.Release(common_pb2.SessionRef(session_id="s")).released
            assert not stub.Release(common_pb2.SessionRef(session_id="unknown")).released
    finally:
        server.stop(None)


def test_round_server_with_a_key_refuses_calls_without_it(tiny_engine):
    draft = DraftServicer(tiny_engine.draft)
    server, address = start_server(draft=draft, api_key="round-key")
    ref = common_pb2.SessionRef(session_id="x")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            for metadata in ((), (("authorization", "Bearer other"),), (("authorization", "round-key"),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Propose(propose_request(), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(draft.sessions) == 0  # refused before the servicer ran
            assert not stub.Release(ref, metadata=(("authorization", "Bearer round-key"),)).released
    finally:
        server.stop(None)


# ------------------------------------------------------------------------------------------------
# Conversions

def test_history_delta_worked_example():
    held = [1, 2, 3, 4, 5, 6, 7]
    delta = common_pb2.HistoryDelta(history_length=10, tail=[8, 9, 10])
    assert history_from_delta(held, delta, vocab_size=100) == list(range(1, 11))
    assert history_from_delta(None, delta, vocab_size=100) is None
    assert history_from_delta(held[:-1], delta, vocab_size=100) is None  # length mismatch
    full = common_pb2.HistoryDelta(history_length=2, tail=[3, 4], full=True)
    assert history_from_delta(held, full, vocab_size=100) == [3, 4]


def test_sparse_round_trip_is_exact():
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(300) * 3, dim=-1)
    q[::7] = 0.0
    q = q / q.sum()
    msg = dense_to_sparse(q)
    assert len(msg.token_ids) == 300 - len(range(0, 300, 7))
    assert torch.equal(sparse_to_dense(msg, 300), q)
    with pytest.raises(InvalidRequestError):
        sparse_to_dense(common_pb2.SparseDistribution(token_ids=[1], probs=[0.5]), 300)


def test_sparsify_logits_keeps_argmax_and_drops_the_tail():
    logits = torch.tensor([5.0, 0.0, -20.0, 4.0, -30.0])
    sampling = SamplingParams(temperature=1.0)
    masked = sparsify_logits(logits, sampling, min_prob=1e-6)
    assert torch.isinf(masked[[2, 4]]).all() and torch.equal(masked[[0, 1, 3]], logits[[0, 1, 3]])
    assert torch.equal(sparsify_logits(logits, SamplingParams(), 0.5), logits)  # greedy: untouched
    assert int(torch.argmax(sparsify_logits(torch.zeros(4), sampling, min_prob=0.9))) == 0


# ------------------------------------------------------------------------------------------------
# SessionStore

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_evicts_least_recently_used():
    store: SessionStore[int] = SessionStore(max_sessions=2)
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1
    store.put("c", 3)
    assert "b" not in store and store.get("a") == 1 and store.get("c") == 3 and len(store) == 2
    for i in range(100):
        store.put(str(i), i)
    assert len(store) == 2


def test_store_expires_idle_sessions():
    clock = FakeClock()
    store: SessionStore[str] = SessionStore(max_sessions=10, ttl_s=10.0, clock=clock)
    store.put("a", "A")
    clock.now = 5.0
    store.put("b", "B")
    clock.now = 9.0
    assert store.get("a") == "A"  # touched: idle time restarts
    clock.now = 15.0
    assert store.evict_expired() == 1 and "b" not in store
    clock.now = 19.0
    assert store.get("a") is None and len(store) == 0


def test_store_pop_and_replace():
    store: SessionStore[int] = SessionStore(max_sessions=3)
    store.put("a", 1)
    store.put("a", 2)
    assert len(store) == 1 and store.pop("a") == 2 and store.pop("a") is None
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)
