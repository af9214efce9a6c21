"""The round calls: one batched Propose and one batched Verify per step, whatever carries them.

A `RoundTransport` carries the calls: the in-process workers (`LocalTransport`, below), gRPC stubs
or Ray Serve handles (services/transports.py). The loop's history is the truth and a worker's
session a cache of it (specdec/protocol.py): each call sends a session only the tokens its worker
has not seen; a `SessionMissing` answer gets the round again with the whole history; an
`Unreachable` one (the replica is gone) is retried, after a backoff, elsewhere; `Refused` and
`Failed` fail that session only. Rounds draw their random numbers from (request seed, sample,
round, role), so a retried round, or one on another replica, draws the same numbers.

`RoundCalls` keeps each session's wire state (what each side holds, who may hold it, the round
outcomes the draft has not been told, and for a feature draft the target states its verifications
returned that the draft has not been sent, unless the verifier hands them over itself, workers.py
`FeatureLink`: in process, and served with the feature draft beside its target; its verdicts then
carry none) and charges each request the calls it waited for. It returns
the replicas' pass timings with the answers and feeds them nowhere: the step's planner observes
them (specdec/planner.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

import torch

from specdec.cost_profile import PassTiming
from specdec.errors import InvalidRequestError, Unavailable
from specdec.metrics import MS_PER_S
from specdec.models.vocab import tokenizer_ids
from specdec.params import DEFAULT_DRAFT
from specdec.protocol import (BatchReply, CallTiming, Failed, Proposal, ProposeItem, ProposeReply, Refused,
                              Role, RoundSeed, SessionMissing, StepPlan, Unreachable, VerifyItem, VerifyReply,
                              delta_for)
from specdec.sequences import LoopSample, RequestRules, RoundObserver
from specdec.verification import Verdict
from specdec.workers import DraftWorker, FeatureLink, VerifierWorker

logger = logging.getLogger(__name__)

NO_PROPOSAL = Proposal()  # a round that verifies no candidates
# Best effort: a replica that cannot free a session this soon has lost it (its LRU/TTL frees it).
RELEASE_TIMEOUT_S = 10.0


class RoundTransport(Protocol):
    """Carries batched round calls to the workers; each answer comes back in its item's place.

    A replica that is gone makes its items `Unreachable` (the loop retries them), a call that
    failed otherwise makes them `Failed`; anything raised fails every session of the call."""

    async def propose(self, items: list[ProposeItem], plan: StepPlan, draft: str = DEFAULT_DRAFT) -> ProposeReply:
        """`draft`: which of the drafts (by name) drafts these sessions' rounds."""

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> VerifyReply:
        """`probe_tokens` > 0: the verifier also times a scratch pass of that many tokens (with no
        items, only that)."""

    async def release(self, role: Role, session_ids: list[str], draft: str = DEFAULT_DRAFT) -> None:
        """`draft`: the sessions' draft, for role "draft"."""


def calls_overlap(transport: RoundTransport) -> bool:
    """Whether a Propose and a Verify it carries at once can run at once (`serial` unset or False);
    a transport whose calls run one after the other says `serial = True`."""
    return not getattr(transport, "serial", False)


@dataclass
class RetryPolicy:
    """How long a session waits for a replica to come back (a restart takes seconds)."""

    attempts: int = 30
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def backoff(self, attempt: int) -> float:
        return min(self.first_backoff_s * 2 ** attempt, self.max_backoff_s)


@dataclass(slots=True)
class Wire:
    """A session's wire state."""

    synced: dict = field(default_factory=lambda: {"draft": None, "verifier": None})  # history length each side holds
    contacted: set = field(default_factory=set)  # roles that may hold the session: released when it leaves
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # every round's (K, n), for a draft that rebuilds
    told: int = 0  # the first `told` outcomes the draft has been told about
    telling: int = 0  # the outcomes the Propose in flight tells it (a round drafted ahead tells one fewer)
    # Tokens the draft holds past synced["draft"] that the history does not have: a round was drafted
    # ahead after candidates that verification then rejected (HistoryDelta.drop).
    drop: int = 0
    # A feature draft's inputs: the target's states are known for positions < features_at; those of
    # the verifications since the last Propose wait in `features` (they end at features_at).
    features_at: int = 0
    features: list = field(default_factory=list)
    reads_features: bool = False  # its draft reads the target's states (RoundCalls._reads_features), decided once

    def features_for_draft(self, full: bool) -> tuple[object, int]:
        """(states [m, reads, H] or None, their first position) for the next Propose. A draft that
        rebuilds its session (a full history) holds no states: unless these start at 0, they are
        dropped and the next verification computes them again from 0 (the target's cache rolls back)."""
        m = sum(len(f) for f in self.features)
        start = self.features_at - m
        if full and start > 0:
            self.features, self.features_at = [], 0
            return None, 0
        if not self.features:
            return None, start
        return (self.features[0] if len(self.features) == 1 else torch.cat(self.features)), start


class RoundCalls:
    def __init__(self, transport: RoundTransport, rules: RequestRules, retry: RetryPolicy = RetryPolicy(),
                 observer: RoundObserver | None = None):
        self.transport, self.rules, self.retry, self.observer = transport, rules, retry, observer
        self._wire: dict[str, Wire] = {}
        # Every Propose names the target's width (StepPlan.target_vocab): a served draft replica builds
        # its draft without reading the target and fits it to the first width named (rules without a
        # tokenizer name none: token ids only, the draft as it is).
        self._target_vocab = None if rules.tokenizer is None else (rules.vocab_size, tokenizer_ids(rules.tokenizer))

    async def propose(self, sessions: list[LoopSample], plan: StepPlan, draft: str = DEFAULT_DRAFT
                      ) -> tuple[dict[LoopSample, Proposal], list[PassTiming]]:
        """Every session's round drafted by `draft`, theirs (the one that carries the plan's
        off-probe drafts nothing)."""
        item = partial(self._propose_item, probe=plan.probe, held=plan.held)
        plan = replace(plan, target_vocab=self._target_vocab)
        proposals, timings = await self._call("draft", sessions, item, lambda items: self.transport.propose(items, plan, draft))
        for s in proposals:
            self._drafted(self._wire[s.session_id])
        return proposals, timings

    async def propose_ahead(self, sessions: list[LoopSample], proposals: dict[LoopSample, Proposal], plan: StepPlan,
                            draft: str = DEFAULT_DRAFT) -> tuple[dict[LoopSample, Proposal], list[PassTiming]]:
        """Each session's next round drafted ahead, after the candidates of its round in `proposals`
        (being verified meanwhile), by a model draft (a feature draft's would need their target
        states). One attempt, failing no session: one the draft does not serve now gets no round
        ahead, its next round is drafted as usual (and an error shows there), from its whole history."""
        if not sessions:
            return {}, []
        wires = [self._wire[s.session_id] for s in sessions]
        items = [self._propose_item(s, wire, ahead=proposals[s].candidates) for s, wire in zip(sessions, wires)]
        for wire in wires:
            wire.contacted.add("draft")
        plan = replace(plan, target_vocab=self._target_vocab)
        try:
            reply: BatchReply = await self.transport.propose(items, plan, draft)
        except Exception as exc:  # noqa: BLE001 - the round is drafted again as usual
            logger.warning("drafting ahead failed (%s); the next rounds are drafted as usual", exc)
            reply = BatchReply([Unreachable(str(exc))] * len(items))
        self._record("draft", sessions, reply.calls)
        answered = {}
        for s, wire, item, answer in zip(sessions, wires, items, reply.answers):
            if isinstance(answer, Proposal):
                wire.synced["draft"] = item.history.length
                self._drafted(wire)
                answered[s] = answer
            else:  # whatever it holds, the next Propose rebuilds it
                wire.synced["draft"] = None
        return answered, reply.passes

    def ahead_verified(self, s: LoopSample, candidates: int, accepted: int) -> None:
        """A round was drafted ahead after `candidates` candidates of which verification accepted
        `accepted`: the draft holds the rejected ones past the history, and drops them first at its
        next Propose."""
        wire = self._wire.get(s.session_id)
        if wire is not None and wire.synced["draft"] is not None:
            wire.synced["draft"] -= candidates - accepted
            wire.drop = candidates - accepted

    @staticmethod
    def _drafted(wire: Wire) -> None:
        """A Propose answered: the draft holds what it was sent."""
        wire.told, wire.drop, wire.features = wire.telling, 0, []

    async def verify(self, sessions: list[LoopSample], proposals: dict[LoopSample, Proposal], probe_tokens: int = 0
                     ) -> tuple[dict[LoopSample, Verdict], list[PassTiming]]:
        """Every session's round verified: its proposal's candidates (none where it has none)."""
        verdicts, timings = await self._call("verifier", sessions, partial(self._verify_item, proposals=proposals),
                                             partial(self.transport.verify, probe_tokens=probe_tokens))
        for s, verdict in verdicts.items():
            wire = self._wire[s.session_id]
            wire.outcomes.append((len(proposals.get(s, NO_PROPOSAL).candidates), verdict.num_accepted))
            if wire.reads_features and verdict.features is not None:  # none where the verifier's link took them
                wire.features.append(verdict.features)
                wire.features_at = s.sample.length + verdict.num_accepted
        return verdicts, timings

    async def time_target(self, tokens: int) -> list[PassTiming]:
        """One scratch target pass of `tokens` tokens, timed (the planner's curve probe)."""
        return (await self.transport.verify([], probe_tokens=tokens)).passes

    def _propose_item(self, s: LoopSample, wire: Wire, probe: str | None = None,
                      ahead: list[int] | None = None, held: Container[str] = ()) -> ProposeItem:
        """The session's round; `ahead`: the candidates being verified, the next round drafted after
        them (its first token guesses their round's bonus token; the policy's round comes after it);
        `held`: the sessions whose model draft is held (a fused draft drafts their suffix only)."""
        params, full = s.request.params, wire.synced["draft"] is None
        features, features_start = wire.features_for_draft(full) if wire.reads_features else (None, 0)
        wire.telling = len(wire.outcomes)
        if ahead is None:
            max_candidates = self.rules.candidate_budget(s.sample, params)
        else:
            max_candidates = 1 + self.rules.candidate_budget(s.sample, params, ahead=len(ahead) + 1)
        return ProposeItem(
            session_id=s.session_id, history=delta_for(s.sample, wire.synced["draft"], wire.drop, ahead or ()),
            policy=params.policy, sampling=params.sampling, max_candidates=max_candidates,
            num_generated=len(s.sample.generated) + len(ahead or ()),
            rounds=list(wire.outcomes if full else wire.outcomes[wire.told:]),
            seed=RoundSeed(s.request.seed, s.index, s.round_index + (ahead is not None)),
            reference=s.request.reference, probe=s.session_id == probe, features=features,
            features_start=features_start, ahead=ahead is not None,
            held=s.session_id in held, cache_scope=params.cache_scope if full else None)

    def _verify_item(self, s: LoopSample, wire: Wire, proposals: dict[LoopSample, Proposal]) -> VerifyItem:
        proposal = proposals.get(s, NO_PROPOSAL)
        return VerifyItem(
            session_id=s.session_id, history=delta_for(s.sample, wire.synced["verifier"]),
            candidates=proposal.candidates, draft_probs=proposal.draft_probs, sampling=s.request.params.sampling,
            seed=RoundSeed(s.request.seed, s.index, s.round_index),
            features_from=wire.features_at if wire.reads_features else None)

    def _reads_features(self, s: LoopSample) -> bool:
        """Whether this session's draft reads the target's states: a feature draft's, for a policy that
        calls the draft (a target-only session is sent none)."""
        return self.rules.drafts[s.draft].reads_features and s.traits.uses_draft

    async def _call(self, role: Role, sessions: list[LoopSample], build: Callable[[LoopSample, Wire], object],
                    send: Callable[[list], object]) -> tuple[dict[LoopSample, object], list[PassTiming]]:
        """One batched call for every session (as deltas); SessionMissing answers are sent again in
        full, Unreachable ones retried after a backoff; Refused ones fail their session only."""
        results: dict[LoopSample, object] = {}
        timings: list[PassTiming] = []
        pending = [s for s in sessions if not s.over]
        for attempt in range(self.retry.attempts):
            if not pending:
                return results, timings
            wires = [self._wire.get(s.session_id) or self._wire.setdefault(s.session_id, Wire(
                reads_features=self._reads_features(s))) for s in pending]
            items = [build(s, wire) for s, wire in zip(pending, wires)]
            for wire in wires:
                wire.contacted.add(role)
            try:
                reply: BatchReply = await send(items)
            except Exception as exc:  # noqa: BLE001 - a failure of the call itself fails its sessions, no others
                logger.exception("%s call failed", role)
                for s in pending:
                    s.fail(exc)
                return results, timings
            self._record(role, pending, reply.calls)
            timings += reply.passes
            again, lost = [], False
            for s, wire, item, answer in zip(pending, wires, items, reply.answers):
                if s.over:
                    continue
                match answer:
                    case SessionMissing():
                        if item.history.full:
                            s.fail(RuntimeError(f"the {role} answered session_missing to a full history"))
                        else:
                            wire.synced[role] = None
                            again.append(s)
                    case Unreachable(reason=reason):
                        logger.warning("%s call for session %s failed (%s); retrying", role, s.session_id, reason)
                        wire.synced[role] = None
                        again.append(s)
                        lost = True
                    case Refused(reason=reason):
                        s.fail(InvalidRequestError(reason))
                    case Failed(error=error):
                        s.fail(error)
                    case _:
                        wire.synced[role] = item.history.length
                        results[s] = answer
            pending = again
            if lost and pending:
                await asyncio.sleep(self.retry.backoff(attempt))
        for s in pending:
            s.fail(Unavailable(f"the {role} serving this request did not come back; retry"))
        return results, timings

    def _record(self, role: Role, sessions: list[LoopSample], calls: list[CallTiming]) -> None:
        """Each request in a call is charged the call's time once (it waited that long), however
        many of its samples the call carried, and its own items' share of the call's bytes."""
        for call in calls:
            transport_s = max(call.wall_s - call.compute_s, 0.0)
            items = Counter(sessions[i].request for i in call.indices)  # a request's items in the call
            for request, count in items.items():
                stats = request.stats
                if role == "draft":
                    stats.draft_time_s += call.compute_s
                else:
                    stats.target_time_s += call.compute_s
                stats.transport_time_s += transport_s
                stats.transport_bytes += call.num_bytes * count // len(call.indices)
            if self.observer:
                self.observer.on_call(role, call.compute_s * MS_PER_S, transport_s * MS_PER_S, call.num_bytes)

    def forget_all(self) -> None:
        """Drop every session's wire state (the engine after a call cut short: none is live)."""
        self._wire.clear()

    async def release(self, leaving: Sequence[LoopSample]) -> None:
        """Free the sessions' caches wherever they may be held. Best effort: a replica that lost the
        session (or is gone) has nothing to free."""
        held: dict[tuple[Role, str], list[str]] = defaultdict(list)  # (role, draft) -> the sessions it may hold
        for s in leaving:
            wire = self._wire.pop(s.session_id, None)
            for role in wire.contacted if wire else ():
                held[role, s.draft if role == "draft" else DEFAULT_DRAFT].append(s.session_id)
        calls = [asyncio.wait_for(self.transport.release(role, ids, draft), RELEASE_TIMEOUT_S)
                 for (role, draft), ids in held.items()]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):  # the request's result does not depend on it
                logger.debug("a release failed: %s", outcome)


class LocalTransport:
    """The in-process carrier: the workers called directly, nothing serialized, the verifier linked
    to the feature drafts (workers.py `FeatureLink`): their sessions' verdicts come back without
    states, so the wire relays none and asks for them from 0, and the verifier reads them from where
    the draft's session holds them. `draft`: one draft's worker, or each draft's by name (the first
    is the default; none where every draft is elsewhere: services/transports.py `BesideTransport`).
    Its calls run one after the other (`serial`): nothing is drafted ahead in process unless asked
    for (BatchConfig.overlap "on"). `executor`: where the workers run (a replica's one torch
    thread); None: on the caller's thread, which the call then holds."""

    serial = True

    def __init__(self, draft: DraftWorker | dict[str, DraftWorker], verifier: VerifierWorker,
                 executor: Executor | None = None):
        self.drafts = dict(draft) if isinstance(draft, dict) else {DEFAULT_DRAFT: draft}
        self.draft, self.verifier, self.executor = next(iter(self.drafts.values()), None), verifier, executor
        verifier.link = FeatureLink(self.drafts.values())

    async def propose(self, items: list[ProposeItem], plan: StepPlan = StepPlan(),
                      draft: str = DEFAULT_DRAFT) -> ProposeReply:
        worker = self.drafts[draft]
        return await self._timed(partial(worker.propose, plan=plan), items, worker)

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> VerifyReply:
        return await self._timed(partial(self.verifier.verify, probe_tokens=probe_tokens), items, self.verifier)

    async def release(self, role: Role, session_ids: list[str], draft: str = DEFAULT_DRAFT) -> None:
        (self.drafts[draft] if role == "draft" else self.verifier).release(session_ids)  # never waits for a pass

    async def _timed(self, call: Callable[[list], list], items: list, worker: DraftWorker | VerifierWorker) -> BatchReply:
        def run() -> tuple[list, float, list[PassTiming]]:
            start = time.perf_counter()
            answers = call(items)
            return answers, time.perf_counter() - start, worker.take_timings()

        start = time.perf_counter()
        if self.executor is None:
            answers, elapsed, timings = run()
        else:
            answers, elapsed, timings = await asyncio.get_running_loop().run_in_executor(self.executor, run)
        wall_s = time.perf_counter() - start
        return BatchReply(answers, [CallTiming(list(range(len(items))), elapsed, wall_s)], timings)
