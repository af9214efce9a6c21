"""The draft and verifier services over real gRPC (127.0.0.1), driven by the round loop through
GrpcTransport, against the in-process engine: the served path's batching, history deltas,
session_missing resends, replica failover and cancellation run here without Ray."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections import Counter

import grpc
import numpy as np
import pytest
import torch

from services.convert import pack_distribution, sparsifier, sparsify_logits, unpack_distribution
from services.server import start_server
from services import servicers
from services.servicers import DraftServicer, VerifierServicer
from services.transports import GrpcTransport, HandleTransport, ReplicaGone, RoundStreams, service
from specdec.sequences import DraftTraits
from specdec.engine import SpecDecEngine
from specdec.errors import InvalidRequestError
from specdec.calls import RetryPolicy
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import build_params
from specdec.protocol import HistoryDelta, RoundSeed, VerifyItem, history_from_delta
from specdec.sampling import SamplingParams
from specdec.sessions import SessionStore
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.workers import DraftWorker, FeatureLink, VerifierWorker

HEADED = {"default": DraftTraits(has_head=True)}  # the rules of a pair with a head

torch.set_num_threads(1)

PROMPTS = ([5, 72, 101, 108, 108, 111, 44, 32], list(range(40, 61)), [257, 100, 101, 102], list(range(120, 135)))
MAX_NEW_TOKENS = 40
FAST_RETRY = RetryPolicy(attempts=10, first_backoff_s=0.01, max_backoff_s=0.05)


class Servers:
    """A draft and a verifier server over the tiny engine's models (workers of their own)."""

    def __init__(self, engine: SpecDecEngine, draft_sessions: SessionStore | None = None, min_prob: float = 0.0,
                 api_key: str | None = None):
        self.draft = DraftServicer(DraftWorker(engine.draft, engine.head, draft_sessions, sparsifier(min_prob)))
        self.verifier = VerifierServicer(VerifierWorker(engine.target))
        self.servers = [start_server(draft=self.draft, api_key=api_key), start_server(verifier=self.verifier, api_key=api_key)]

    @property
    def addresses(self) -> tuple[str, str]:
        return self.servers[0][1], self.servers[1][1]

    def stop(self) -> None:
        for server, _ in self.servers:
            server.stop(None)


class Colocated(Servers):
    """One server for the verifier and the feature draft beside it, the two workers linked (as a
    Verifier replica with its draft colocated: services/replicas.py); `verdict_states` counts the
    verdicts that carried states out of the process."""

    def __init__(self, engine: SpecDecEngine):
        draft, verifier = DraftWorker(engine.draft, engine.head), VerifierWorker(engine.target)
        verifier.link = FeatureLink([draft])
        self.draft, self.verifier = DraftServicer(draft), VerifierServicer(verifier)
        self.verdict_states = 0
        verify = self.verifier.Verify

        def counted(request, context):
            reply = verify(request, context)
            self.verdict_states += sum(verdict.HasField("features") for verdict in reply.verdicts)
            return reply

        self.verifier.Verify = counted
        self.servers = [start_server(draft=self.draft, verifier=self.verifier)]

    @property
    def addresses(self) -> tuple[str, str]:
        return self.servers[0][1], self.servers[0][1]


class RecordingTransport(GrpcTransport):
    """Records every item it sends: (role, session id, full, tail length); `after_verify(n)` runs
    after the n-th verify call (tests evict sessions there)."""

    def __init__(self, *args, after_verify=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent, self.calls, self.after_verify = [], {"draft": 0, "verifier": 0}, after_verify

    async def propose(self, items, plan, draft="default"):
        self.calls["draft"] += 1
        self.sent += [("draft", i.session_id, i.history.full, len(i.history.tail)) for i in items]
        return await super().propose(items, plan, draft)

    async def verify(self, items, probe_tokens=0):
        self.calls["verifier"] += 1
        self.sent += [("verifier", i.session_id, i.history.full, len(i.history.tail)) for i in items]
        reply = await super().verify(items, probe_tokens)
        if self.after_verify:
            self.after_verify(self.calls["verifier"])
        return reply


def run(loop: RoundLoop, requests: list[tuple[list[int], object]]) -> list:
    async def all_at_once():
        return await asyncio.gather(*(loop.generate(prompt, params) for prompt, params in requests),
                                    return_exceptions=True)
    return asyncio.run(all_at_once())


@pytest.fixture(scope="module")
def servers(tiny_engine):
    servers = Servers(tiny_engine)
    yield servers
    servers.stop()


def engine_ids(engine: SpecDecEngine, prompt, params) -> tuple[list[int], str]:
    completion = engine.generate_ids(prompt, params).completions[0]
    return completion.token_ids, completion.finish_reason


@pytest.mark.parametrize("policy,k", [("target-only", None), ("fixed", 3), ("svip", 4), ("heuristic", 2)])
def test_greedy_matches_engine_with_deltas(servers, tiny_engine, policy, k):
    transport = RecordingTransport(*servers.addresses)
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(overlap="off"))  # a round drafted ahead sends candidates
    params = build_params(policy=policy, k=k, max_new_tokens=MAX_NEW_TOKENS)
    [result] = run(loop, [(PROMPTS[0], params)])
    completion = result.completions[0]
    assert (completion.token_ids, completion.finish_reason) == engine_ids(tiny_engine, PROMPTS[0], params)
    roles = {role for role, *_ in transport.sent}
    assert roles == ({"verifier"} if policy == "target-only" else {"draft", "verifier"})
    for role in roles:  # the prompt travels once, in full; then each round's committed tokens (n + 1)
        sent = [(full, tail) for r, _, full, tail in transport.sent if r == role]
        assert sent[0] == (True, len(PROMPTS[0])) and not any(full for full, _ in sent[1:])
        assert sum(tail for _, tail in sent[1:]) == len(completion.token_ids) - 1
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0  # released at the end


def test_concurrent_requests_share_calls_and_equal_the_engine(servers, tiny_engine):
    """Four requests (one with three samples) at once: one batched call per step per role."""
    transport = RecordingTransport(*servers.addresses)
    loop = RoundLoop(transport, tiny_engine.rules)
    requests = [(PROMPTS[0], build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)),
                (PROMPTS[1], build_params(policy="svip", max_new_tokens=MAX_NEW_TOKENS)),
                (PROMPTS[2], build_params(policy="target-only", max_new_tokens=24)),
                (PROMPTS[3], build_params(policy="fixed", k=2, temperature=1.0, seed=5, n=3,
                                          max_new_tokens=MAX_NEW_TOKENS))]
    results = run(loop, requests)
    rounds = sum(result.stats.rounds for result in results)
    assert transport.calls["verifier"] < rounds / 3
    for (prompt, params), result in zip(requests, results):
        expected = tiny_engine.generate_ids(prompt, params)
        if params.sampling.greedy:  # (an int8 draft's draws depend on what shares its steps: specdec/loop.py)
            assert [c.token_ids for c in result.completions] == [c.token_ids for c in expected.completions]
        assert all(c.finish_reason for c in result.completions)
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0


def test_loops_calling_one_verifier_at_once_share_its_passes_and_equal_the_engine(tiny_engine):
    """Three coordinators' loops (in one event loop) call one verifier (its torch thread, as a replica's): the Verify
    calls that wait for that thread together run as one pass (VerifyBatcher), and every output
    equals the engine's. Each pass is slowed so that the calls meet."""
    from concurrent.futures import ThreadPoolExecutor

    class Slow(VerifierWorker):
        passes = 0

        def verify(self, items, probe_tokens=0):
            Slow.passes += 1
            time.sleep(0.02)
            return super().verify(items, probe_tokens)

    executor = ThreadPoolExecutor(max_workers=1)
    verifier = VerifierServicer(Slow(tiny_engine.target), executor)
    draft = DraftServicer(DraftWorker(tiny_engine.draft, tiny_engine.head))
    servers = [start_server(draft=draft), start_server(verifier=verifier)]
    transports = [RecordingTransport(servers[0][1], servers[1][1]) for _ in range(3)]
    params = build_params(policy="fixed", k=2, max_new_tokens=MAX_NEW_TOKENS)

    async def coordinator(i: int) -> list:
        loop = RoundLoop(transports[i], tiny_engine.rules)
        return await asyncio.gather(*(loop.generate(prompt, params) for prompt in (PROMPTS[i], PROMPTS[3])))

    async def coordinators() -> list:  # (one event loop: grpc.aio serves one a process)
        return await asyncio.gather(*(coordinator(i) for i in range(3)))

    try:
        results = asyncio.run(coordinators())
    finally:
        for server, _ in servers:
            server.stop(None)
        executor.shutdown()
    for i in range(3):
        assert [r.completions[0].token_ids for r in results[i]] == \
            [engine_ids(tiny_engine, prompt, params)[0] for prompt in (PROMPTS[i], PROMPTS[3])]
    calls = sum(t.calls["verifier"] for t in transports)
    assert verifier.batcher.shared_calls > 0 and Slow.passes < calls, (verifier.batcher.shared_calls, Slow.passes, calls)
    assert len(verifier.sessions) == len(draft.sessions) == 0


def verify_together(worker, calls: list[list]) -> tuple[servicers.VerifyBatcher, dict]:
    """Each of `calls` made to a VerifyBatcher over `worker` from a thread of its own while the torch
    thread is held, so that all of them wait for it together, then the thread freed; the batcher, and
    each call's answer or RuntimeError by its index."""
    from concurrent.futures import ThreadPoolExecutor

    executor, release = ThreadPoolExecutor(max_workers=1), threading.Event()
    batcher = servicers.VerifyBatcher(worker, executor)
    executor.submit(release.wait)  # the torch thread busy while the calls arrive
    answers = {}

    def call(i, items):
        try:
            answers[i] = batcher.verify(items, 0)
        except RuntimeError as exc:
            answers[i] = exc

    threads = [threading.Thread(target=call, args=(i, items)) for i, items in enumerate(calls)]
    for thread in threads:
        thread.start()
    while len(batcher._waiting) < len(calls):
        time.sleep(0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    executor.shutdown()
    return batcher, answers


def test_a_shared_verification_pass_that_fails_runs_each_call_alone():
    """Calls that waited together share a pass; where it fails, each runs alone: the call that
    fails alone fails, the others are answered. A call naming a session that one before it does (a
    call retried while the one it gave up on waits) goes in a pass of its own. (A worker stand-in:
    items are their session ids.)"""

    class Item(str):
        @property
        def session_id(self) -> str:
            return str(self)

    class Timing(str):
        probe = False

    class Worker:
        def __init__(self):
            self.passes, self.timings = [], []

        def verify(self, items, probe_tokens=0):
            self.passes.append(list(items))
            self.timings.append(Timing(f"pass {len(self.passes)}"))
            if "poison" in items:
                raise RuntimeError("a bad pass")
            return [f"verdict {item}" for item in items]

        def take_timings(self):
            taken, self.timings = self.timings, []
            return taken

    for calls in ([["a1", "a2"], ["b1"]], [["a1", "a2"], ["poison"], ["b1"]], [["a1"], ["a1"]]):
        calls = [[Item(item) for item in call] for call in calls]
        worker = Worker()
        batcher, answers = verify_together(worker, calls)
        answers = {i: str(a) if isinstance(a, RuntimeError) else a for i, a in answers.items()}
        if calls[0] == calls[1]:  # one session in two calls: a pass each, both answered
            assert worker.passes == calls and batcher.shared_calls == 0
            assert sorted(answers.values()) == [(["verdict a1"], ["pass 1"]), (["verdict a1"], ["pass 2"])]
            continue
        assert sorted(map(sorted, worker.passes[:1])) == [sorted(sum(calls, []))]  # one pass for all first
        if "poison" not in sum(calls, []):
            assert len(worker.passes) == 1 and batcher.shared_calls == 2
            assert answers == {0: (["verdict a1", "verdict a2"], ["pass 1"]), 1: (["verdict b1"], ["pass 1"])}
        else:
            assert sorted(map(tuple, worker.passes[1:])) == sorted(map(tuple, calls)) and batcher.shared_calls == 0
            assert answers[1] == "a bad pass"
            assert answers[0][0] == ["verdict a1", "verdict a2"] and answers[2][0] == ["verdict b1"]
            assert {answers[0][1][0], answers[2][1][0]} <= {"pass 2", "pass 3", "pass 4"}


def test_a_verification_run_that_breaks_names_its_cause_to_every_caller(monkeypatch):
    """A bug in the batcher's own run (here its cut into passes) fails every call that waited for
    it, each with the bug as its error's cause: the run's executor future, where the bug itself
    would end, is read by no one, so without it the logs show only that no pass answered."""
    def broken_cut(calls):
        raise ValueError("a broken cut")

    monkeypatch.setattr(servicers.VerifyBatcher, "_passes", staticmethod(broken_cut))
    _, errors = verify_together(None, [[VerifyItem(f"s{i}", HistoryDelta(1, [1], True), [], [], SamplingParams(),
                                                   RoundSeed(0, 0, 0))] for i in range(2)])  # (no worker called)
    assert sorted(errors) == [0, 1] and all(isinstance(exc, RuntimeError) for exc in errors.values())
    assert all(isinstance(exc.__cause__, ValueError) for exc in errors.values()), errors


class PlanRecordingTransport(GrpcTransport):
    """Records the plan every Propose carries, and its items."""

    def __init__(self, *args):
        super().__init__(*args)
        self.plans, self.items = [], []

    async def propose(self, items, plan, draft="default"):
        self.plans.append(plan)
        self.items.append(items)
        return await super().propose(items, plan, draft)


def test_the_costs_travel_with_the_calls(tiny_engine):
    """Served, the replicas time their passes and send the timings back; the loop's live profile
    goes out with the next Propose, where the draft replica's budget plans with it. Before anything
    is measured the first step drafts nothing: its one item carries an off-probe (the replicas'
    start-up probes come back with the replies) and no costs; the output is target-only's."""
    from specdec.head import AcceptanceHead, HeadConfig

    head = AcceptanceHead(HeadConfig(hidden_size=tiny_engine.draft.hidden_size, depth=0, draft_identity="x")).eval()
    draft = DraftServicer(DraftWorker(tiny_engine.draft, head))
    verifier = VerifierServicer(VerifierWorker(tiny_engine.target))
    for servicer in (draft, verifier):  # as the replicas do: the probes' timings go out with the first replies
        servicer.worker.probe_at_first_batch()
    servers = [start_server(draft=draft), start_server(verifier=verifier)]
    try:
        transport = PlanRecordingTransport(servers[0][1], servers[1][1])
        rules = tiny_engine.rules.__class__(None, tiny_engine.eos_token_ids, tiny_engine.max_context,
                                            tiny_engine.target.vocab_size, HEADED)
        # Every step that keeps the draft off carries an off-probe, so a Propose follows the first
        # measurement whether or not this machine's timings make drafting pay.
        loop = RoundLoop(transport, rules, probe_share=1e9)
        params = build_params(policy="specdec++cost", k=3, max_new_tokens=MAX_NEW_TOKENS)
        [result] = run(loop, [(PROMPTS[0], params)])
        assert transport.plans[0].costs is None and [item.probe for item in transport.items[0]] == [True]
        assert result.stats.held["not_measured"] == 1
        measured = [plan.costs for plan in transport.plans[1:] if plan.costs is not None]
        assert measured and measured[-1].source.startswith("measured in the loop")
        assert loop.costs["default"].curve("draft") and loop.costs["default"].curve("verifier")
        plain = build_params(policy="target-only", max_new_tokens=MAX_NEW_TOKENS)
        assert result.completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[0], plain)[0]
    finally:
        for server, _ in servers:
            server.stop(None)


def test_a_served_fused_draft_drafts_its_suffix_where_the_model_is_held(tiny_engine):
    """A fused draft (the suffix beside the model) served: the loop's plan holds the model for a
    session where no model round pays and sends it all the same, `held` (its suffix drafts), with
    the model's acceptance for the replica's budget; the output is target-only's."""
    from specdec.cost_profile import CostProfile
    from specdec.head import AcceptanceHead, HeadConfig
    from specdec.models.runtime import DraftRuntime
    from specdec.models.suffix import SuffixDraft

    fused = DraftRuntime(tiny_engine.draft.model)
    fused.suffix = SuffixDraft(fused.vocab_size)
    head = AcceptanceHead(HeadConfig(hidden_size=fused.hidden_size, depth=0, draft_identity="x")).eval()
    servers = [start_server(draft=DraftServicer(DraftWorker(fused, head))),
               start_server(verifier=VerifierServicer(VerifierWorker(tiny_engine.target)))]
    try:
        transport = PlanRecordingTransport(servers[0][1], servers[1][1])
        rules = tiny_engine.rules.__class__(None, tiny_engine.eos_token_ids, tiny_engine.max_context,
                                            tiny_engine.target.vocab_size, {"default": DraftTraits(True, fused=True)})
        loop = RoundLoop(transport, rules)
        for planner in loop.planners:  # a model step as dear as a target pass: no model round pays
            planner.given = CostProfile(t_draft_ms=20.0, t_target_ms={1: 10.0, 2: 10.5, 16: 12.0, 64: 16.0})
        prompt = PROMPTS[1] * 3  # the suffix continues its repeats
        [result] = run(loop, [(prompt, build_params(max_new_tokens=MAX_NEW_TOKENS))])
        plain = build_params(policy="target-only", max_new_tokens=MAX_NEW_TOKENS)
        assert result.completions[0].token_ids == engine_ids(tiny_engine, prompt, plain)[0]
        assert all(item.held for items in transport.items for item in items)
        assert all(plan.acceptance is not None for plan in transport.plans)
        assert result.stats.accepted_tokens > 0 and result.stats.draft_forward_passes == 0  # the suffix's rounds
    finally:
        for server, _ in servers:
            server.stop(None)


@pytest.mark.parametrize("top_k,top_p,seed", [(0, 1.0, 1234), (50, 0.9, 1234), (0, 1.0, -1)])
def test_seeded_sampling_matches_engine(servers, tiny_engine, top_k, top_p, seed):
    """Served and in process, a seeded request draws the same numbers; a negative seed (the gRPC
    API's int64) as well, though rounds carry their seed as a uint64. Nothing drafted ahead: a round
    drafted ahead feeds the int8 draft in passes of other sizes, so its q, and what a sampled round
    draws from it, differ in the last bits (docs/architecture.md, "Numerics under batching"); with
    overlap "auto" the planner drafted ahead where its timings said so, and 1 run in 25 differed."""
    loop = RoundLoop(GrpcTransport(*servers.addresses), tiny_engine.rules, BatchConfig(overlap="off"))
    params = build_params(policy="fixed", k=3, temperature=1.0, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=MAX_NEW_TOKENS)
    [result] = run(loop, [(PROMPTS[0], params)])
    assert (result.completions[0].token_ids, result.completions[0].finish_reason) == \
        engine_ids(tiny_engine, PROMPTS[0], params)
    assert result.stats.draft_tokens > 0


@pytest.fixture(scope="module")
def agreeing_engine(tiny_pair):
    """The tiny target drafting for itself, the draft int8: they agree mostly, not always."""
    from specdec.builder import EngineConfig, build_engine

    return build_engine(EngineConfig(draft=str(tiny_pair[1]), target=str(tiny_pair[1])), progress=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rounds_drafted_ahead_over_grpc_equal_the_engines(agreeing_engine, temperature):
    """Every round drafted while the one before verifies (overlap on), the draft's and the
    verifier's calls at once over gRPC: the outputs are the in-process loop's with overlap on, and
    greedy, the engine's without. The draft is told to drop the candidates verification rejected
    (HistoryDelta.drop) rather than sent the whole history again."""
    engine, overlap = agreeing_engine, BatchConfig(overlap="on")
    params = build_params(policy="fixed", k=3, temperature=temperature, seed=99, max_new_tokens=MAX_NEW_TOKENS)
    servers = Servers(engine)
    try:
        transport = RecordingTransport(*servers.addresses)
        [served] = run(RoundLoop(transport, engine.rules, overlap), [(PROMPTS[0], params)])
        drafts = [full for role, _, full, _ in transport.sent if role == "draft"]
        assert drafts[0] and not any(drafts[1:])  # the prompt once in full, then deltas only
        assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0
    finally:
        servers.stop()
    [local] = run(RoundLoop(engine.loop.calls.transport, engine.rules, overlap), [(PROMPTS[0], params)])
    assert served.completions[0].token_ids == local.completions[0].token_ids
    if temperature == 0.0:
        assert served.completions[0].token_ids == engine_ids(engine, PROMPTS[0], params)[0]
    assert served.stats.rounds_ahead == local.stats.rounds_ahead > served.stats.rounds_ahead_used
    if temperature == 0.0:  # sampled, the guess matches the target's bonus token where their draws agree (seldom here)
        assert served.stats.rounds_ahead_used > 0 and served.stats.discarded_tokens > 0


@pytest.fixture(scope="module")
def exact_engine(tiny_pair):
    """The tiny pair with an fp32 draft: a pass's outputs do not depend on how many tokens share it
    (the int8 draft's activation scale does), so a re-prefilled session draws what it drew before."""
    from specdec.builder import EngineConfig, build_engine

    return build_engine(EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1]), draft_format="fp32"),
                        progress=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_evicted_sessions_are_resent_in_full(exact_engine, temperature):
    params = build_params(policy="heuristic", k=2, temperature=temperature, seed=8, max_new_tokens=MAX_NEW_TOKENS)
    servers = Servers(exact_engine)

    def evict(verify_calls: int) -> None:  # a resend is a call too: the evictions stay apart
        if verify_calls in (2, 7):
            servers.draft.sessions.clear()
        if verify_calls in (4, 7):
            servers.verifier.sessions.clear()

    transport = RecordingTransport(*servers.addresses, after_verify=evict)
    try:
        [result] = run(RoundLoop(transport, exact_engine.rules, BatchConfig(overlap="off")),  # (as above)
                       [(PROMPTS[1], params)])
    finally:
        servers.stop()
    assert (result.completions[0].token_ids, result.completions[0].finish_reason) == \
        engine_ids(exact_engine, PROMPTS[1], params)
    assert result.stats.rounds > 5
    fulls = {role: [full for r, _, full, _ in transport.sent if r == role] for role in ("draft", "verifier")}
    # the first call of each role, then one resend after each eviction of that role's cache
    assert sum(fulls["draft"]) == 3 and sum(fulls["verifier"]) == 3
    history = [(tail, full) for r, _, full, tail in transport.sent if r == "draft"]
    assert history[2][1] is False and history[3][1] is True  # session_missing, then the whole history
    assert history[3][0] == len(PROMPTS[1]) + sum(tail for tail, _ in history[1:3])


def test_sparsified_draft_is_exact_for_what_it_sends(tiny_engine):
    """A draft that truncates q before sampling sends exactly that q: served output equals the
    in-process engine running the same truncated draft, and fewer bytes travel."""
    params = build_params(policy="fixed", k=3, temperature=0.7, seed=99, max_new_tokens=24)
    min_prob = 2e-3
    truncated = SpecDecEngine(tiny_engine.draft, tiny_engine.target, eos_token_ids=tiny_engine.eos_token_ids)
    truncated.draft_worker.proposer.logits_filter = sparsifier(min_prob)
    results, sizes = [], []
    for servers in (Servers(tiny_engine, min_prob=min_prob), Servers(tiny_engine)):
        try:
            [result] = run(RoundLoop(GrpcTransport(*servers.addresses), tiny_engine.rules, BatchConfig(overlap="off")),
                           [(PROMPTS[0], params)])  # (nothing drafted ahead: as above)
        finally:
            servers.stop()
        results.append(result.completions[0].token_ids)
        sizes.append(result.stats.transport_bytes / result.stats.draft_tokens)
    assert results[0] == truncated.generate_ids(PROMPTS[0], params).completions[0].token_ids
    assert results[1] == tiny_engine.generate_ids(PROMPTS[0], params).completions[0].token_ids
    assert sizes[0] < sizes[1]


# ------------------------------------------------------------------------------------------------
# Replicas that fail, cancellation

class FailoverTransport(GrpcTransport):
    """Two draft servers: sessions use the first until it stops answering, then the second."""

    def __init__(self, drafts: list[str], verifier: str):
        super().__init__(drafts[0], verifier)
        self.drafts, self.moved = drafts, False

    def _forget(self, served_by, session_id):
        if served_by.role == "draft":
            self._fixed[service("draft")], self.moved = self.drafts[1], True


@pytest.mark.parametrize("inside_a_call", [False, True], ids=["between calls", "inside its call"])
def test_a_lost_draft_replica_mid_batch_costs_a_retry_not_tokens(tiny_engine, inside_a_call):
    """Four sessions share every step; after two steps the draft replica dies, between calls or
    inside its third Propose (on the stream the calls share: that reply never comes). All four move
    to the other replica (resent in full) and every output equals the engine's."""
    primary, backup = Servers(tiny_engine), Servers(tiny_engine)
    transport = FailoverTransport([primary.addresses[0], backup.addresses[0]], primary.addresses[1])
    steps, calls, propose = 0, 0, primary.draft.worker.propose

    def dying(items, plan):
        nonlocal calls
        calls += 1
        if calls == 3:
            primary.servers[0][0].stop(None)  # from inside the call: its stream is cut before the reply
        return propose(items, plan)

    class Killing(RoundLoop):
        async def _step(self, planner, batch):
            nonlocal steps
            steps += 1
            if steps == 3:
                primary.servers[0][0].stop(None)  # the draft server goes away between calls
            await super()._step(planner, batch)

    if inside_a_call:
        primary.draft.worker.propose = dying
    requests = [(prompt, build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)) for prompt in PROMPTS]
    try:
        results = run((RoundLoop if inside_a_call else Killing)(transport, tiny_engine.rules, retry=FAST_RETRY), requests)
    finally:
        primary.stop()
        backup.stop()
    assert transport.moved and primary.draft.streams_opened == 1
    for (prompt, params), result in zip(requests, results):
        assert result.completions[0].token_ids == tiny_engine.generate_ids(prompt, params).completions[0].token_ids


def test_a_gone_replicas_channel_and_streams_are_let_go(tiny_engine):
    """The draft replica goes mid-generation and its sessions move to another: the transport keeps
    no channel or stream to the gone one's address. Kept, each replica that went (a restart, a
    downscale) left a channel trying to reconnect every two minutes or so for the coordinator's life."""
    primary, backup = Servers(tiny_engine), Servers(tiny_engine)
    transport = FailoverTransport([primary.addresses[0], backup.addresses[0]], primary.addresses[1])
    gone, steps = primary.addresses[0], 0

    class Killing(RoundLoop):
        async def _step(self, planner, batch):
            nonlocal steps
            steps += 1
            if steps == 3:
                primary.servers[0][0].stop(None)
            await super()._step(planner, batch)

    async def generate():
        loop = Killing(transport, tiny_engine.rules, retry=FAST_RETRY)
        params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
        results = await asyncio.gather(*(loop.generate(prompt, params) for prompt in PROMPTS[:2]))
        held = (set(transport._channels), {address for address, _ in transport._streams._idle})
        await transport.close()
        return results, held

    try:
        results, (channels, streams) = asyncio.run(generate())
    finally:
        primary.stop()
        backup.stop()
    assert transport.moved and all(result.completions[0].token_ids for result in results)
    assert gone not in channels and gone not in streams
    assert backup.addresses[0] in channels and backup.addresses[0] in streams  # the live ones stay


def test_the_round_calls_go_on_one_stream_per_replica_kept_across_steps(tiny_engine):
    """Every step's Propose and Verify are messages on one stream per replica, open for the whole
    request and closed with the transport: the server's thread comes back."""
    servers = Servers(tiny_engine)
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)

    async def generate():
        transport = GrpcTransport(*servers.addresses)
        result = await RoundLoop(transport, tiny_engine.rules).generate(PROMPTS[0], params)
        open_then = servers.draft.streams, servers.verifier.streams
        await transport.close()
        return result, open_then

    try:
        result, open_then = asyncio.run(generate())
        for _ in range(100):  # the server sees the cancel on its own thread
            if servers.draft.streams == servers.verifier.streams == 0:
                break
            time.sleep(0.05)
        assert open_then == (1, 1) and servers.draft.streams_opened == servers.verifier.streams_opened == 1
        assert servers.draft.streams == servers.verifier.streams == 0
        assert result.stats.rounds > 3
        assert result.completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[0], params)[0]
    finally:
        servers.stop()


def test_a_stream_that_breaks_under_its_write_reads_as_its_replica_gone():
    """The replica of a stream kept open goes between two steps: the next write fails in gRPC's core
    as INTERNAL ("Internal error from Core"), which would fail the sessions for good; it is the
    replica gone (UNAVAILABLE: the loop retries them elsewhere), and the stream is closed."""

    class Broken:
        cancelled = False

        def done(self) -> bool:
            return False

        async def write(self, request) -> None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Internal error from Core")

        def cancel(self) -> None:
            self.cancelled = True

    streams, broken = RoundStreams(), Broken()
    streams._idle[("gone:1", "Propose")] = [broken]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(streams.call(None, "gone:1", "Propose", draft_pb2.ProposeBatch(), 1.0, ()))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and broken.cancelled


@pytest.mark.parametrize("refusal", ["no key", "too many streams"])
def test_a_refused_stream_says_why_every_time(tiny_engine, monkeypatch, refusal):
    """A new stream's first message waits until the replica accepts it: written at once, it raced the
    refusal and about one call in ten failed as INTERNAL ("Internal error from Core") instead of
    UNAUTHENTICATED, or instead of falling back to a unary call."""
    monkeypatch.setattr(servicers, "MAX_STREAMS", 0 if refusal == "too many streams" else servicers.MAX_STREAMS)
    servers = Servers(tiny_engine, api_key="round-key" if refusal == "no key" else None)
    batch = draft_pb2.ProposeBatch(items=[propose_item()])

    async def open_streams() -> Counter:
        outcomes = Counter()
        for _ in range(40):
            streams, address = RoundStreams(), servers.addresses[0]
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    reply = await streams.call(draft_pb2_grpc.DraftStub(channel), address, "Propose", batch, 30.0, ())
                    outcomes["unary" if reply is None else "reply"] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1
        return outcomes

    try:
        outcomes = asyncio.run(open_streams())
    finally:
        servers.stop()
    assert outcomes == Counter({"UNAUTHENTICATED" if refusal == "no key" else "unary": 40})


def test_streams_cancelled_as_they_open_free_their_place(tiny_engine):
    """A stream its caller cancels before the first answer never runs the servicer's generator: the
    count was lowered in its `finally`, so such streams stayed counted until the replica refused
    every stream (MAX_STREAMS), though none was open."""
    import queue

    servers = Servers(tiny_engine)
    try:
        stub = draft_pb2_grpc.DraftStub(grpc.insecure_channel(servers.addresses[0]))
        for _ in range(8 * servicers.MAX_STREAMS):
            waiting = queue.Queue()
            call = stub.ProposeStream(iter(waiting.get, None))
            call.cancel()
            waiting.put(None)
        for _ in range(200):  # the server sees the cancels on its own threads
            if servers.draft.streams == 0:
                break
            time.sleep(0.05)
        assert servers.draft.streams == 0 and servers.draft.streams_opened > servicers.MAX_STREAMS
        replies = list(stub.ProposeStream(iter([draft_pb2.ProposeBatch(items=[propose_item()])])))
        assert len(replies) == 1 and replies[0].proposals[0].candidates
    finally:
        servers.stop()


def test_a_replica_that_holds_its_most_streams_is_called_unary(tiny_engine, monkeypatch):
    """A replica refuses a stream past its most (services/servicers.py MAX_STREAMS): the calls go
    unary there and the output is the same."""
    monkeypatch.setattr(servicers, "MAX_STREAMS", 0)
    servers = Servers(tiny_engine)
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    try:
        [result] = run(RoundLoop(GrpcTransport(*servers.addresses), tiny_engine.rules), [(PROMPTS[1], params)])
    finally:
        servers.stop()
    assert servers.draft.streams_opened == servers.verifier.streams_opened == 0
    assert result.completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[1], params)[0]


class WithoutStreams(grpc.ServerInterceptor):
    """A replica of a version before the round streams (a rolling upgrade's old replicas): its
    server knows no ProposeStream or VerifyStream, and gRPC answers them UNIMPLEMENTED. `methods`:
    the calls that reached it, by method."""

    def __init__(self):
        self.methods = Counter()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rsplit("/", 1)[-1]
        self.methods[method] += 1
        return None if method.endswith("Stream") else continuation(handler_call_details)


def test_a_replica_without_the_round_streams_is_called_unary(tiny_engine):
    """A draft and a verifier replica of an earlier version answer the streams UNIMPLEMENTED: the
    calls go unary there, each replica's stream tried once, and the output is the same (the answer
    was taken for the replica gone, and the sessions were retried there until they failed)."""
    from concurrent.futures import ThreadPoolExecutor

    old = WithoutStreams()
    servers = [grpc.server(ThreadPoolExecutor(max_workers=4), interceptors=[old]) for _ in range(2)]
    draft = DraftServicer(DraftWorker(tiny_engine.draft, tiny_engine.head))
    draft_pb2_grpc.add_DraftServicer_to_server(draft, servers[0])
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(VerifierWorker(tiny_engine.target)), servers[1])
    addresses = [f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" for server in servers]
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    try:
        for server in servers:
            server.start()
        loop = RoundLoop(GrpcTransport(*addresses), tiny_engine.rules, retry=FAST_RETRY)
        [result] = run(loop, [(PROMPTS[2], params)])
    finally:
        for server in servers:
            server.stop(None)
    assert not isinstance(result, BaseException), result
    assert result.completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[2], params)[0]
    assert old.methods["ProposeStream"] == old.methods["VerifyStream"] == 1
    assert old.methods["Propose"] > 3 and old.methods["Verify"] > 3  # every round, unary


class TwoVerifiers(GrpcTransport):
    """Sessions alternate between two verifier servers, in the order they first show up."""

    def __init__(self, draft: str, verifiers: list[str]):
        super().__init__(draft, verifiers[0])
        self.verifiers, self.owners = verifiers, {}

    async def _owner(self, served_by, session_id):
        return self._known_owner(served_by, session_id)

    def _known_owner(self, served_by, session_id):
        if served_by.role == "draft":
            return self._fixed[served_by]
        return self.owners.setdefault(session_id, self.verifiers[len(self.owners) % 2])


def test_a_replica_that_fails_for_good_fails_only_its_own_sessions(servers, tiny_engine):
    """One of two verifier replicas crashes on every batch (a bug: INTERNAL, "internal error"); the
    sessions it holds fail in one line, the other replica's sessions in the same steps finish."""
    class Crashing(VerifierWorker):
        def verify(self, items, probe_tokens=0):
            raise RuntimeError("boom")

    broken = VerifierServicer(Crashing(tiny_engine.target))
    server, address = start_server(verifier=broken)
    transport = TwoVerifiers(servers.addresses[0], [servers.addresses[1], address])
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    try:
        results = run(RoundLoop(transport, tiny_engine.rules, retry=FAST_RETRY), [(p, params) for p in PROMPTS])
    finally:
        server.stop(None)
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 2 and all(str(r) == "INTERNAL: internal error" for r in failed)  # no traceback
    for prompt, result in zip(PROMPTS, results):
        if not isinstance(result, Exception):
            assert result.completions[0].token_ids == engine_ids(tiny_engine, prompt, params)[0]
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0


@pytest.mark.parametrize("streams", [True, False], ids=["on a stream", "unary"])
def test_an_answer_that_does_not_convert_back_fails_its_call_once(tiny_engine, monkeypatch, streams):
    """A verifier replica whose answers do not convert back to the wire (a bug) fails the call as any
    bug does (INTERNAL, "internal error"), once: building the reply raised past the servicer's
    handling, and gRPC answered UNKNOWN with the exception's text, which the coordinator took for a
    replica gone and retried until its retries ran out (then UNAVAILABLE: the client retried it all)."""
    if not streams:
        monkeypatch.setattr(servicers, "MAX_STREAMS", 0)

    class Garbled(VerifierWorker):
        calls = 0

        def verify(self, items, probe_tokens=0):
            Garbled.calls += bool(items)  # (a curve probe carries none)
            return [object() for _ in items]  # no verdict, no refusal: verdict_to_proto raises

    servers = Servers(tiny_engine)
    server, address = start_server(verifier=VerifierServicer(Garbled(tiny_engine.target)))
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    try:
        [result] = run(RoundLoop(GrpcTransport(servers.addresses[0], address), tiny_engine.rules, retry=FAST_RETRY),
                       [(PROMPTS[0], params)])
    finally:
        server.stop(None)
        servers.stop()
    assert isinstance(result, RuntimeError) and str(result) == "INTERNAL: internal error"
    assert Garbled.calls == 1


class Ring:
    """A Serve deployment handle over real round servers, as HandleTransport calls it: each call goes
    to the replica the consistent hash router picks for its session id (`place`: the index of a
    server, swapped to change the ring), and a replica's answer names it (services/replicas.py).
    `answered` records each round call: (the answering address, its sessions)."""

    def __init__(self, servicers: dict[str, DraftServicer | VerifierServicer], place=lambda session_id: 0):
        self.servicers, self.place, self.answered = servicers, place, []

    def options(self, session_id: str = "", **_):
        ring, address = self, list(self.servicers)[self.place(session_id)]

        class Method:
            def __init__(self, name: str):
                self.name = name

            def remote(self, payload: bytes | None = None):
                async def answer():
                    if self.name == "address":
                        return address
                    servicer = ring.servicers[address]
                    request_type = draft_pb2.ProposeBatch if self.name == "propose" else verifier_pb2.VerifyBatch
                    request = request_type.FromString(payload)
                    reply = await asyncio.to_thread(getattr(servicer, self.name.capitalize()), request, None)
                    ring.answered.append((address, [item.session_id for item in request.items]))
                    reply.replica = address
                    return reply.SerializeToString()
                return answer()

        class Handle:
            def options(self, session_id: str = "", **_):
                return ring.options(session_id)

            def __getattr__(self, name):
                return Method(name)

        return Handle()


@pytest.mark.parametrize("change", ["swap", "reshuffle"])
def test_handle_calls_follow_a_changed_ring_and_release_what_they_left(tiny_engine, change):
    """`serve-grpc` / `actor`: a replica is added or replaced, and the router sends session ids to
    other replicas than before (`swap`: every id to the other one; `reshuffle`: the ids the groups
    go by to the other one, the others as a new hash says).
    A group that lands elsewhere is rebuilt there; then each of its sessions goes where its own id
    leads, and every copy it leaves is released (they waited for their TTL, and a group routed by its first
    session's id moved whole again each time that session changed)."""
    draft = DraftServicer(DraftWorker(tiny_engine.draft, tiny_engine.head))
    verifiers = [VerifierServicer(VerifierWorker(tiny_engine.target)) for _ in range(2)]
    servers = [start_server(draft=draft)] + [start_server(verifier=verifier) for verifier in verifiers]
    addresses = [address for _, address in servers]
    changed: list[set[str]] = []  # once changed: the ids the groups went by

    def place(session_id: str) -> int:
        before = zlib.crc32(session_id.encode()) % 2
        if not changed:
            return before
        if change == "swap" or session_id in changed[0]:
            return 1 - before
        return zlib.crc32(session_id.encode() + b"+") % 2

    ring = Ring(dict(zip(addresses[1:], verifiers)), place)

    class Changing(HandleTransport):
        async def verify(self, items, probe_tokens=0):
            reply = await super().verify(items, probe_tokens)
            if len(ring.answered) >= 6 and not changed:
                changed.append(set(self._routes.values()))
            return reply

    transport = Changing(Ring({addresses[0]: draft}), ring)
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    prompts = PROMPTS * 2  # 8 sessions, so that some stay and some move under `reshuffle`
    try:
        results = run(RoundLoop(transport, tiny_engine.rules), [(p, params) for p in prompts])
        asyncio.run(transport.close())
    finally:
        for server, _ in servers:
            server.stop(None)
    for prompt, result in zip(prompts, results):
        assert result.completions[0].token_ids == engine_ids(tiny_engine, prompt, params)[0]
    where: dict[str, list[str]] = {}
    for address, session_ids in ring.answered:
        for session_id in session_ids:
            if where.setdefault(session_id, [address])[-1] != address:
                where[session_id].append(address)
    assert changed and len(where) == len(prompts)
    for session_id, replicas in where.items():  # one that moved ends where its own id leads (one that
        if len(replicas) > 1:                    # stayed went where its group's id still leads)
            assert replicas[-1] == addresses[1 + place(session_id)] and len(replicas) <= 3, replicas
    assert all(len(replicas) > 1 for replicas in where.values())  # every group landed elsewhere
    if change == "swap":
        assert all(len(replicas) == 2 for replicas in where.values())
    assert [len(verifier.sessions) for verifier in verifiers] == [0, 0] and len(draft.sessions) == 0


class Unanswered:
    """A Serve deployment handle whose round calls never answer (a replica stuck in a pass), as
    HandleTransport calls it: `responses` holds each call's DeploymentResponse stand-in, which
    records whether it was cancelled (DeploymentResponse.cancel cancels the call on its replica)."""

    class Response:
        cancelled = False

        def __await__(self):
            return asyncio.get_running_loop().create_future().__await__()  # (never set)

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self):
        self.responses: list[Unanswered.Response] = []

    def options(self, **_):
        return self

    def __getattr__(self, name: str):
        handle = self

        class Method:
            def remote(self, payload: bytes | None = None):
                if name == "address":
                    return asyncio.sleep(0, "stuck:1")
                handle.responses.append(Unanswered.Response())
                return handle.responses[-1]

        return Method()


async def give_up_on_a_call(transport: HandleTransport, end: str, begun) -> None:
    """A Propose through `transport` that it gives up on: `timeout` (its call timeout passes), or
    `cancelled` (its caller cancelled, once `begun()` says the replica took it)."""
    sent = asyncio.create_task(transport._send(service("draft"), "stuck:1", "Propose",
                                               draft_pb2.ProposeBatch(items=[propose_item()]), "s"))
    if end == "timeout":
        with pytest.raises(ReplicaGone):
            await sent
    else:
        while not await begun():
            await asyncio.sleep(0.01)
        sent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sent
    await transport.close()


@pytest.mark.parametrize("end", ["timeout", "cancelled"])
def test_a_handle_call_given_up_is_cancelled_on_its_replica(end):
    """`serve-grpc` / `actor`: a round call that has no answer within the call timeout, or whose
    caller is cancelled, is cancelled on its replica: the DeploymentResponse was left running there
    (a Ray actor call goes on when only its wait is cancelled: test_serve_handle_cancel.py)."""
    draft = Unanswered()

    async def begun() -> bool:
        return bool(draft.responses)

    async def call():
        transport = HandleTransport(draft, Unanswered())
        transport.timeout_s = 0.05 if end == "timeout" else 60.0
        await give_up_on_a_call(transport, end, begun)

    asyncio.run(call())
    assert len(draft.responses) == 1 and draft.responses[0].cancelled

def test_a_cancelled_session_leaves_the_others_unchanged(servers, tiny_engine):
    transport = RecordingTransport(*servers.addresses)
    loop = RoundLoop(transport, tiny_engine.rules)
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)

    async def scenario():
        tasks = [asyncio.create_task(loop.generate(prompt, params)) for prompt in PROMPTS]
        while transport.calls["verifier"] < 2:
            await asyncio.sleep(0.001)
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(scenario())
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        assert results[i].completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[i], params)[0]
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0  # the cancelled one's too
    assert loop.live_sessions == 0


def one_spoilt(servers, tiny_engine, spoil) -> list:
    """PROMPTS[:3] served at once, `spoil(item)` applied to every item of the second's session the
    transport sends (Propose and Verify alike); the others must come out as the engine's."""
    class Spoiling(GrpcTransport):
        async def propose(self, items, plan, draft="default"):
            return await super().propose(self._spoilt(items), plan, draft)

        async def verify(self, items, probe_tokens=0):
            return await super().verify(self._spoilt(items), probe_tokens)

        @staticmethod
        def _spoilt(items):
            for item in items:
                if victim and item.session_id.startswith(victim[0]):
                    spoil(item)
            return items

    victim: list[str] = []
    loop = RoundLoop(Spoiling(*servers.addresses), tiny_engine.rules)
    params = build_params(policy="fixed", k=3, max_new_tokens=16)

    async def scenario():
        tasks = [asyncio.create_task(loop.generate(prompt, params)) for prompt in PROMPTS[:3]]
        await asyncio.sleep(0)
        victim.append(next(s.session_id for lane in loop._lanes for s in lane if s.sample.prompt == PROMPTS[1])[:32])
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(scenario())
    for i in (0, 2):
        assert results[i].completions[0].token_ids == engine_ids(tiny_engine, PROMPTS[i], params)[0]
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0
    return results


def test_a_refused_item_fails_only_its_session(servers, tiny_engine):
    """One session's item is malformed on the wire: that request fails in one line, the others in
    the same batch are served."""
    def out_of_vocabulary(item):
        if isinstance(item, VerifyItem):
            item.candidates = [10 ** 6]

    results = one_spoilt(servers, tiny_engine, out_of_vocabulary)
    assert isinstance(results[1], InvalidRequestError) and "candidate token ids" in str(results[1])
    assert "\n" not in str(results[1])


def test_an_item_the_wire_cannot_carry_fails_only_its_session(servers, tiny_engine):
    """One session's item cannot be written to the wire (a field out of its type's range): that
    request fails, the others in the same call are served."""
    def not_a_uint64(item):
        if not isinstance(item, VerifyItem):
            item.seed = RoundSeed(-1, item.seed.sample_index, item.seed.round_index)

    results = one_spoilt(servers, tiny_engine, not_a_uint64)
    assert isinstance(results[1], Exception) and "\n" not in str(results[1])


# ------------------------------------------------------------------------------------------------
# The services' wire: bad items, missing sessions, access

def propose_item(**overrides) -> draft_pb2.ProposeRequest:
    fields = dict(session_id="bad", history=common_pb2.HistoryDelta(history_length=3, tail=[1, 2, 3], full=True),
                  policy=draft_pb2.PolicyConfig(name="fixed"), sampling=common_pb2.SamplingParams(top_p=1.0),
                  max_candidates=3, seed=common_pb2.RoundSeed(request_seed=1))
    fields.update(overrides)
    return draft_pb2.ProposeRequest(**fields)


@pytest.fixture(scope="module")
def stubs(servers):
    channels = [grpc.insecure_channel(address) for address in servers.addresses]
    yield draft_pb2_grpc.DraftStub(channels[0]), verifier_pb2_grpc.VerifierStub(channels[1])
    for channel in channels:
        channel.close()


def assert_refused(answer, fragment: str) -> None:
    assert fragment in answer.error and "\n" not in answer.error and "Traceback" not in answer.error, answer.error


def test_bad_items_are_refused_one_by_one(stubs, servers):
    draft, verifier = stubs
    bad = [
        (propose_item(session_id="a", sampling=common_pb2.SamplingParams(top_p=0.0)), "top-p"),
        (propose_item(session_id="b", sampling=common_pb2.SamplingParams(temperature=-1.0, top_p=1.0)), "temperature"),
        (propose_item(session_id="c", policy=draft_pb2.PolicyConfig(name="nope")), "unknown policy"),
        (propose_item(session_id="d", policy=draft_pb2.PolicyConfig(name="fixed", k=0)), "at least 1"),
        (propose_item(session_id="e", history=common_pb2.HistoryDelta(history_length=4, tail=[1, 2], full=True)),
         "full history"),
        (propose_item(session_id="f", history=common_pb2.HistoryDelta(history_length=1, tail=[10 ** 6], full=True)),
         "token ids"),
        (propose_item(session_id="good"), None),
        (propose_item(session_id="good"), "appears twice"),
    ]
    reply = draft.Propose(draft_pb2.ProposeBatch(items=[item for item, _ in bad]))
    assert len(reply.proposals) == len(bad)
    for (_, fragment), answer in zip(bad, reply.proposals):
        if fragment is None:
            assert not answer.error and len(answer.candidates) == 3
        else:
            assert_refused(answer, fragment)
    assert draft.Release(common_pb2.SessionRefs(session_ids=["good", "a"])).released == [True, False]

    def verify_item(**fields):
        base = dict(session_id="v", history=common_pb2.HistoryDelta(history_length=2, tail=[1, 2], full=True),
                    candidates=[3], sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0))
        return verifier_pb2.VerifyRequest(**{**base, **fields})

    reply = verifier.Verify(verifier_pb2.VerifyBatch(items=[
        verify_item(session_id="v1", sampling=common_pb2.SamplingParams(temperature=float("nan"), top_p=1.0)),
        verify_item(session_id="v2"),
        verify_item(session_id="v3", draft_probs=[common_pb2.Distribution(
            token_ids=np.array([3, 3], dtype=np.int32).tobytes(), probs=np.array([0.5, 0.5], dtype=np.float32).tobytes())]),
        verify_item(session_id="v4", candidates=[10 ** 6], sampling=common_pb2.SamplingParams(top_p=1.0)),
        verify_item(session_id="v5", sampling=common_pb2.SamplingParams(top_p=1.0)),
        # an empty distribution failed the whole call (INTERNAL), v5 with it
        verify_item(session_id="v6", draft_probs=[common_pb2.Distribution()]),
        verify_item(session_id="v7", draft_probs=[common_pb2.Distribution(token_ids=np.array([3], np.int32).tobytes())]),
        # a candidate its q gives nothing: p / q was 0 / 0, and NaN accepted it
        verify_item(session_id="v8", draft_probs=[common_pb2.Distribution(
            token_ids=np.array([4], dtype=np.int32).tobytes(), probs=np.array([1.0], dtype=np.float32).tobytes())]),
    ]))
    for answer, fragment in zip(reply.verdicts, ["temperature", "one draft distribution per candidate", "distinct",
                                                 "candidate token ids", None, "needs its probs", "needs its probs",
                                                 "candidate 1 has draft probability 0"], strict=True):
        if fragment is None:
            assert not answer.error and not answer.session_missing
        else:
            assert_refused(answer, fragment)
    verifier.Release(common_pb2.SessionRefs(session_ids=["v5"]))
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0


@pytest.mark.parametrize("method", ["/specdec.v1.Verifier/Verify", "/specdec.v1.Verifier/VerifyStream"])
def test_bytes_that_are_not_the_message_are_invalid_argument_in_one_line(servers, method):
    """A peer built on another version of protos/, or a corrupt frame: gRPC said INTERNAL
    ("Exception deserializing request!") after logging a traceback. The server serves on."""
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length past the message's end
    with grpc.insecure_channel(servers.addresses[1]) as channel:
        if method.endswith("Stream"):
            call = lambda: list(channel.stream_stream(method)(iter([garbage]), timeout=30))  # noqa: E731
        else:
            call = lambda: channel.unary_unary(method)(garbage, timeout=30)  # noqa: E731
        with pytest.raises(grpc.RpcError) as info:
            call()
        stub = verifier_pb2_grpc.VerifierStub(channel)
        assert stub.Verify(verifier_pb2.VerifyBatch(), timeout=30).verdicts == []
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details.startswith(f"the request to {method} does not parse (") and "\n" not in details, details


def test_a_bad_cost_profile_fails_the_call_with_one_line(stubs, servers):
    """The plan is the call's, not an item's: a malformed profile is INVALID_ARGUMENT for the call."""
    draft, _ = stubs
    bad = common_pb2.CostProfile(t_draft_ms=1.0, t_target_ms={0: 5.0})
    with pytest.raises(grpc.RpcError) as info:
        draft.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="p")], costs=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cost profile" in info.value.details() and "\n" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        draft.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="p")], other_sessions=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        draft.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="p")], acceptance=1.5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "acceptance" in info.value.details()
    assert len(servers.draft.sessions) == 0


def test_missing_session_is_reported_not_guessed(stubs, servers):
    draft, verifier = stubs
    delta = common_pb2.HistoryDelta(history_length=5, tail=[4, 5], full=False)
    reply = draft.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="never", history=delta)]))
    assert reply.proposals[0].session_missing
    reply = verifier.Verify(verifier_pb2.VerifyBatch(items=[verifier_pb2.VerifyRequest(
        session_id="never", history=delta, sampling=common_pb2.SamplingParams(top_p=1.0))]))
    assert reply.verdicts[0].session_missing and not reply.verdicts[0].next_token
    assert "never" not in servers.draft.sessions and "never" not in servers.verifier.sessions


def test_expired_or_unknown_session_leaves_nothing_behind(tiny_engine):
    clock = FakeClock()
    servers = Servers(tiny_engine, draft_sessions=SessionStore(max_sessions=4, ttl_s=10.0, clock=clock))
    try:
        with grpc.insecure_channel(servers.addresses[0]) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            assert not stub.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="s")])).proposals[0].error
            clock.now = 11.0  # idle past the TTL: expired
            delta = common_pb2.HistoryDelta(history_length=5, tail=[4, 5], full=False)
            reply = stub.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="s", history=delta)]))
            assert reply.proposals[0].session_missing and len(servers.draft.sessions) == 0
            assert stub.Release(common_pb2.SessionRefs(session_ids=["s", "unknown"])).released == [False, False]
    finally:
        servers.stop()


def test_round_server_with_a_key_refuses_calls_without_it(tiny_engine):
    servers = Servers(tiny_engine, api_key="round-key")
    refs = common_pb2.SessionRefs(session_ids=["x"])
    try:
        with grpc.insecure_channel(servers.addresses[0]) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            for metadata in ((), (("authorization", "Bearer other"),), (("authorization", "round-key"),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Propose(draft_pb2.ProposeBatch(items=[propose_item()]), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:  # the round streams too
                next(stub.ProposeStream(iter([draft_pb2.ProposeBatch(items=[propose_item()])])))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(servers.draft.sessions) == 0  # refused before the servicer ran
            assert stub.Release(refs, metadata=(("authorization", "Bearer round-key"),)).released == [False]
        # the transport sends the key; without it the call's sessions fail with the reason
        loop = RoundLoop(GrpcTransport(*servers.addresses), tiny_engine.rules)
        [failed] = run(loop, [(PROMPTS[0], build_params(policy="fixed", k=2, max_new_tokens=8))])
        assert "API key" in str(failed)
        loop = RoundLoop(GrpcTransport(*servers.addresses, api_key="round-key"), tiny_engine.rules)
        [result] = run(loop, [(PROMPTS[0], build_params(policy="fixed", k=2, max_new_tokens=8))])
        assert len(result.completions[0].token_ids) == 8
    finally:
        servers.stop()


def test_a_probe_whose_verifier_went_looks_up_another(tiny_engine):
    """The curve probe goes to a verifier replica looked up like a session's (`direct`); once that
    replica is gone the next probe asks again: its owner was never forgotten, and every later probe
    went to the gone replica (failing, or hanging its lane's step for the call timeout)."""
    from services.transports import DirectTransport, ReplicaGone

    primary, backup = Servers(tiny_engine), Servers(tiny_engine)

    class Routed(DirectTransport):  # the router's answers, without Serve: the primary, then the backup
        def __init__(self):
            super().__init__(None, None)
            self.lookups = 0

        async def _look_up(self, served_by, session_id):
            self.lookups += 1
            return (primary if self.lookups == 1 else backup).addresses[1]

    async def probe_around_a_loss() -> list:
        transport = Routed()
        outcomes = [bool((await transport.verify([], probe_tokens=8)).passes)]
        primary.stop()
        for _ in range(2):
            try:
                outcomes.append(bool((await transport.verify([], probe_tokens=8)).passes))
            except ReplicaGone:
                outcomes.append("gone")
        await transport.close()
        return outcomes

    try:
        outcomes = asyncio.run(probe_around_a_loss())
    finally:
        backup.stop()
    assert outcomes == [True, "gone", True]


def test_a_probe_of_a_pass_size_travels_and_comes_back_timed(servers):
    """A Verify batch may ask for a scratch pass of a given size, with items (the probes while the
    draft is off) or without (the loop's curve probes): the replica times one after the batch and the
    timing comes back with the reply, marked a probe."""
    transport = GrpcTransport(*servers.addresses)
    item = VerifyItem("probe-size", HistoryDelta(0, [5, 6, 7], full=True), [], [], SamplingParams(), RoundSeed(1, 0, 0))

    async def both():
        return await transport.verify([item], probe_tokens=16), await transport.verify([], probe_tokens=8)

    reply, alone = asyncio.run(both())
    assert [(t.role, t.tokens) for t in reply.passes if t.probe] == [("verifier", 16)] and len(reply.answers) == 1
    assert [(t.role, t.tokens, t.probe) for t in alone.passes] == [("verifier", 8, True)] and alone.answers == []
    servers.verifier.worker.release(["probe-size"])


# ------------------------------------------------------------------------------------------------
# Conversions

def test_history_delta_worked_example():
    held = [1, 2, 3, 4, 5, 6, 7]
    delta = HistoryDelta(10, [8, 9, 10], full=False)
    assert history_from_delta(held, delta, vocab_size=100) == list(range(1, 11))
    assert history_from_delta(None, delta, vocab_size=100) is None
    assert history_from_delta(held[:-1], delta, vocab_size=100) is None  # length mismatch
    assert history_from_delta(held, HistoryDelta(2, [3, 4], full=True), vocab_size=100) == [3, 4]
    # a round drafted ahead after candidates 8 9: 8 was accepted, then 5 came instead of 9
    assert history_from_delta(held + [8, 9], HistoryDelta(9, [5], full=False, drop=1), 100) == held + [8, 5]
    assert history_from_delta(held + [8], HistoryDelta(9, [5], full=False, drop=1), 100) is None
    with pytest.raises(InvalidRequestError, match="drop"):
        history_from_delta(held, HistoryDelta(9, [5], full=False, drop=-1), vocab_size=100)
    with pytest.raises(InvalidRequestError, match="full history"):
        history_from_delta(None, HistoryDelta(3, [3, 4], full=True), vocab_size=100)
    # more new tokens than the history holds: served as a history of 10 where 2 were declared
    with pytest.raises(InvalidRequestError, match="a history of 2 tokens cannot end with 5 new ones"):
        history_from_delta(held + [8], HistoryDelta(2, [1, 2, 3, 4, 5], full=False, drop=11), vocab_size=100)


def test_packed_distributions_round_trip_exactly_sparse_or_dense():
    """A q with few nonzero entries travels as (id, prob) pairs, one mostly nonzero as all V probs:
    either way 4 bytes a number and rebuilt bit for bit; a malformed one is refused."""
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(300) * 3, dim=-1)
    q[::7] = 0.0
    q = q / q.sum()
    dense = pack_distribution(q)
    assert not dense.token_ids and len(dense.probs) == 4 * 300
    assert torch.equal(unpack_distribution(dense, 300), q)
    q[:250] = 0.0
    q = q / q.sum()
    sparse = pack_distribution(q)
    assert len(sparse.token_ids) == len(sparse.probs) == 4 * int((q > 0).sum())
    assert torch.equal(unpack_distribution(sparse, 300), q)
    half = np.array([0.5], dtype=np.float32).tobytes()
    for bad in (common_pb2.Distribution(token_ids=np.array([1], dtype=np.int32).tobytes(), probs=half),
                common_pb2.Distribution(probs=half), common_pb2.Distribution(probs=b"\x00" * 3),
                common_pb2.Distribution(token_ids=np.array([1, 2], dtype=np.int32).tobytes(), probs=half)):
        with pytest.raises(InvalidRequestError):
            unpack_distribution(bad, 300)


def test_sparsify_logits_keeps_argmax_and_drops_the_tail():
    logits = torch.tensor([5.0, 0.0, -20.0, 4.0, -30.0])
    sampling = SamplingParams(temperature=1.0)
    masked = sparsify_logits(logits, sampling, min_prob=1e-6)
    assert torch.isinf(masked[[2, 4]]).all() and torch.equal(masked[[0, 1, 3]], logits[[0, 1, 3]])
    assert torch.equal(sparsify_logits(logits, SamplingParams(), 0.5), logits)  # greedy: untouched
    assert int(torch.argmax(sparsify_logits(torch.zeros(4), sampling, min_prob=0.9))) == 0
    assert sparsifier(0.0) is None and sparsifier(1e-3)(SamplingParams()) is None


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_event_loop_at_a_time(servers, tiny_engine):
    loop = RoundLoop(GrpcTransport(*servers.addresses), tiny_engine.rules)
    params = build_params(policy="fixed", k=2, max_new_tokens=8)
    errors = []

    async def hold():
        task = asyncio.create_task(loop.generate(PROMPTS[0], params))
        await asyncio.sleep(0)
        thread = threading.Thread(target=lambda: errors.append(run(loop, [(PROMPTS[1], params)])[0]))
        thread.start()
        thread.join()
        return await task

    result = asyncio.run(hold())
    assert len(result.completions[0].token_ids) == 8
    assert isinstance(errors[0], RuntimeError) and "one event loop" in str(errors[0])


def test_the_llamacpp_runtime_serves_the_same_rounds(tmp_path):
    """Draft and verifier servers over llama.cpp runtimes (tiny GGUF files): the served loop's
    batched calls give what the in-process engine gives, every session released at the end."""
    from specdec.builder import EngineConfig, build_engine
    from specdec.models.llamacpp import LlamaCppOptions
    from tiny import byte_level_tokens, noisy_weights, tiny_gguf_weights, write_tiny_gguf

    weights = tiny_gguf_weights(len(byte_level_tokens()), 32, layers=2, ffn=64, seed=3, scale=0.3)
    draft = write_tiny_gguf(tmp_path / "draft.gguf", noisy_weights(weights, 0.05, seed=4))
    target = write_tiny_gguf(tmp_path / "target.gguf", weights)
    engine = build_engine(EngineConfig(draft=str(draft), target=str(target), head="none", threads=1,
                                       cache_dir=str(tmp_path / "cache"), llamacpp=LlamaCppOptions(threads=1)),
                          progress=False)
    servers = Servers(engine)
    try:
        loop = RoundLoop(RecordingTransport(*servers.addresses), engine.rules)
        requests = [(PROMPTS[0], build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)),
                    (PROMPTS[1], build_params(policy="svip", max_new_tokens=MAX_NEW_TOKENS)),
                    (PROMPTS[3], build_params(policy="target-only", max_new_tokens=24))]
        for (prompt, params), result in zip(requests, run(loop, requests)):
            completion = result.completions[0]
            assert (completion.token_ids, completion.finish_reason) == engine_ids(engine, prompt, params)
        assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0
    finally:
        servers.stop()


# ------------------------------------------------------------------------------------------------
# A feature draft served: the target's states ride with each Verdict and the next Propose

@pytest.fixture(scope="module")
def feature_engine(tiny_pair):
    from transformers import AutoModelForCausalLM

    from specdec.models.feature_runtime import FeatureDraftRuntime
    from specdec.models.runtime import TargetRuntime
    from tiny import tiny_feature_draft

    target = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    draft = FeatureDraftRuntime(tiny_feature_draft(target, vocab_ids=range(200), seed=3), identity="tiny-feature")
    return SpecDecEngine(draft, TargetRuntime(target), eos_token_ids=[target.config.eos_token_id])


PLACEMENTS = pytest.mark.parametrize("placement", [Servers, Colocated], ids=["separate", "colocated"])


@PLACEMENTS
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_served_feature_draft_equals_the_engine(feature_engine, temperature, placement):
    """On replicas of its own the states ride with the round calls; beside its target (one server for
    both, the workers linked) they go from worker to worker and no verdict carries them."""
    params = build_params(policy="fixed", k=3, temperature=temperature, seed=21, max_new_tokens=MAX_NEW_TOKENS)
    servers = placement(feature_engine)
    try:
        [result] = run(RoundLoop(GrpcTransport(*servers.addresses), feature_engine.rules), [(PROMPTS[1], params)])
    finally:
        servers.stop()
    assert (result.completions[0].token_ids, result.completions[0].finish_reason) == \
        engine_ids(feature_engine, PROMPTS[1], params)
    assert result.stats.draft_tokens > result.stats.rounds  # the states arrived: it drafted in most rounds
    assert len(servers.draft.sessions) == len(servers.verifier.sessions) == 0  # released, both
    if placement is Colocated:
        assert servers.verdict_states == 0 and not servers.verifier.worker.link._waiting


@PLACEMENTS
def test_a_served_feature_draft_survives_lost_sessions(feature_engine, placement):
    """Both replicas lose the session mid-generation: the draft's rebuilt session has no states (beside
    the target, what waited for it is dropped), so the next verification recomputes them from
    position 0 (its cache rolled back) and hands them over; nothing is guessed and the output is the
    target's."""
    params = build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)
    servers = placement(feature_engine)

    def evict(verify_calls: int) -> None:
        if verify_calls in (3, 9):
            servers.draft.sessions.clear()
        if verify_calls in (6, 9):
            servers.verifier.sessions.clear()

    transport = RecordingTransport(*servers.addresses, after_verify=evict)
    try:
        [result] = run(RoundLoop(transport, feature_engine.rules), [(PROMPTS[1], params)])
    finally:
        servers.stop()
    plain = build_params(policy="target-only", max_new_tokens=MAX_NEW_TOKENS)
    assert result.completions[0].token_ids == engine_ids(feature_engine, PROMPTS[1], plain)[0]
    assert sum(full for role, _, full, _ in transport.sent if role == "draft") == 3
    assert result.stats.draft_tokens > 0
    assert getattr(servers, "verdict_states", 0) == 0


def test_states_waiting_for_sessions_both_workers_let_go_are_dropped(feature_engine):
    """What waits for a session stays while the verifier or the draft holds it (an evicted session
    comes back for it) and goes once neither does (a replica's health check, after expiry)."""
    servers = Colocated(feature_engine)
    servers.stop()
    link, states = servers.verifier.worker.link, torch.zeros(2, 2, feature_engine.target.hidden_size)
    servers.verifier.sessions.put("verifying", object())
    servers.draft.sessions.put("drafting", object())
    for session_id in ("verifying", "drafting", "gone"):
        link._waiting[session_id] = [(states, 0)]
    link.keep(servers.verifier.sessions)
    assert set(link._waiting) == {"verifying", "drafting"}


def test_states_handed_over_during_the_health_checks_sweep_do_not_fail_it(feature_engine):
    """The health check sweeps the link on the replica's event loop while the torch thread may hand
    a verdict's states over: the sweep iterated the dict being grown (a RuntimeError fails the
    health check, and Serve restarts the replica)."""
    servers = Colocated(feature_engine)
    servers.stop()
    link, states = servers.verifier.worker.link, torch.zeros(2, 2, feature_engine.target.hidden_size)
    link._waiting["gone"] = [(states, 0)]

    class Verifying(dict):
        def __contains__(self, session_id):  # the torch thread hands states over mid-sweep
            link._waiting.setdefault("new", [(states, 0)])
            return session_id == "new"

    link.keep(Verifying())
    assert set(link._waiting) == {"new"}


def test_bad_features_are_refused_one_by_one(feature_engine):
    servers = Servers(feature_engine)
    try:
        draft = draft_pb2_grpc.DraftStub(grpc.insecure_channel(servers.addresses[0]))
        verifier = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(servers.addresses[1]))
        hidden, reads = feature_engine.target.hidden_size, 2
        whole = common_pb2.Features(start=0, tokens=2, reads=reads, hidden=hidden, data=bytes(2 * reads * hidden * 2))
        truncated = common_pb2.Features(start=0, tokens=2, reads=reads, hidden=hidden, data=whole.data[:-6])
        wide = common_pb2.Features(start=0, tokens=2, reads=3, hidden=hidden, data=bytes(2 * 3 * hidden * 2))
        reply = draft.Propose(draft_pb2.ProposeBatch(items=[
            propose_item(session_id="a", features=truncated), propose_item(session_id="b", features=wide),
            propose_item(session_id="c", features=common_pb2.Features(start=5, tokens=2, reads=reads, hidden=hidden,
                                                                       data=whole.data)),
            propose_item(session_id="d", features=common_pb2.Features(start=0, tokens=0, reads=reads, hidden=hidden)),
            propose_item(session_id="good", features=whole)]))
        for answer, fragment in zip(reply.proposals, ["need", "not [tokens", "past the history", "at least one token",
                                                      None], strict=True):
            if fragment is None:
                assert not answer.error and len(answer.candidates) == 3
            else:
                assert_refused(answer, fragment)
        # a refused rebuild changes nothing: it cleared the states the session held, then refused
        worker = servers.draft.worker
        held = worker.draft.features_held(worker.sessions.get("good").kv)
        for bad in (wide, common_pb2.Features(start=1, tokens=2, reads=reads, hidden=hidden, data=whole.data)):
            [answer] = draft.Propose(draft_pb2.ProposeBatch(items=[propose_item(session_id="good", features=bad)])).proposals
            assert answer.error and worker.draft.features_held(worker.sessions.get("good").kv) == held > 0
        history, greedy = common_pb2.HistoryDelta(history_length=2, tail=[1, 2], full=True), common_pb2.SamplingParams(top_p=1.0)
        reply = verifier.Verify(verifier_pb2.VerifyBatch(items=[
            verifier_pb2.VerifyRequest(session_id="v1", history=history, sampling=greedy, features_from=7),
            verifier_pb2.VerifyRequest(session_id="v2", history=history, sampling=greedy, candidates=[3],
                                       features_from=0)]))
        assert_refused(reply.verdicts[0], "past the history")
        answer = reply.verdicts[1]
        assert not answer.error and answer.features.tokens == 2 + answer.num_accepted
        assert len(answer.features.data) == answer.features.tokens * reads * hidden * 2
    finally:
        servers.stop()


# ------------------------------------------------------------------------------------------------
# The loop beside the verifier (AppConfig.loop_placement "verifier"): the target called in the
# loop's process on a torch thread of its own, only the other drafts' calls across

def beside(engine: SpecDecEngine, remote: GrpcTransport, local_drafts: dict | None = None):
    """(BesideTransport over a verifier worker of its own, the names of the threads its passes ran on)."""
    from concurrent.futures import ThreadPoolExecutor

    from services.transports import BesideTransport
    from specdec.calls import LocalTransport

    worker, threads = VerifierWorker(engine.target), set()
    verify = worker.verify

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return verify(*args, **kwargs)

    worker.verify = recorded
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-torch")
    return BesideTransport(LocalTransport(local_drafts or {}, worker, executor), remote), threads


@pytest.mark.parametrize("policy,k,temperature", [("fixed", 3, 0.0), ("svip", 4, 0.0), ("fixed", 3, 1.0)])
def test_the_loop_beside_the_verifier_equals_the_engine(servers, tiny_engine, policy, k, temperature):
    """Only the Propose batches cross (as deltas); the verifier runs on its torch thread; greedy and
    seeded outputs are the engine's; both sides' sessions are released."""
    remote = RecordingTransport(servers.addresses[0], None)
    transport, threads = beside(tiny_engine, remote)
    params = build_params(policy=policy, k=k, temperature=temperature, seed=5, max_new_tokens=MAX_NEW_TOKENS)
    # Sampled, one request: the int8 draft's draws follow how its passes are cut (two sessions share them).
    requests = [(PROMPTS[0], params)] + ([(PROMPTS[1], params)] if temperature == 0 else [])
    results = run(RoundLoop(transport, tiny_engine.rules, BatchConfig(overlap="off")), requests)
    for (prompt, _), result in zip(requests, results):
        assert (result.completions[0].token_ids, result.completions[0].finish_reason) == \
            engine_ids(tiny_engine, prompt, params)
        assert result.stats.draft_tokens > 0
    assert remote.calls == {"draft": results[0].stats.rounds, "verifier": 0}  # one batched Propose a step
    assert not any(full for _, _, full, _ in remote.sent[len(requests):])
    assert threads == {"verifier-torch_0"}
    assert len(servers.draft.sessions) == len(transport.local.verifier.sessions) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rounds_drafted_ahead_beside_the_verifier_equal_the_engines(agreeing_engine, temperature):
    """The Propose drafting ahead crosses while the target verifies on its thread: the outputs are the
    in-process loop's with overlap on."""
    engine, overlap = agreeing_engine, BatchConfig(overlap="on")
    params = build_params(policy="fixed", k=3, temperature=temperature, seed=99, max_new_tokens=MAX_NEW_TOKENS)
    servers = Servers(engine)
    try:
        transport, _ = beside(engine, GrpcTransport(servers.addresses[0], None))
        [served] = run(RoundLoop(transport, engine.rules, overlap), [(PROMPTS[0], params)])
    finally:
        servers.stop()
    [local] = run(RoundLoop(engine.loop.calls.transport, engine.rules, overlap), [(PROMPTS[0], params)])
    assert served.completions[0].token_ids == local.completions[0].token_ids
    assert served.stats.rounds_ahead == local.stats.rounds_ahead > 0


def test_a_lost_draft_replica_beside_the_verifier_costs_a_retry_not_tokens(tiny_engine):
    primary, backup = Servers(tiny_engine), Servers(tiny_engine)
    transport, _ = beside(tiny_engine, FailoverTransport([primary.addresses[0], backup.addresses[0]], None))

    class Killing(RoundLoop):
        steps = 0

        async def _step(self, planner, batch):
            self.steps += 1
            if self.steps == 3:
                primary.servers[0][0].stop(None)
            await super()._step(planner, batch)

    requests = [(prompt, build_params(policy="fixed", k=3, max_new_tokens=MAX_NEW_TOKENS)) for prompt in PROMPTS]
    try:
        results = run(Killing(transport, tiny_engine.rules, retry=FAST_RETRY), requests)
    finally:
        primary.stop()
        backup.stop()
    assert transport.remote.moved
    for (prompt, params), result in zip(requests, results):
        assert result.completions[0].token_ids == tiny_engine.generate_ids(prompt, params).completions[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_feature_draft_and_the_loop_beside_the_target_make_no_call_across(feature_engine, temperature):
    """The feature draft placed beside its target with the loop there too: nothing crosses a process,
    the states go from worker to worker, and the output is the engine's."""
    remote = RecordingTransport(None, None)
    transport, threads = beside(feature_engine, remote, {"default": DraftWorker(feature_engine.draft)})
    params = build_params(policy="fixed", k=3, temperature=temperature, seed=21, max_new_tokens=MAX_NEW_TOKENS)
    [result] = run(RoundLoop(transport, feature_engine.rules), [(PROMPTS[1], params)])
    assert (result.completions[0].token_ids, result.completions[0].finish_reason) == \
        engine_ids(feature_engine, PROMPTS[1], params)
    assert result.stats.draft_tokens > result.stats.rounds and remote.calls == {"draft": 0, "verifier": 0}
    assert threads == {"verifier-torch_0"} and not transport.local.verifier.link._waiting


def test_a_bad_distribution_beside_the_verifier_refuses_its_item_alone(tiny_engine):
    """A q_i that does not unpack (a draft replica's bug) is refused on its own, as the Verifier
    service refuses it; the other item is verified and the call's timing names it alone."""
    from services.convert import pack_distribution
    from specdec.protocol import Refused
    from specdec.verification import Verdict

    transport, _ = beside(tiny_engine, GrpcTransport(None, None))
    vocab, sampled = tiny_engine.target.vocab_size, SamplingParams(temperature=1.0)
    q = torch.full((vocab,), 1.0 / vocab)
    bad = pack_distribution(q * 2)  # sums to 2
    items = [VerifyItem(name, HistoryDelta(3, [5, 6, 7], full=True), [9], [dist], sampled, RoundSeed(1, 0, 0))
             for name, dist in (("bad", bad), ("good", pack_distribution(q)))]
    reply = asyncio.run(transport.verify(items))
    assert isinstance(reply.answers[0], Refused) and "sum to 1" in reply.answers[0].reason
    assert isinstance(reply.answers[1], Verdict) and [c.indices for c in reply.calls] == [[1]]


def test_a_large_request_is_tokenized_off_the_event_loop(tiny_engine, monkeypatch):
    """Found by a bug hunt: 1 MB of text took the tokenizer most of a second on the coordinator's
    event loop, and every stream there stalled for it (the request was refused anyway)."""
    import services.coordinator as coordinator_module
    from services.coordinator import PREPARE_INLINE_BYTES, Coordinator
    from specdec.v1 import generation_pb2

    encode = coordinator_module.prompt_ids_from_request

    def slow_encode(request, rules, params):
        if len(request.text) > PREPARE_INLINE_BYTES:
            time.sleep(0.6)  # (as the default pair's tokenizer on 1 MB, which lets the GIL go)
            raise InvalidRequestError("prompt is longer than the models' context")
        return encode(request, rules, params)

    monkeypatch.setattr(coordinator_module, "prompt_ids_from_request", slow_encode)
    coordinator = Coordinator(tiny_engine.loop.calls.transport, tiny_engine.rules)
    gaps = []

    async def ticker(done: asyncio.Event):  # what every other stream's task sees of the event loop
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def scenario():
        done = asyncio.Event()
        ticking = asyncio.create_task(ticker(done))
        small = generation_pb2.GenerateRequest(text="hello", chat_template=False, max_new_tokens=4)
        assert [c async for c in coordinator.generate_stream(small)]  # (inline, as before)
        large = generation_pb2.GenerateRequest(text="ab " * (PREPARE_INLINE_BYTES // 2), chat_template=False)
        with pytest.raises(InvalidRequestError):
            async for _ in coordinator.generate_stream(large):
                pass
        done.set()
        await ticking

    asyncio.run(scenario())
    assert max(gaps) < 0.3, max(gaps)
