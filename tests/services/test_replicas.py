"""The round replicas' classes, outside Serve: every torch call on one thread (services/replicas.py),
whichever thread the call came in on."""

from __future__ import annotations

import asyncio
import threading

from services.replicas import Draft, Verifier
from services.config import AppConfig
from specdec.builder import EngineConfig
from specdec.v1 import common_pb2, draft_pb2, verifier_pb2


class Recording:
    """Wraps a replica class so that loading and every round call record their thread."""

    def __init__(self, cls):
        self.threads: dict[str, set[int]] = {"load": set(), "call": set()}
        threads = self.threads

        def recorded(method):
            def call(*args):
                threads["call"].add(threading.get_ident())
                return method(*args)
            return call

        class Recorded(cls):
            def _load(self, config):
                threads["load"].add(threading.get_ident())
                servicer = super()._load(config)
                name = "propose" if cls is Draft else "verify"  # the worker's batch: where torch runs
                setattr(servicer.worker, name, recorded(getattr(servicer.worker, name)))
                return servicer

        self.cls = Recorded


def config(tiny_pair) -> AppConfig:
    return AppConfig(models=EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1])))


def test_draft_loads_and_drafts_on_one_thread_off_the_event_loop(tiny_pair):
    recording = Recording(Draft)
    replica = recording.cls(config(tiny_pair))
    request = draft_pb2.ProposeBatch(items=[draft_pb2.ProposeRequest(
        session_id=f"s{i}", history=common_pb2.HistoryDelta(history_length=3, tail=[40, 41, 42 + i], full=True),
        policy=draft_pb2.PolicyConfig(name="fixed", k=3), sampling=common_pb2.SamplingParams(top_p=1.0),
        max_candidates=3, seed=common_pb2.RoundSeed(request_seed=1)) for i in range(2)])

    async def rounds():
        return [draft_pb2.ProposalBatch.FromString(await replica.propose(request.SerializeToString())) for _ in range(3)]

    batches = asyncio.run(rounds())
    assert all(len(proposal.candidates) == 3 for batch in batches for proposal in batch.proposals)
    assert len(recording.threads["load"]) == 1
    assert recording.threads["call"] == recording.threads["load"]
    assert threading.get_ident() not in recording.threads["load"]


def test_verifier_loads_and_verifies_on_one_thread(tiny_pair):
    recording = Recording(Verifier)
    replica = recording.cls(config(tiny_pair))
    request = verifier_pb2.VerifyBatch(items=[verifier_pb2.VerifyRequest(
        session_id="s", history=common_pb2.HistoryDelta(history_length=3, tail=[40, 41, 42], full=True),
        candidates=[43, 44], sampling=common_pb2.SamplingParams(top_p=1.0), seed=common_pb2.RoundSeed(request_seed=1))])

    async def verify():
        return verifier_pb2.VerdictBatch.FromString(await replica.verify(request.SerializeToString()))

    reply = asyncio.run(verify())
    assert len(reply.verdicts) == 1 and reply.replica == replica._address  # named: HandleTransport
    assert len(recording.threads["load"]) == 1
    assert recording.threads["call"] == recording.threads["load"]


class AddressOnly:
    """A Serve deployment handle as far as DirectTransport asks it: the owner's address."""

    def __init__(self, address: str):
        self._address = address

    def options(self, **_):
        return self

    @property
    def address(self):
        address = self._address

        class Call:
            def remote(self):
                async def answer():
                    return address
                return answer()
        return Call()


def test_a_draft_beside_the_verifier_is_released_whichever_release_goes_first():
    """The verifier and a draft beside it share the session's replica: the owner was kept once for
    both, the first release forgot it and the other sent none (the draft's sessions stayed until
    their TTL), and one only proposed (cancelled in its first Propose) was never forgotten."""
    from services.transports import VERIFIER, DirectTransport, service

    feature = service("draft", "feature")

    class Recording(DirectTransport):
        async def _send(self, served_by, owner, method, request, routing_key):
            self.sent.append((served_by.role, owner, method, list(request.session_ids)))

    for releases in ([VERIFIER, feature], [feature, VERIFIER]):
        transport = Recording({"default": AddressOnly("draft:1")}, AddressOnly("verifier:1"), colocated=["feature"])
        transport.sent = []

        async def run():
            assert await transport._owner(feature, "both") == "verifier:1"  # proposed, then verified
            assert await transport._owner(VERIFIER, "both") == "verifier:1"
            await transport._owner(feature, "proposed")
            for served_by in releases:
                sessions = ["both"] + (["proposed"] if served_by == feature else [])
                await transport.release(served_by.role, sessions, served_by.draft)

        asyncio.run(run())
        assert sorted(transport.sent) == [("draft", "verifier:1", "Release", ["both", "proposed"]),
                                          ("verifier", "verifier:1", "Release", ["both"])]
        assert transport._owners == {}
