"""The step planner: who calls the draft this step, decided before it from the costs measured where
the loop runs (docs/architecture.md, "The step"; docs/planner.md tells why each rule is what it is).

One planner per lane of the loop and draft (a step's sessions may use different drafts, each
planned apart: its own step costs and acceptance, one target pass for them all). It holds all that
deciding needs across steps: the live costs (one `LiveCosts` per draft shared by the lanes: they
run on the same replicas), the acceptance and stop-rate estimates, the reprice cache, the probe
schedule and each session's planning state. It plans and observes its draft's sessions; the
step's others share the target pass as plain sessions. `plan(batch)`
answers before the step (a `StepPlan`), `observe(outcomes, timings)` takes what the step measured.
The arithmetic is `budget.decide_step`, called once per priced step; the draft side then spends a
drafting session's round with the profile the plan carries (`budget.StepBudget`) and decides
nothing else.

Four things are called a probe:
- the start-up probe: each worker times a few scratch passes when it starts (workers.py); the
  timings seed the live costs.
- an off-probe: while the draft is off (and before anything is measured) one budgeted session's
  Propose item carries `probe`, once every `budget.probe_interval` steps: the draft times a scratch
  step of the step's size, the verifier a pass one token longer, the costs the rounds do not time
  while the draft is off.
- a curve probe: where the decision weighs a target pass longer than the measured curve reaches,
  the verifier times one of the next power of two before the step is decided again with it (a
  Verify of no items): each size once per power of two of sessions (again where it failed), paid
  for by CURVE_PROBE_SHARE of the plain steps.
- `Worker.probe(sizes)`: the scratch passes the other three are made of.

After the step's Propose, `ahead` decides who drafts its next round while the step verifies
(BatchConfig.overlap; loop.py): in `auto`, where `budget.overlap_saving` expects it to save time,
pricing the verify phase with factors measured on the steps (`observe_phase`: its wall over its
priced time, with and without rounds drafted ahead): served, draft and verifier work at once where
they do not share cores, and the factor says how far they do. Until it is measured, and once every
OVERLAP_PROBE_STEPS steps that could have overlapped while it is off, a step overlaps to measure it.
In process the calls run one after the other: the loop plans no overlap there (`auto` is off).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass, field

from specdec.budget import (CURVE_PROBE_SHARE, MAX_CANDIDATES, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, PROBE_SHARE,
                            STOP_RATE_DECAY, StepDecision, curve_probe, decide_step, hopeful_acceptance, overlap_saving,
                            rest_after)
from specdec.cost_profile import CostProfile, LiveCosts, PassTiming, given_profile
from specdec.metrics import CATCH_UP, NO_ROUND_PAYS, NOT_MEASURED, RESTING
from specdec.params import DEFAULT_DRAFT, FINISH_LENGTH
from specdec.protocol import StepPlan
from specdec.sequences import LoopSample, RoundObserver

logger = logging.getLogger(__name__)

ACCEPTANCE_DECAY = 0.99  # per drafted round: the acceptance estimate follows the last ~100 rounds
# Where a step sent no budgeted session to the draft, the same sessions are priced again after this
# many steps, at once when one joins, leaves or ends its rest, or after a probe timed something: only
# plain passes are timed meanwhile, and a lag only grows while the tokens left to repay it shrink.
REPRICE_STEPS = 16
# While drafting ahead is off in `auto`, every this many steps that could overlap one does, to
# measure again what it costs; the verify phase's factors follow the last ~10 steps of each kind.
OVERLAP_PROBE_STEPS = 64
PHASE_DECAY = 0.9

TimeTarget = Callable[[int], Awaitable[list[PassTiming]]]  # times one scratch target pass of n tokens


@dataclass
class SessionPlan:
    """A session's planning state."""

    drafted_at: int = 0  # history length the draft had seen when it last ran: its cache lags the rest
    empty_rounds: int = 0  # drafting rounds in a row that verified nothing
    rests_until: int = 0  # history length before which it does not draft again (budget.rest_after)
    # The same for a suffix walk (a model-free draft's, a fused draft's where its model is held):
    # walks in a row whose round verified nothing, and the rest after them.
    empty_walks: int = 0
    walks_rest_until: int = 0


@dataclass(slots=True)
class RoundOutcome:
    """What a committed round tells the planner."""

    session: LoopSample
    drafted_after: int  # the committed history's length when the round was drafted
    candidates: int  # K
    accepted: int  # n
    draft_passes: int  # draft passes the session took part in (0: it did not call the draft)


@dataclass
class _Idle:
    """A priced step that sent no budgeted session to the draft: what it was priced for (its sessions,
    those ready to draft, the candidate cap), with what, and the steps it has stood since."""

    key: tuple
    profile: CostProfile
    age: int = 0


@dataclass
class StepPlanner:
    costs: LiveCosts
    draft: str = DEFAULT_DRAFT  # the draft whose sessions it plans
    time_target: TimeTarget | None = None  # the curve probe's call (None: no curve probes)
    given: CostProfile | None = None  # a profile given by hand: planned with instead of the live one
    observer: RoundObserver | None = None
    probe_share: float = PROBE_SHARE
    drafting: bool = True  # the last priced step's answer to "does any round pay"
    priced: int = 0  # decide_step calls so far
    _off_steps: int = 0  # steps since the draft last ran or probed while it is off (before any cost: steps so far)
    _probe_interval: int = 1  # the last priced step's budget.probe_interval
    _idle: _Idle | None = None
    _curve_probed: set[tuple[int, int]] = field(default_factory=set)  # (tokens, bit length of the step's sessions)
    _curve_credit_ms: float = math.inf  # what the next curve probe may cost (the first is free)
    # candidates accepted and verified, decayed by ACCEPTANCE_DECAY a round
    _accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    _verified: float = PRIOR_WEIGHT
    # finished samples that stopped early (EOS, a stop string) and the tokens finished samples
    # generated, decayed by STOP_RATE_DECAY a sample
    _stopped: float = 0.0
    _finished_tokens: float = 0.0
    _sessions: dict[str, SessionPlan] = field(default_factory=dict)
    _walked: set[str] = field(default_factory=set)  # the sessions whose suffix walked in the last planned step
    overlap: str = "auto"  # BatchConfig.overlap: whether rounds are drafted ahead while a step verifies
    # The verify phase's wall over its priced time (budget.overlap_saving's factors), without and
    # with rounds drafted ahead (None: not measured yet), and the step in flight's (overlapped, ms).
    _phase: dict[bool, float | None] = field(default_factory=lambda: {False: None, True: None})
    _phase_priced: tuple[bool, float] | None = None
    _overlap_waited: int = 0  # steps that could have overlapped since the last that did
    # A draft without passes (models/suffix.py): calling it costs nothing, so every drafting session
    # calls it, and a budgeted round's own budget, over its whole walk, decides what it verifies.
    model_free: bool = False
    # A model draft with the suffix draft fused in (proposers.py `FusedProposer`): the model is
    # planned as any draft's, and every budgeted session calls the draft all the same, its suffix
    # only where the model is held (`ProposeItem.held`); the plan carries the model's acceptance.
    fused: bool = False

    def __post_init__(self):
        # the off-probe's interval divides by it (budget.probe_interval): 0 failed the first step with
        # the draft off, a negative share probed every step; above 1 is an off-probe every such step
        if not self.probe_share > 0:
            raise ValueError(f"probe_share must be above 0 (a share of the plain steps), not {self.probe_share}")

    @property
    def acceptance(self) -> float:
        """P(a candidate is accepted | the ones before were) over recent rounds, from PRIOR_ACCEPTANCE."""
        return self._accepted / self._verified

    @property
    def stop_rate(self) -> float:
        """P(a token ends its generation) over recently finished samples (0 before any)."""
        return self._stopped / self._finished_tokens if self._finished_tokens else 0.0

    @property
    def catch_up_acceptance(self) -> float:
        """The acceptance a lagging draft's catch-up is judged at: the upper end of the measured one."""
        return hopeful_acceptance(self._accepted, self._verified)

    def lag(self, s: LoopSample) -> int:
        """Committed tokens the session's draft has not seen (its prompt, before it first drafts)."""
        return s.sample.length - self._state(s).drafted_at

    def profile(self, sessions: int | None = None) -> CostProfile | None:
        """What a step of `sessions` sessions is priced with (None: nothing measured yet)."""
        return self.given or self.costs.profile(sessions)

    async def plan(self, batch: Sequence[LoopSample]) -> StepPlan:
        """Who of `batch` calls the draft, which session carries an off-probe, and the costs the
        drafting sessions' rounds are spent with. Sessions whose policy is not budgeted draft as
        their policy says; budgeted ones as the costs say."""
        drafting = [s for s in batch if s.traits.uses_draft and s.draft == self.draft]
        budgeted = [s for s in drafting if s.traits.budgeted]
        self._walked = set()
        if self.model_free:
            await self._walk_curve(batch, drafting)
            profile = self.profile(len(batch))
            if profile is not None:
                self._curve_credit_ms += CURVE_PROBE_SHARE * profile.pass_ms(len(batch))
            resting = {s.session_id for s in drafting if self._walk_rests(s)}
            calling = [s for s in drafting if s.session_id not in resting]
            self._walked = {s.session_id for s in calling if s.traits.budgeted}
            return StepPlan(frozenset(s.session_id for s in calling), costs=profile,
                            other_sessions=len(batch) - len(calling), held=dict.fromkeys(resting, RESTING))
        if not budgeted:
            return StepPlan(frozenset(s.session_id for s in drafting), other_sessions=len(batch) - len(drafting))
        if self.fused and await self._walk_curve(batch, budgeted):
            self._idle = None  # priced again with what the probe measured
        ready = [s for s in budgeted if s.sample.length >= self._state(s).rests_until]
        key = (tuple(s.session_id for s in batch), tuple(s.session_id for s in ready),
               max(candidate_cap(s) for s in budgeted))
        if self._idle is not None and self._idle.key == key and self._idle.age < REPRICE_STEPS:
            self._idle.age += 1
            profile, joins = self._idle.profile, [False] * len(ready)
        else:
            profile, joins = await self._price(batch, ready, key)
        joined = {s for s, join in zip(ready, joins) if join}
        why = NOT_MEASURED if profile is None else CATCH_UP if self.drafting else NO_ROUND_PAYS
        held = {s.session_id: why if s in ready else RESTING for s in budgeted if s not in joined}
        calling = [s for s in drafting if not s.traits.budgeted or s in joined]
        probe = self._off_probe(budgeted, profile)
        if probe is not None:
            calling.append(probe)
            self._idle = None  # the next step is priced with what the probe measures
        if profile is not None:
            self._curve_credit_ms += CURVE_PROBE_SHARE * profile.pass_ms(len(batch))
        if self.fused:  # the held sessions' suffix drafts all the same, but where it rests
            walking = [s for s in budgeted if s.session_id in held and s is not probe and not self._walk_rests(s)]
            self._walked = {s.session_id for s in walking}
            calling += walking
        return StepPlan(frozenset(s.session_id for s in calling), probe.session_id if probe else None,
                        len(batch) + 1 if probe else 0, profile, len(batch) - len(calling), held,
                        self.acceptance if self.fused else None)

    async def _price(self, batch: Sequence[LoopSample], ready: list[LoopSample], key: tuple
                     ) -> tuple[CostProfile | None, list[bool]]:
        """The step's profile and who of `ready` joins, from `decide_step`; where the decision
        weighed a pass past the measured curve, one is timed first and the step decided again."""
        profile = self.profile(len(batch))
        if profile is None:
            return None, [False] * len(ready)
        decision = self._decide(profile, len(batch), ready, key[2])
        size = self._curve_probe(decision.curve_probe, profile, len(batch))
        if size:
            self.costs.observe(await self._time_target(size, len(batch)), sessions=len(batch))
            profile = self.profile(len(batch))
            decision = self._decide(profile, len(batch), ready, key[2])
        self._idle = _Idle(key, profile) if not any(decision.joins) and not size else None
        return profile, list(decision.joins)

    def _decide(self, profile: CostProfile, sessions: int, ready: list[LoopSample], cap: int) -> StepDecision:
        self.priced += 1
        decision = decide_step(profile, sessions, cap, self.acceptance, self.catch_up_acceptance,
                               [self.lag(s) for s in ready],
                               [s.request.params.max_new_tokens - len(s.sample.generated) for s in ready],
                               self.stop_rate, self.probe_share)
        self.drafting = decision.pays
        self._probe_interval = decision.probe_interval
        if self.observer:
            self.observer.on_costs(profile, self.drafting, self.draft)
        return decision

    async def _walk_curve(self, batch: Sequence[LoopSample], drafting: Sequence[LoopSample]) -> bool:
        """A curve probe timed where a suffix walk's longest pass (every drafting session's cap of
        candidates) goes past the measured curve: its budget weighs every length of the walk at
        once. Whether one was."""
        profile = self.profile(len(batch))
        if profile is None or not drafting:
            return False
        wanted = len(batch) + sum(candidate_cap(s) for s in drafting)
        if size := self._curve_probe(curve_probe(profile, wanted), profile, len(batch)):
            self.costs.observe(await self._time_target(size, len(batch)), sessions=len(batch))
        return bool(size)

    def _walk_rests(self, s: LoopSample) -> bool:
        """Whether a budgeted session's suffix walk rests this step: where its walks keep verifying
        nothing (nothing repeats), the draft is not called for them at all (its call costs host
        work every step: docs/planner.md, "A free draft")."""
        return s.traits.budgeted and s.sample.length < self._state(s).walks_rest_until

    def _curve_probe(self, size: int | None, profile: CostProfile, sessions: int) -> int:
        """The curve probe to time before the step is decided again (0: none), of the size the
        decision weighed past the curve: each size once per power of two of the step's sessions (a
        pass timed in steps of half as many sessions does not price a step's: `LiveCosts.profile`),
        the first at once, each later one once CURVE_PROBE_SHARE of the plain steps since the last
        pays for it. A profile given by hand is not probed."""
        key = (size, sessions.bit_length())
        if (self.given is not None or self.time_target is None or size is None or key in self._curve_probed
                or self._curve_credit_ms < profile.pass_ms(size)):
            return 0
        self._curve_probed.add(key)
        self._curve_credit_ms = 0.0
        return size

    async def _time_target(self, tokens: int, sessions: int) -> list[PassTiming]:
        """A curve probe that fails fails no session: the step is decided without it, and the size
        is probed again once the plain steps pay for it (marked done, a probe that failed while
        the verifier was away left the size unmeasured for good, and the draft off where only the
        measured pass makes a round pay)."""
        try:
            return await self.time_target(tokens)
        except Exception:  # noqa: BLE001 - a failed probe costs only its measurement
            logger.warning("the verifier's probe of a %d-token pass failed", tokens, exc_info=True)
            self._curve_probed.discard((tokens, sessions.bit_length()))
            return []

    def _off_probe(self, budgeted: list[LoopSample], profile: CostProfile | None) -> LoopSample | None:
        """The session that carries an off-probe this step, if one is due: while nothing is measured
        at the 1st, 2nd, 4th, 8th ... step (a served replica's start-up probe comes back with the
        first), while the draft is off once every `probe_interval` steps."""
        if profile is not None and self.drafting:
            return None
        self._off_steps += 1
        if profile is None:  # powers of two: bounded where the timings never come back
            due = self._off_steps & (self._off_steps - 1) == 0
        else:
            due = self._off_steps >= self._probe_interval
            self._off_steps = 0 if due else self._off_steps
        return budgeted[0] if due else None

    def observe(self, outcomes: Sequence[RoundOutcome], timings: Sequence[PassTiming], sessions: int) -> None:
        """A step of `sessions` sessions: its passes' timings (its draft's and the target's), and
        each committed round's outcome (its draft's sessions' only)."""
        self.costs.observe(timings, sessions=sessions)
        for o in (o for o in outcomes if o.session.draft == self.draft):
            # (a rest counts from the history's length now: the round's own token is committed already)
            if o.session.session_id in self._walked:  # its suffix walked: rest it after empty rounds
                state = self._state(o.session)
                state.empty_walks = 0 if o.candidates else state.empty_walks + 1
                if not o.candidates:
                    state.walks_rest_until = o.session.sample.length + rest_after(state.empty_walks)
            if o.draft_passes:  # the draft caught up with the history and fed y_1 .. y_{K-1}
                state = self._state(o.session)
                state.drafted_at = o.drafted_after + max(o.candidates - 1, 0)
                if o.candidates:
                    state.empty_rounds = 0
                elif o.session.traits.budgeted:  # a draft pass spent for an empty round
                    state.empty_rounds += 1
                    state.rests_until = o.session.sample.length + rest_after(state.empty_rounds)
            # (a fused draft's: the model's rounds; not the oracle's, which drops each candidate the
            # target would reject before it is verified: its rounds never show a rejection)
            if o.candidates and (o.draft_passes or not self.fused) and not o.session.traits.needs_reference:
                # n accepted, then one rejected unless all K were
                self._accepted = self._accepted * ACCEPTANCE_DECAY + o.accepted
                self._verified = self._verified * ACCEPTANCE_DECAY + o.accepted + (o.accepted < o.candidates)
            sample = o.session.sample
            if sample.finish_reason is not None:
                self._stopped = self._stopped * STOP_RATE_DECAY + (sample.finish_reason != FINISH_LENGTH)
                self._finished_tokens = self._finished_tokens * STOP_RATE_DECAY + len(sample.generated)

    def ahead(self, rounds: dict[LoopSample, int], verify_tokens: int, sessions: int) -> list[LoopSample]:
        """Who of `rounds` (sessions of this draft that may draft ahead, each with its round's k)
        drafts its next round while this step, of `sessions` sessions, verifies a pass of
        `verify_tokens` tokens: all or none (they share the draft's steps)."""
        profile = self.profile(sessions)
        if self.overlap == "off" or not rounds:
            chosen = False
        elif self.overlap == "on":
            chosen = True
        elif profile is None:
            chosen = False
        else:
            overlapped = self._phase[True]
            chosen = (overlapped is None or self._overlap_waited >= OVERLAP_PROBE_STEPS or overlap_saving(
                profile, list(rounds.values()), self.acceptance, verify_tokens, (self._phase[False] or 1.0, overlapped)) > 0)
            self._overlap_waited = 0 if chosen else self._overlap_waited + 1
        self._phase_priced = None
        if profile is not None:
            priced = profile.pass_ms(verify_tokens)
            if chosen:
                priced = max(priced, (sum(rounds.values()) / len(rounds) + 1) * profile.draft_ms(len(rounds)))
            # a step that verifies nothing (its sessions lost with a replica) can price its pass at
            # 0 ms on an extrapolated curve: its phase is not measured against that
            self._phase_priced = (chosen, priced) if priced > 0 else None
        return list(rounds) if chosen else []

    def observe_phase(self, wall_ms: float) -> None:
        """The wall time of the step's verify phase (with the rounds drafted ahead, if any)."""
        if self._phase_priced is None:
            return
        overlapped, priced_ms = self._phase_priced
        factor, old = wall_ms / priced_ms, self._phase[overlapped]
        self._phase[overlapped] = factor if old is None else PHASE_DECAY * old + (1 - PHASE_DECAY) * factor

    def forget(self, sessions: Sequence[LoopSample]) -> None:
        """Sessions that left the lane."""
        for s in sessions:
            self._sessions.pop(s.session_id, None)

    def _state(self, s: LoopSample) -> SessionPlan:
        state = self._sessions.get(s.session_id)
        if state is None:
            state = self._sessions[s.session_id] = SessionPlan()
        return state


def candidate_cap(s: LoopSample) -> int:
    """The most candidates a budgeted round of `s` may be priced for: its request's k (MAX_CANDIDATES
    where it gives none), never past the tokens the request may generate (a k of a million made
    every step's price grid a million wide). Fixed per request: the reprice cache keys on it."""
    params = s.request.params
    return min(params.policy.k or MAX_CANDIDATES, params.max_new_tokens)


def lane_planners(lanes: int, drafts: Sequence[str] = (DEFAULT_DRAFT,), time_target: TimeTarget | None = None,
                  observer: RoundObserver | None = None, probe_share: float = PROBE_SHARE, overlap: str = "auto",
                  model_free: Container[str] = (), fused: Container[str] = ()) -> list[dict[str, StepPlanner]]:
    """Each lane's planner for each draft (`model_free`: the drafts without passes; `fused`: the model
    drafts with the suffix draft fused in), over one live profile
    per draft (the lanes' calls go to the same replicas), with the profile given by hand
    (`SPECDEC_COST_PROFILE`) read once, here."""
    costs, given = {draft: LiveCosts() for draft in drafts}, given_profile()
    return [{draft: StepPlanner(costs[draft], draft, time_target, given, observer, probe_share, overlap=overlap,
                                model_free=draft in model_free, fused=draft in fused)
             for draft in drafts} for _ in range(lanes)]
