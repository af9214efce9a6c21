"""Proposers: what drafts a step's rounds, one class per kind of draft, each with one `propose`.

A draft worker (specdec/workers.py) keeps its sessions and answers the round protocol; its proposer
takes each session's inputs (`take_inputs`) and turns the batch's rows into proposals (`propose`).
Who calls the draft this step and with what costs was decided by the step planner
(specdec/planner.py, carried in the `StepPlan`); how long a round drafts, by its stopping policy
or, for a budgeted policy, by the step's budget (rounds.py `still_drafting`, specdec/budget.py).

- `ModelProposer`: a draft model on any runtime (torch, CUDA, llama.cpp): `rounds.propose` drives
  its passes, in groups that fit its cache.
- `FeatureProposer`: a feature draft (models/feature_runtime.py): the target's states first (from
  the item, served; from the verifier in process, workers.py `FeatureLink`), then drafted as a
  model, each session only once its states reach its history's end.
- `SuffixProposer`: the suffix draft (models/suffix.py): no model; each session's candidates are
  the continuation of its history's end where it occurred before, with match estimates that its
  policy or the step's budget stops on as on a head's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from specdec.budget import StepBudget
from specdec.cost_profile import PassTiming
from specdec.errors import InvalidRequestError
from specdec.metrics import MS_PER_S
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.runtime import DraftRole, KVSession
from specdec.models.suffix import MAX_ORDER, Match, SuffixDraft, SuffixIndex, SuffixSession
from specdec.policies import DraftStep, FixedK, StoppingPolicy, check_model_free
from specdec.protocol import Proposal, ProposeItem, StepPlan, q_travels
from specdec.rounds import DraftRow, Drafting, LogitsFilterFactory, in_groups, propose, still_drafting
from specdec.sampling import SamplingParams


class ModelProposer:
    """A draft model's rounds: `rounds.propose` over its passes."""

    def __init__(self, draft: DraftRole, logits_filter: LogitsFilterFactory | None = None):
        self.draft, self.logits_filter = draft, logits_filter

    def check_policy(self, policy: StoppingPolicy) -> None:
        """Raises InvalidRequestError where this draft cannot run the policy: a model's runs any."""

    def ended(self, kv: KVSession, history: list[int]) -> Callable[[], None] | None:
        """What is left to do of a session released (its request ended) after `history`, as far as
        the draft saw it, to run on the drafting thread; it holds nothing of `kv` (its cache is
        freed at once). None: nothing to keep of it."""
        return None

    def take_inputs(self, kv: KVSession, item: ProposeItem, history: list[int]) -> bool:
        """What the item brings besides its history into the session's cache `kv`; whether the
        session can draft after `history` now."""
        if item.features is not None:
            raise InvalidRequestError("this draft reads no target features")
        return True

    def propose(self, rows: list[DraftRow], plan: StepPlan, timings: list[PassTiming]) -> list[Proposal]:
        """Every row's round, in groups that fit the draft's cache (`in_groups`), each budgeted beside
        the others as sessions that verify plainly, with the costs the planner priced the step with;
        the drafting steps' times appended to `timings`."""
        return in_groups(rows, self.draft.max_pass_sessions, lambda group: propose(
            self.draft, group, plan.costs, plan.other_sessions + len(rows) - len(group), timings,
            self.logits_filter))


class WaitingStates(Protocol):
    """Where a session's target states wait for its next Propose in process (workers.py `FeatureLink`)."""

    def take(self, session_id: str, draft: FeatureDraftRuntime, kv: KVSession) -> None:
        """What waits for the session into its draft's cache `kv`."""


class FeatureProposer(ModelProposer):
    """A feature draft's rounds: a session drafts once the target's states reach its history's end
    (its first round, the prompt's prefill, computes them; nothing is guessed)."""

    draft: FeatureDraftRuntime

    def __init__(self, draft: FeatureDraftRuntime, logits_filter: LogitsFilterFactory | None = None):
        super().__init__(draft, logits_filter)
        self.link: WaitingStates | None = None  # in process: the states come from the verifier, not in items

    def take_inputs(self, kv: KVSession, item: ProposeItem, history: list[int]) -> bool:
        if item.features is not None:  # checked before anything held changes: a refused item changes nothing
            if not 0 <= item.features_start <= len(history):
                raise InvalidRequestError(f"features start at position {item.features_start}, past the history's "
                                          f"{len(history)} tokens")
            self.draft.check_features(item.features)
        if self.link is not None:  # what it holds is the target's; what waits joins it
            self.link.take(item.session_id, self.draft, kv)
        elif item.history.full:  # a rebuilt entry: served, the items carry the states again from where they start
            if item.features is not None and item.features_start > 0:
                raise InvalidRequestError(f"features start at position {item.features_start}, but a rebuilt "
                                          "session holds none")
            self.draft.clear_features(kv)
        if item.features is not None:
            self.draft.add_features(kv, item.features, item.features_start)
        return self.draft.can_draft(kv, history)


class SuffixProposer:
    """The suffix draft's rounds. Its candidates cost nothing to draft, so each row walks its
    session's index (models/suffix.py) as far as its limit at once, each candidate with its match
    estimate. A budgeted row's round is then chosen with the others' by the step's budget over the
    whole walk (`choose`): the candidates of highest survival P_{s,i} across the batch, as many as
    make the step's pass cheapest a token, where drafting step by step would stop at the first
    candidate that does not pay alone (on a CPU, a pass of 2 tokens costs twice one of 1, of 16
    half as much a token). Any other row's policy decides candidate by candidate on the estimates
    (`DraftStep.judged`, as a chain's head judgements are). A history whose end matches nothing
    before drafts nothing. Before drafting, each session learns what the target made of its last
    walk, proposed or not (`SuffixSession.outcome`, `MatchStats.learn`)."""

    def __init__(self, draft: SuffixDraft):
        self.draft = draft

    def check_policy(self, policy: StoppingPolicy) -> None:
        check_model_free(policy.name)

    def take_inputs(self, kv: SuffixSession, item: ProposeItem, history: list[int]) -> bool:
        if item.features is not None:
            raise InvalidRequestError("this draft reads no target features")
        self.refuse_ahead(item)
        self.open(kv, item, history)
        return True

    @staticmethod
    def refuse_ahead(item: ProposeItem) -> None:
        """A walk costs microseconds: nothing to hide behind a verification, so no round of this draft
        is drafted ahead (loop.py `_may_draft_ahead`) and an item asking for one is refused."""
        if item.ahead:
            raise InvalidRequestError("the suffix draft drafts no round ahead")

    @staticmethod
    def open(kv: SuffixSession, item: ProposeItem, history: list[int]) -> None:
        """A new session (or one rebuilt): the cache of earlier responses it reads, where its response starts."""
        if item.history.full:
            kv.scope, kv.prompt_length = item.cache_scope, len(history) - item.num_generated

    def ended(self, kv: SuffixSession, history: list[int]) -> Callable[[], None] | None:
        """A session released: its response joins its scope's earlier responses."""
        if kv.scope is None:
            return None
        scope, response = kv.scope, history[kv.prompt_length:]
        return lambda: self.draft.remember(scope, response)

    def propose(self, rows: list[DraftRow], plan: StepPlan, timings: list[PassTiming]) -> list[Proposal]:
        start = time.perf_counter()
        drafting, _ = self.rounds(rows, plan, len(rows))
        if walked := sum(self._walks(d, plan) for d in drafting):
            timings.append(PassTiming("draft", walked, (time.perf_counter() - start) * MS_PER_S))
        return [d.proposed() for d in drafting]

    def rounds(self, rows: list[DraftRow], plan: StepPlan, batch: int, device=None, switch: float | None = None
               ) -> tuple[list[Drafting], StepBudget | None]:
        """Every row's round (a sampled one's q made on `device`, for its kept candidates only), and
        the step's budget with the budgeted rows' kept candidates in it, of a step of `batch` rows
        and the plan's others (None: no row is budgeted, or nothing priced the step). `switch`: a
        row not held (`DraftRow.held`) proposes its walk only as far as its estimates stay at least
        this (a fused draft's model continues it from there)."""
        drafting = [Drafting(row) for row in rows]
        for d in drafting:  # what the target made of each session's last walk, walking this round or not
            d.row.session.learn(d.row.history, self.draft.stats)
        active = [d for d in drafting if self._walks(d, plan)]
        walks = {d: self._walk(d) for d in active}
        budgeted = [d for d in active if d.budgeted]
        chosen = walks if switch is None else {
            d: walk if d.row.held else list(itertools.takewhile(lambda each: each[0].judged >= switch, walk))
            for d, walk in walks.items()}
        budget = self._choose(budgeted, chosen, plan, batch) if budgeted else None
        self._decide([d for d in active if not d.budgeted], chosen)
        for d in active:  # a sampled round's q, one-hot, made for the candidates kept only
            if q_travels(d.row.sampling):
                d.proposal.draft_probs = [self.draft.one_hot(y, device) for y in d.proposal.candidates]
        for d in drafting:  # what the target makes of the walk is learnt at the session's next round
            session, walk = d.row.session, walks.get(d, [])
            session.round_start, session.walk = len(d.row.history), [step.token for step, _ in walk]
            session.buckets = [bucket for _, bucket in walk]
        return drafting, budget

    @staticmethod
    def _walks(d: Drafting, plan: StepPlan) -> bool:
        """Whether the row drafts at all (a budgeted one only in a priced step)."""
        return d.row.policy.uses_draft and d.limit > 0 and bool(plan.costs or not d.budgeted)

    def _walk(self, d: Drafting) -> list[tuple[DraftStep, tuple]]:
        """The row's candidates as far as its limit or its match goes, each as a step and its match
        bucket. The walk follows one earlier copy on for as long as no longer context occurs
        elsewhere (within the copy's document); it starts from the longest context of the history's
        end, the occurrence nearest past the session's cursor where several are as long
        (`SuffixIndex.nearest`), else the last."""
        session, history, greedy = d.row.session, d.row.history, d.row.sampling.greedy
        stats = self.draft.stats
        session.index.sync(history)
        shared = self.draft.shared(session.scope)  # earlier responses, where the request opted in
        d.row.policy.start_round()
        # (the tail keeps a token more than a context: what a copy going on drops, `SuffixIndex.follow`)
        tail, walk, drafted, positions = history[-MAX_ORDER - 1:], [], [], []
        copy, length, last, match = None, 0, -1, None  # the index copied from, the copy's length, its last position
        while len(walk) < d.limit:
            # A copy goes on while its text does: no longer context than the copy's own can occur
            # elsewhere, since it starts at least as long as the longest one matched and each step
            # lengthens both by at most one (a context one longer was the shorter one followed by
            # the same token). So only a new copy looks the tail up.
            if copy is not None and copy.goes_on(last):
                index, length = copy, length + 1
                match = index.follow(tail, min(length, MAX_ORDER), last + 1, after=match)
            else:
                index, match = self._longest(session.index, shared, tail)
                if match is None:  # nothing before continues it: the round ends here
                    break
                if copy is None and index is session.index and session.cursor is not None and (
                        near := index.nearest(history, session.cursor))[1] >= match.order:
                    length = near[1]
                    match = index.follow(tail, min(length, MAX_ORDER), near[0])
                else:  # the copy's length: past the longest context, as far as the earlier text goes on equal
                    length = index.run(history, drafted, match.position)
            copy, last = index, match.position
            tail = tail[-MAX_ORDER:] + [match.token]
            drafted.append(match.token)
            judged, bucket = stats.judge(length, match.frequency, greedy)
            walk.append((DraftStep(len(walk) + 1, match.token, None, None, d.row.num_generated, greedy=True,
                                   judged=judged), bucket))
            positions.append(match.position if index is session.index else None)
        session.positions = positions
        return walk

    @staticmethod
    def _longest(own: SuffixIndex, shared: SuffixIndex | None, tail: list[int]) -> tuple[SuffixIndex, Match | None]:
        """The index with the longest context ending `tail`, and its match: the session's own on a
        tie with its earlier responses (None: neither continues it)."""
        match = own.match(tail)
        if shared is not None and (found := shared.match(tail)) is not None and (
                match is None or found.order > match.order):
            return shared, found
        return own, match

    @staticmethod
    def _choose(rows: list[Drafting], walks: dict, plan: StepPlan, batch: int) -> StepBudget:
        """The budgeted rows' rounds at once: the step's budget keeps the candidates of highest
        survival across the rows (each row's a prefix of its walk: survival falls along it)."""
        sessions = batch + plan.other_sessions
        budget = StepBudget(plan.costs, expected=float(sessions), tokens=sessions)
        flat = []
        for d in rows:
            survive = 1.0
            for i, (step, _) in enumerate(walks[d]):
                survive *= step.judged
                flat.append((d, i, survive))
        kept = budget.keep([survive for *_, survive in flat])
        counts = {d: 0 for d in rows}
        for (d, i, _), keep in zip(flat, kept):
            if keep and i == counts[d]:  # (a prefix, whatever ties the order broke)
                counts[d] += 1
        for d in rows:
            for step, _ in walks[d][:counts[d]]:
                d.append(step)
                d.acceptance.append(step.judged)
                budget.add(d.survive)
        return budget

    @staticmethod
    def _decide(rows: list[Drafting], walks: dict) -> None:
        """Rows whose policy decides on its own: candidate by candidate, every row in step."""
        active, taken = list(rows), 0
        while active := [d for d in active if taken < len(walks[d])]:
            active = still_drafting(active, [walks[d][taken][0] for d in active], None)
            taken += 1

    def probe(self, sizes: Sequence[int]) -> list[PassTiming]:
        """Time a drafting step of n sessions for each n of `sizes` on scratch sessions, as
        `propose` times its steps (a model's probe, workers.py `probe_drafting`, does the same)."""
        timings = []
        for n in sizes:
            rows = [DraftRow(SuffixSession(), [7, 8, 9, 7, 8], FixedK(1), 1, 0, SamplingParams(), None)
                    for _ in range(n)]
            timed: list[PassTiming] = []
            self.propose(rows, StepPlan(), timed)
            timings.append(PassTiming("draft", n, timed[0].ms, probe=True))
        return timings


class FusedProposer:
    """The suffix draft fused with a model draft (`--draft suffix+SOURCE`): a budgeted row's round
    is the suffix's candidates, the model's, or the suffix's followed by the model's continuation,
    whichever the step's budget prices best. The suffix walks every budgeted row first and the
    step's budget keeps its candidates across the batch as the suffix draft's own rounds do
    (`SuffixProposer.rounds`); for a row the plan does not hold (`DraftRow.held`: the planner found
    no model round pays for it), only as far as the suffix's estimates stay at least the model's
    acceptance measured by the planner (`StepPlan.acceptance`): past that the model drafts better.
    Then the model drafts, on the same budget, for the rows not held: a row whose suffix kept
    nothing from scratch; a row whose suffix kept candidates after them, where its budget expects
    the model's next candidates at that acceptance to pay for its step (`StepBudget.draft_on`), its
    first pass feeding them (`DraftRow.prefix`; not a feature draft's, which has no target states
    there). Any other policy drafts with the model alone (and no fused round is drafted ahead: loop.py).

    Sampled, each candidate carries the distribution it was drawn from: one-hot for the suffix's,
    the model's q for its continuation, drawn after the suffix's as the history it conditions on."""

    def __init__(self, model: ModelProposer, suffix: SuffixDraft):
        self.model, self.suffix = model, SuffixProposer(suffix)

    @property
    def link(self) -> WaitingStates | None:
        """A feature draft's: where its target's states wait in process (workers.py `FeatureLink` sets it)."""
        return getattr(self.model, "link", None)

    @link.setter
    def link(self, link: WaitingStates | None) -> None:
        self.model.link = link

    def check_policy(self, policy: StoppingPolicy) -> None:
        self.model.check_policy(policy)

    def take_inputs(self, kv: KVSession, item: ProposeItem, history: list[int]) -> bool:
        SuffixProposer.refuse_ahead(item)
        if kv.suffix is None:
            kv.suffix = SuffixSession()
        self.suffix.open(kv.suffix, item, history)
        return self.model.take_inputs(kv, item, history)

    def ended(self, kv: KVSession, history: list[int]) -> Callable[[], None] | None:
        return self.suffix.ended(kv.suffix, history) if kv.suffix is not None else None

    def propose(self, rows: list[DraftRow], plan: StepPlan, timings: list[PassTiming]) -> list[Proposal]:
        walked = [b for b, row in enumerate(rows) if row.policy.traits.budgeted]
        drafting, budget = self.suffix.rounds([replace(rows[b], session=rows[b].session.suffix) for b in walked],
                                              plan, len(rows), self.model.draft.device, plan.acceptance)
        answers: list[Proposal | None] = [None] * len(rows)
        suffix_of = dict(zip(walked, drafting))
        going = [b for b, row in enumerate(rows) if not row.held and (b not in suffix_of or not suffix_of[b].acceptance)]
        # (a feature draft has no target states at the suffix's candidates: it drafts from scratch only)
        after = [b for b in walked if not rows[b].held and suffix_of[b].acceptance and suffix_of[b].left > 0
                 and not self.model.draft.reads_features]
        if budget is not None and after and plan.acceptance is not None:  # the model continues where it pays
            d_after = [suffix_of[b] for b in after]
            on = budget.draft_on([d.survive for d in d_after], [plan.acceptance] * len(after),
                                 [d.left for d in d_after], beside=len(going))
            going += [b for b, go in zip(after, on) if go]
        going.sort()
        for b, d in suffix_of.items():
            answers[b] = d.proposed()
        model_rows = [replace(rows[b], prefix=self._prefix(suffix_of[b])) if b in suffix_of else rows[b] for b in going]
        proposals = in_groups(model_rows, self.model.draft.max_pass_sessions, lambda group: propose(
            self.model.draft, group, plan.costs, plan.other_sessions + len(rows) - len(group), timings,
            self.model.logits_filter, budget))
        for b, proposal in zip(going, proposals):
            answers[b] = proposal
        return [answer if answer is not None else Proposal() for answer in answers]

    @staticmethod
    def _prefix(d: Drafting) -> list[DraftStep]:
        """The suffix's kept candidates as the steps the model's round starts with."""
        probs = d.proposal.draft_probs or [None] * len(d.proposal.candidates)
        return [DraftStep(i + 1, y, q, None, d.row.num_generated, judged=a)
                for i, (y, q, a) in enumerate(zip(d.proposal.candidates, probs, d.acceptance))]


def proposer_for(draft: DraftRole, logits_filter: LogitsFilterFactory | None = None):
    """The proposer of this kind of draft."""
    if isinstance(draft, SuffixDraft):
        return SuffixProposer(draft)
    model = (FeatureProposer if draft.reads_features else ModelProposer)(draft, logits_filter)
    return model if draft.suffix is None else FusedProposer(model, draft.suffix)
