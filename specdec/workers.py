"""The draft's and the verifier's sides of the round protocol (specdec/protocol.py): their sessions
and one batched call each. The in-process engine calls them directly; the gRPC servicers
(services/) convert protobuf at the edge and call them the same way.

A session's entry (KV cache, the committed history it was synced to, and on the draft its stopping
policy) is a cache of the caller's history: a delta the entry cannot take answers SessionMissing.
A malformed item is Refused on its own; the other sessions of the batch are served.

In process, and served where a feature draft sits beside its target (services/replicas.py
`Verifier`), the draft's worker is linked to the verifier's (`FeatureLink`): the target's states
go from the verification's pass straight into the draft's session. A feature draft on replicas of
its own gets them with the round calls (calls.py `Wire`).

Every drafting step and verification is timed (specdec/cost_profile.py `PassTiming`); a worker keeps
its timings, and those of the short probe it runs when it starts (`probe`), until the carrier of its
next reply takes them (`take_timings`) for the caller's live profile.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.cost_profile import PassTiming
from specdec.errors import InvalidRequestError
from specdec.head import AcceptanceHead
from specdec.metrics import MS_PER_S
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.runtime import DraftRole, KVSession, TargetRole
from specdec.policies import PolicyConfig, StoppingPolicy, make_policy
from specdec.protocol import (Proposal, ProposeItem, Refused, SessionMissing, StepPlan, VerifyItem,
                              history_from_delta, ids_in_range, q_travels)
from specdec.proposers import proposer_for
from specdec.rounds import DraftRow, LogitsFilterFactory, TargetRow, in_groups, propose, verify
from specdec.sampling import SamplingParams
from specdec.sessions import SessionStore
from specdec.verification import Verdict

@dataclass
class DraftSession:
    policy: StoppingPolicy
    kv: KVSession
    history: list[int] = field(default_factory=list)  # the committed history the last round drafted from


@dataclass
class VerifierSession:
    kv: KVSession
    # The committed history of the last round. The cache also holds that round's accepted
    # candidates; the caller's next history includes them plus the correction token.
    history: list[int] = field(default_factory=list)


def serve_batch(items: list, row_for: Callable, run: Callable[[list], list]) -> list:
    """Answer every item: SessionMissing where `row_for` finds no session (None), Refused where it
    (or a session id repeated in the batch: two rows on one cache would corrupt it) raises
    InvalidRequestError, else what `run` returns for the item's row; `run` gets every row at once."""
    answers: list = [None] * len(items)
    rows, where, seen = [], [], set()
    for i, item in enumerate(items):
        try:
            if item.session_id in seen:
                raise InvalidRequestError(f"session {item.session_id!r} appears twice in one batch")
            seen.add(item.session_id)
            row = row_for(item)
        except InvalidRequestError as exc:
            answers[i] = Refused(str(exc))
            continue
        if row is None:
            answers[i] = SessionMissing()
        else:
            rows.append(row)
            where.append(i)
    for i, result in zip(where, run(rows) if rows else []):
        answers[i] = result
    return answers


# The start-up probe: passes of these sizes after a short untimed context: a drafting step of 1, 2
# and 16 sessions (16: the most a probe's scratch sessions take beside the live ones), a verification
# pass of 1-8 tokens. A probe times a pass as the rounds make it, host work included: priced from
# bare forwards, drafting looks cheaper than it is (docs/planner.md, "Probes").
PROBE_SIZES = {"draft": (1, 2, 16), "verifier": (1, 2, 4, 8)}
PROBE_CONTEXT = 2  # tokens fed before the timed passes (the first pass pays for lazy set-up)
# The draft's start-up probe also times a catch-up: one session's prefill of this many tokens (one
# output), which prices a prompt's catch-up past the steps' curve (probe_catch_up).
CATCH_UP_PROBE_TOKENS = 64


def probe_verification(target: TargetRole, sizes: Sequence[int], context: int = PROBE_CONTEXT) -> list[PassTiming]:
    """Time one verification pass over each of `sizes` tokens on a scratch session (dropped after),
    after `context` untimed tokens (a model's first pass pays for lazy set-up; on a GPU each new size
    does, so there every size is fed once untimed first). A pass of n tokens scores its last n - 1
    as candidates: it reads n rows of logits, as a verification of n - 1 candidates does, and each
    row read costs the output layer (docs/planner.md, "Probes")."""
    session = target.new_session()
    history = [(7 + i) % target.vocab_size for i in range(context)]

    def feed(n: int) -> None:  # the last n tokens of `history` are the ones the cache lacks
        read_from = len(history) - n + 1
        target.score([session], [history[:read_from]], [history[read_from:]])

    if history:
        feed(1)
    timings = []
    for size in sizes:
        if len(history) + size >= target.max_context:
            break
        history += [(len(history) * 31 + 7) % target.vocab_size for _ in range(size)]
        if context and target.sets_up_per_shape:  # an untimed pass of this size first
            feed(size)
            target.rollback(session, len(history) - size)
        start = time.perf_counter()
        feed(size)
        timings.append(PassTiming("verifier", size, (time.perf_counter() - start) * MS_PER_S, probe=True))
    target.rollback(session, 0)
    return timings


def probe_catch_up(draft: DraftRole, tokens: int = CATCH_UP_PROBE_TOKENS,
                   context: int = PROBE_CONTEXT) -> list[PassTiming]:
    """Time one catch-up: a scratch session (dropped after) fed `tokens` tokens in one pass after
    `context` untimed ones, reading the last one's outputs, as a lagging draft's first step does
    (priced along the steps' curve, where a step of n sessions reads n outputs, a catch-up comes out
    about twice its cost)."""
    session = draft.new_session()
    history = [(7 + i) % draft.vocab_size for i in range(context + tokens)]
    if len(history) >= draft.max_context:
        return []
    if context:
        draft.start([session], [history[:context]])
    if context and draft.sets_up_per_shape:  # an untimed pass of this size first
        draft.start([session], [history])
        draft.rollback(session, context)
    start = time.perf_counter()
    draft.start([session], [history])
    timing = PassTiming("draft", tokens, (time.perf_counter() - start) * MS_PER_S, probe=True)
    draft.rollback(session, 0)
    return [timing]


def probe_drafting(draft: DraftRole, sizes: Sequence[int], policy: Callable[[], StoppingPolicy],
                   context: int = PROBE_CONTEXT) -> list[PassTiming]:
    """Time one drafting step of n sessions for each n of `sizes`: n scratch sessions (dropped after),
    each after `context` untimed tokens, draft one greedy candidate under `policy` through
    `rounds.propose`, so the timing holds what a round's step costs: the pass with an output per
    session, sampling and the policy's head. A catch-up (a prompt's prefill: many tokens, one
    output) costs less than a step of as many sessions: `probe_catch_up` times one. No step holds
    more sessions than the runtime's pass does without evicting one (`max_pass_sessions`)."""
    timings: list[PassTiming] = []
    for n in sorted({min(n, draft.max_pass_sessions or n) for n in sizes}):
        sessions = [draft.new_session() for _ in range(n)]
        histories = [[(7 + s + i) % draft.vocab_size for i in range(context + 1)] for s in range(n)]
        if len(histories[0]) + 1 >= draft.max_context:
            break
        if context:
            draft.start(sessions, [h[:-1] for h in histories])

        def step(into: list[PassTiming]) -> None:
            propose(draft, [DraftRow(s, h, policy(), 1, 0, SamplingParams(), torch.Generator())
                            for s, h in zip(sessions, histories)], timings=into)

        if context and draft.sets_up_per_shape:  # an untimed step of this size first
            step([])
            for s, h in zip(sessions, histories):
                draft.rollback(s, len(h) - 1)
        timed: list[PassTiming] = []
        step(timed)
        timings.append(PassTiming("draft", n, timed[0].ms, probe=True))
        for s in sessions:
            draft.rollback(s, 0)
    return timings


class Worker(ABC):
    """A role's sessions (`release` drops them; a session never seen is not an error) and the
    timings of its passes not yet taken."""

    sessions: SessionStore
    role: str

    def __init__(self):
        self.timings: list[PassTiming] = []
        self._probe_due = False

    def probe_at_first_batch(self) -> None:
        """Run the start-up probe before the first batch instead of now: a served replica loads
        beside the other role's, and a probe timed while that one still loads is several times slow
        (docs/planner.md, "Probes")."""
        self._probe_due = True

    def _before_batch(self) -> None:
        if self._probe_due:
            self._probe_due = False
            self.probe()

    def release(self, session_ids: list[str]) -> list[bool]:
        return [self.sessions.pop(session_id) is not None for session_id in session_ids]

    def probe(self, sizes: Sequence[int] | None = None) -> None:
        """Time a few scratch passes (kept with the other timings): the start-up probe, or with
        `sizes` an off-probe or curve probe of a warm model (no untimed context: it costs only what
        it times)."""
        if sizes is None:
            self.timings += self._probe(PROBE_SIZES[self.role], PROBE_CONTEXT)
        else:
            self.timings += self._probe(sizes, 0)

    @abstractmethod
    def _probe(self, sizes: Sequence[int], context: int) -> list[PassTiming]:
        """Time this role's passes of `sizes` after `context` untimed tokens."""

    def take_timings(self) -> list[PassTiming]:
        taken, self.timings = self.timings, []
        return taken


class DraftWorker(Worker):
    """The draft (plus its acceptance head): its sessions, and one round for every session of a
    batch, drafted by the proposer of its kind (specdec/proposers.py)."""

    role = "draft"

    def __init__(self, draft: DraftRole, head: AcceptanceHead | None = None,
                 sessions: SessionStore[DraftSession] | None = None,
                 logits_filter: LogitsFilterFactory | None = None):
        super().__init__()
        self.draft, self.proposer = draft, proposer_for(draft, logits_filter)
        self.head = head.to(draft.device) if head is not None else None  # it reads the draft's states where they are
        self.sessions: SessionStore[DraftSession] = sessions if sessions is not None else SessionStore()
        self._ended: deque[Callable[[], None]] = deque()  # what released sessions left to do
        self.width: int | None = None  # the target's rows the first call naming them named (`fit`)

    def _before_batch(self) -> None:
        # What a released session left to do runs here, on the thread that drafts: Release arrives on
        # others (a gRPC server's, a replica's event loop) while a batch may be walking what it
        # changes (the suffix draft adds the response to its scope's shared index).
        while self._ended:
            self._ended.popleft()()
        super()._before_batch()

    def _probe(self, sizes: Sequence[int], context: int) -> list[PassTiming]:
        if self.draft.model_free:  # nothing to set up or catch up
            return self.proposer.probe(sizes)
        if context:  # the start-up probe: graphs are captured now, never inside a timed round
            self.draft.capture_graphs()
        policy = PolicyConfig(name="specdec++") if self.head is not None else PolicyConfig(name="fixed", k=1)
        timings = probe_drafting(self.draft, sizes, lambda: make_policy(policy, head=self.head), context)
        if context:  # the start-up probe
            timings += probe_catch_up(self.draft, context=context)
        return timings

    def release(self, session_ids: list[str]) -> list[bool]:
        entries = [self.sessions.pop(session_id) for session_id in session_ids]
        for entry in entries:  # (the last round's tokens are not seen)
            if entry is not None and (left := self.proposer.ended(entry.kv, entry.history)) is not None:
                self._ended.append(left)
        return [entry is not None for entry in entries]

    def fit(self, target_vocab: tuple[int, int] | None) -> None:
        """Fit the draft to the target a call names (StepPlan.target_vocab: its rows, its tokenizer's
        ids) at the first call naming one. A served draft replica builds its draft without reading the
        target (builder.py `build_draft`: that would fetch or convert it there), so a draft whose
        padding rows differ from the target's is fitted here (models/runtime.py
        `DraftRole.fit_vocabulary`, a fused suffix draft's width with it), on the thread that drafts,
        before the batch and the start-up probe; one fitted already (in process, by build_engine) has
        the target's width and stays as it is. The width is the first one named: a call naming another
        (a coordinator of another target) is refused whole, and the first one's sessions go on. None:
        not named (a coordinator of an earlier version, rules without a tokenizer), the draft as it
        is; the plain suffix draft, built unsized on a replica (its width is all it reads of the
        target), has no width to go on then: the call is refused whole (its histories' ids could not
        be checked, nor its q's made) and a later call naming one is served."""
        if target_vocab is None:
            if self.draft.vocab_size is None:
                raise InvalidRequestError("the call names no target width (ProposeBatch target_rows), which this "
                                          "suffix draft takes its one-hot q's width from: a coordinator of an "
                                          "earlier version?")
            return
        if target_vocab[0] == self.width:
            return
        rows, tokens = target_vocab
        if self.width is not None:
            raise InvalidRequestError(f"the call names a target of {rows} token rows: this draft drafts for its "
                                      f"first caller's, of {self.width}")
        self.draft.fit_vocabulary(rows, tokens)
        self.width = rows

    def propose(self, items: list[ProposeItem], plan: StepPlan = StepPlan()) -> list[Proposal | SessionMissing | Refused]:
        self.fit(plan.target_vocab)
        self._before_batch()
        answers = serve_batch(items, self._row, lambda rows: self.proposer.propose(rows, plan, self.timings))
        if any(item.probe for item in items):  # an off-probe: time a drafting step of the step's size
            self.probe((min(len(items) + plan.other_sessions, max(PROBE_SIZES["draft"])),))
        return answers

    def _row(self, item: ProposeItem) -> DraftRow | None:
        entry = self.sessions.get(item.session_id)
        history = history_from_delta(entry.history if entry else None, item.history, self.draft.vocab_size)
        if history is None:
            return None
        if item.max_candidates < 0 or len(history) + item.max_candidates >= self.draft.max_context:
            raise InvalidRequestError(
                f"max-candidates {item.max_candidates} after {len(history)} tokens exceeds the "
                f"draft's context of {self.draft.max_context}")
        if item.history.full:  # rebuild: keep the cache (it re-syncs by common prefix), reset the policy
            policy = make_policy(item.policy, head=self.head, reference=item.reference)  # validates it (Refused)
            self.proposer.check_policy(policy)
            entry = DraftSession(policy, entry.kv if entry else self.draft.new_session())
        ready = self.proposer.take_inputs(entry.kv, item, history)
        for num_candidates, num_accepted in item.rounds:  # oldest first: the policy reaches the caller's state
            entry.policy.end_round(num_candidates, num_accepted)
        entry.history = history
        if item.history.full:  # a new entry (one held already was marked used by `get`)
            self.sessions.put(item.session_id, entry)
        # A probe item drafts nothing (its cache catches up later), nor does a session its proposer
        # cannot draft yet (a feature draft's before the target's states reach its history's end).
        limit = 0 if item.probe or not ready else item.max_candidates
        return DraftRow(entry.kv, history, entry.policy, limit, item.num_generated, item.sampling,
                        item.seed.generator("draft", item.sampling), item.ahead,
                        item.seed.generator("draft-guess", item.sampling) if item.ahead else None, held=item.held)


class VerifierWorker(Worker):
    """The target model: verifies one round for every session of a batch in one pass."""

    role = "verifier"

    def __init__(self, target: TargetRole, sessions: SessionStore[VerifierSession] | None = None):
        super().__init__()
        self.target = target
        self.sessions: SessionStore[VerifierSession] = sessions if sessions is not None else SessionStore()
        self.link: FeatureLink | None = None  # a feature draft beside it: where the states its verifications read go

    def _probe(self, sizes: Sequence[int], context: int) -> list[PassTiming]:
        return probe_verification(self.target, sizes, context)

    def release(self, session_ids: list[str]) -> list[bool]:
        if self.link is not None:
            self.link.forget(session_ids)
        return super().release(session_ids)

    def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> list[Verdict | SessionMissing | Refused]:
        """Verify the batch; `probe_tokens` > 0: then time a scratch pass of that many tokens."""
        self._before_batch()
        session_ids: dict[int, str] = {}  # id(row) -> its session's id, for the link

        def row_for(item: VerifyItem) -> TargetRow | None:
            row = self._row(item)
            session_ids[id(row)] = item.session_id
            return row

        def run(rows: list[TargetRow]) -> list[Verdict]:
            verdicts = in_groups(rows, self.target.max_pass_sessions,
                                 lambda group: verify(self.target, group, self.timings))
            if self.link is None:
                return verdicts
            return [self.link.hand(session_ids[id(row)], row, verdict) for row, verdict in zip(rows, verdicts)]

        answers = serve_batch(items, row_for, run)
        if probe_tokens > 0:
            self.probe((probe_tokens,))
        return answers

    def _row(self, item: VerifyItem) -> TargetRow | None:
        vocab = self.target.vocab_size
        entry = self.sessions.get(item.session_id)
        history = history_from_delta(entry.history if entry else None, item.history, vocab)
        if history is None:
            return None
        if not ids_in_range(item.candidates, vocab):
            raise InvalidRequestError(f"candidate token ids must be in [0, {vocab})")
        if len(history) + len(item.candidates) >= self.target.max_context:
            raise InvalidRequestError(
                f"{len(item.candidates)} candidates after {len(history)} tokens exceed the target's "
                f"context of {self.target.max_context}")
        if q_travels(item.sampling) and len(item.draft_probs) != len(item.candidates):
            raise InvalidRequestError(
                f"sampled verification needs one draft distribution per candidate: "
                f"{len(item.candidates)} candidates, {len(item.draft_probs)} distributions")
        if item.features_from is not None and not self.target.returns_features:
            raise InvalidRequestError("this verifier reads no features for a feature draft")
        if item.features_from is not None and not 0 <= item.features_from <= len(history):
            raise InvalidRequestError(f"features-from {item.features_from} is past the history's {len(history)} tokens")
        features_from = item.features_from
        if features_from is not None and self.link is not None:  # from where the draft's session holds them
            features_from = max(features_from, self.link.held(item.session_id))
        if entry is None:  # a session held already was marked used by `get`
            entry = VerifierSession(self.target.new_session())
            self.sessions.put(item.session_id, entry)
        entry.history = history
        return TargetRow(entry.kv, history, item.candidates, item.draft_probs if q_travels(item.sampling) else [],
                         item.sampling, item.seed.generator("target", item.sampling), features_from)


class FeatureLink:
    """The target's states go from the verifier's pass to the feature drafts' sessions in its
    process, without the loop (`LocalTransport` makes the link in process, the verifier's replica
    for a draft beside it). They wait here until the session's next
    Propose (`take`), as the wire would carry them: a draft session evicted meanwhile takes them
    into its new cache only from position 0, so they are dropped otherwise and the next
    verification reads them again from 0 (the target's cache rolls back). A verification reads the
    states from where the draft's session, with what waits for it, holds them (`held`)."""

    def __init__(self, drafts: Iterable[DraftWorker]):
        self.drafts = [worker for worker in drafts if worker.draft.reads_features]
        self._waiting: dict[str, list[tuple[torch.Tensor, int]]] = {}  # session id -> (states, start), oldest first
        for worker in self.drafts:
            worker.proposer.link = self

    def held(self, session_id: str) -> int:
        """Positions of the session's states the draft holds, or will once it takes what waits."""
        if waiting := self._waiting.get(session_id):
            return waiting[-1][1] + len(waiting[-1][0])
        for worker in self.drafts:
            if (entry := worker.sessions.get(session_id)) is not None:
                return worker.draft.features_held(entry.kv)
        return 0

    def hand(self, session_id: str, row: TargetRow, verdict: Verdict) -> Verdict:
        """The verdict's states to wait for the session's draft; the verdict without them."""
        if verdict.features is None:
            return verdict
        self._waiting.setdefault(session_id, []).append((verdict.features, row.features_from))
        return Verdict(verdict.num_accepted, verdict.next_token)

    def take(self, session_id: str, draft: FeatureDraftRuntime, kv: KVSession) -> None:
        """What waits for the session into its draft's cache `kv`, from the first that starts past
        what the cache holds on dropped."""
        for states, start in self._waiting.pop(session_id, ()):
            if start > draft.features_held(kv):
                return
            draft.add_features(kv, states, start)

    def forget(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            self._waiting.pop(session_id, None)

    def keep(self, sessions: Container[str]) -> None:
        """Drop what waits for sessions neither in `sessions` (the verifier's) nor held by a draft
        (a replica's health check, after both let idle sessions expire: what waits for a session
        its caches evicted is taken when it comes back, so it is kept while either holds it)."""
        # (a copy of the keys: the torch thread may hand states over meanwhile)
        self.forget([session_id for session_id in list(self._waiting) if session_id not in sessions
                     and not any(session_id in worker.sessions for worker in self.drafts)])
