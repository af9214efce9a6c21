"""The round loop: the paper's MDP step, written once, over a batch of sessions.

    while sessions:
        admit(waiting)                        # requests join between steps; their prefill joins this step
        plan = budget(batch, live_costs)      # does drafting pay at all this step? (else K = 0 for all)
        proposals = propose(batch, plan)      # one batched call: draft steps; the step's budget decides who drafts on
        verdicts = verify(batch, proposals)   # one batched call: a ragged target pass, rollback per session
        for s in batch:
            commit(s); decide(s)              # history, stream, stop conditions; finished sessions leave

The costs are measured where the loop runs: every drafting step and verification is timed on its
replica (workers.py) and the timings come back with the replies into the loop's live profile
(cost_profile.py `LiveCosts`, seeded by the workers' start-up probe); the profile travels with
each Propose, so the draft replica that makes the stop decisions plans with what the loop measured
on every replica (a profile given by hand, SPECDEC_COST_PROFILE, overrides it). When no allocation
of candidates beats plain decoding the budgeted sessions skip the draft altogether, and once every
`probe_interval` such steps one of them carries a probe: the draft times a scratch pass of the
step's size and the verifier one a token longer, the costs that are otherwise not measured while the
draft is off (the probes take PROBE_SHARE of the time, budget.py). And where the budget weighs a
pass longer than the live target curve has measured, the verifier times one of the next power of two
before the step's decision (`_curve_probe`): once per size, paid for by CURVE_PROBE_SHARE of the plain
steps. A step that sends no budgeted session to the draft is priced again only every REPRICE_STEPS
steps while its sessions stay the same.

A `RoundTransport` carries the two calls: the in-process workers (`LocalTransport`, below), gRPC
stubs or Ray Serve handles (services/); the loop does not know which. The loop's history is the
truth and a worker's session a cache of it (specdec/protocol.py): each call sends a session only the
tokens its worker has not seen; a `SessionMissing` answer gets the round again with the whole
history; an `Unreachable` one (the replica is gone) is retried, after a backoff, elsewhere. Rounds
draw their random numbers from (request seed, sample, round, role), so a retried round, or one on
another replica, draws the same numbers. What shares a pass changes only rounding (fp32), and the
output is the target's whatever the draft proposes; the one visible effect is the int8 draft's
(models/formats.py): it scales activations per pass, so a seeded sampled request's draws may depend
on what shares its draft steps, while greedy outputs never do.

Sessions join and leave between steps (continuous batching): a request's samples join the lane with
the fewest sessions; a finished, failed or cancelled session leaves at once and its workers' caches
are freed. A step takes at most `max_sessions_per_step` sessions, the others wait their turn
(round robin). With `lanes` > 1 each lane is a loop of its own over its own sessions, so the draft
can draft one lane's batch while the verifier checks another's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.budget import (CURVE_PROBE_SHARE, IN_STEP_LAG, MAX_CANDIDATES, PRIOR_ACCEPTANCE, PRIOR_WEIGHT,
                            PROBE_SHARE, STOP_RATE_DECAY, StepPlan, best_allocations, curve_probe,
                            draining_allocation, expected_remaining, hopeful_acceptance, rest_after, who_drafts)
from specdec.cost_profile import CostProfile, LiveCosts, given_profile
from specdec.errors import InvalidRequestError, Unavailable
from specdec.metrics import MS_PER_S, RequestStats
from specdec.params import FINISH_LENGTH, GenerationParams, validation_message
from specdec.policies import PolicyTraits, policy_traits, resolve_policy
from specdec.protocol import (ROLES, BatchReply, CallTiming, Failed, ProposeItem, ProposeReply, Refused, Role,
                              RoundSeed, SessionMissing, Unreachable, VerifyItem, VerifyReply, delta_for)
from specdec.rounds import SEED_BITS, Proposal
from specdec.sequences import RequestRules, SampleState
from specdec.workers import DraftWorker, VerifierWorker

logger = logging.getLogger(__name__)

NO_PROPOSAL = Proposal()  # target-only rounds verify no candidates
# Best effort: a replica that cannot free a session this soon has lost it (its LRU/TTL frees it).
RELEASE_TIMEOUT_S = 10.0
ACCEPTANCE_DECAY = 0.99  # per drafted round: the loop's acceptance follows the last ~100 rounds


class BatchConfig(BaseModel):
    """How many sessions share a step, and how the work is cut into passes."""

    model_config = ConfigDict(extra="forbid")

    # Sessions one step advances at most; the others wait for the next step (round robin).
    max_sessions_per_step: int = Field(16, ge=1)
    # Tokens one forward pass feeds at most (a longer batch runs as several passes; a single
    # session's feed is never split). None: no limit. Read by the runtimes (builder.py).
    max_tokens_per_pass: int | None = Field(None, ge=1)
    # Concurrent loops over disjoint sessions: 2 lets the draft work on one lane's batch while the
    # verifier checks the other's (served; in process the calls run on one thread anyway).
    lanes: int = Field(1, ge=1, le=8)

    @classmethod
    def from_flags(cls, **flags) -> BatchConfig:
        """From command-line flags (None: the default); raises InvalidRequestError in one line."""
        try:
            return cls(**{key: value for key, value in flags.items() if value is not None})
        except ValidationError as exc:
            raise InvalidRequestError(validation_message(exc)) from None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}


@dataclass
class GenerationResult:
    completions: list[Completion]
    stats: RequestStats
    prompt_tokens: int

    def to_dict(self) -> dict:
        return {"completions": [c.to_dict() for c in self.completions], "stats": self.stats.to_dict()}


# on_update(sample_index, new_token_ids, new_text, finish_reason): after every round that committed
# something, and once with the finish reason (which may come with the last tokens).
UpdateCallback = Callable[[int, list[int], str, str | None], None]


class RoundTransport(Protocol):
    """Carries batched round calls to the workers; each answer comes back in its item's place.

    A replica that is gone makes its items `Unreachable` (the loop retries them), a call that
    failed otherwise makes them `Failed`; anything raised fails every session of the call."""

    async def propose(self, items: list[ProposeItem], plan: StepPlan) -> ProposeReply: ...

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> VerifyReply:
        """`probe_tokens` > 0: the verifier also times a scratch pass of that many tokens (with no
        items, only that)."""

    async def release(self, role: Role, session_ids: list[str]) -> None: ...


class RoundObserver(Protocol):
    """Metrics sink (services/metrics.py)."""

    def on_round(self, num_candidates: int, num_accepted: int, policy: str) -> None: ...

    def on_call(self, role: Role, compute_ms: float, transport_ms: float, num_bytes: int) -> None: ...

    def on_request(self, stats: RequestStats, policy: str, ok: bool) -> None: ...

    def on_costs(self, profile: CostProfile, drafting: bool) -> None: ...


@dataclass
class RetryPolicy:
    """How long a session waits for a replica to come back (a restart takes seconds)."""

    attempts: int = 30
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def backoff(self, attempt: int) -> float:
        return min(self.first_backoff_s * 2 ** attempt, self.max_backoff_s)


@dataclass(eq=False)
class Request:
    """What a request's samples share."""

    params: GenerationParams
    seed: int
    stats: RequestStats = field(default_factory=RequestStats)
    on_update: UpdateCallback | None = None
    reference: list[int] | None = None  # the oracle's hindsight


@dataclass(eq=False)
class Sequence:
    """One sample while the loop decodes it: a session on the workers."""

    session_id: str
    index: int  # which of the request's samples
    request: Request
    sample: SampleState
    done: asyncio.Future  # the sample's outcome: set once its workers' caches are released
    round_index: int = 0
    synced: dict = field(default_factory=lambda: {"draft": None, "verifier": None})  # history length each side holds
    drafted_at: int = 0  # history length the draft has seen when it last ran: its cache lags the rest
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # every round's (K, n), for a draft that rebuilds
    unsent: int = 0  # outcomes the draft has not been told about
    # Drafting rounds in a row that verified nothing (the draft ran, the step's budget kept no
    # candidate), and the history length before which the session does not draft again (rest_after).
    empty_rounds: int = 0
    rests_until: int = 0
    contacted: set = field(default_factory=set)  # roles that may hold the session: released when it leaves
    error: BaseException | None = None

    @property
    def traits(self) -> PolicyTraits:
        return policy_traits(self.request.params.policy.name)

    @property
    def over(self) -> bool:
        """Finished, failed or cancelled: it leaves the loop at the next step boundary."""
        return self.sample.finish_reason is not None or self.error is not None or self.done.done()


class RoundLoop:
    def __init__(self, transport: RoundTransport, rules: RequestRules, batch: BatchConfig = BatchConfig(),
                 observer: RoundObserver | None = None, retry: RetryPolicy = RetryPolicy(),
                 costs: LiveCosts | None = None, probe_share: float = PROBE_SHARE):
        self.transport, self.rules, self.batch = transport, rules, batch
        self.observer, self.retry = observer, retry
        self.costs = costs if costs is not None else LiveCosts()
        self.probe_share = probe_share
        self.drafting = True  # the last step's answer to "does drafting pay at all" (budget.py)
        self._off_steps = 0  # steps since the draft last ran or probed while it is off
        # where the last priced step sent no budgeted session to the draft: what it was priced for
        # (its sessions, those ready to draft, the candidate cap) and the steps since (REPRICE_STEPS)
        self._idle_key: tuple | None = None
        self._idle_age = 0
        self._idle_profile: CostProfile | None = None
        # target pass sizes past the live curve probed so far (once per power of two of sessions), and the
        # plain-step time since the last such probe times CURVE_PROBE_SHARE: what the next one may cost (the
        # first is free)
        self._curve_probed: set[tuple[int, int]] = set()  # (tokens, bit length of the step's sessions)
        self._curve_credit_ms = math.inf
        # candidates accepted and verified, decayed by ACCEPTANCE_DECAY a round: the acceptance
        # a catch-up is judged at (budget.hopeful_acceptance)
        self._accepted, self._verified = PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT
        # finished samples that stopped early (EOS, a stop string) and the tokens finished samples
        # generated, decayed by STOP_RATE_DECAY a sample: how long a catch-up is repaid for
        self._stopped, self._finished_tokens = 0.0, 0.0
        self._lanes: list[list[Sequence]] = [[] for _ in range(batch.lanes)]
        self._tasks: list[asyncio.Task | None] = [None] * batch.lanes
        self._releasing: dict[asyncio.Task, list[Sequence]] = {}  # retired sequences' releases, off the step path

    @property
    def live_sessions(self) -> int:
        """Samples being decoded (or releasing their workers' caches)."""
        return sum(len(lane) for lane in self._lanes) + sum(len(leaving) for leaving in self._releasing.values())

    # ----------------------------------------------------------------------------------------
    # Requests

    async def generate(self, prompt_ids: Seq[int], params: GenerationParams, on_update: UpdateCallback | None = None,
                       reference: Seq[int] | None = None) -> GenerationResult:
        """Decode a request's samples in the shared batch. Raises InvalidRequestError before any
        model work, or the first sample's error. `reference`: the oracle's hindsight, the target's
        greedy tokens for this prompt and budget, when the caller has them (else decoded here,
        untimed)."""
        prompt_ids = list(prompt_ids)
        policy = resolve_policy(params.policy, self.rules.has_head)
        params = params.model_copy(update={"policy": policy})
        self.rules.validate(prompt_ids, params)
        if params.policy.name != "oracle":
            reference = None
        elif reference is None:
            alone = params.model_copy(update={"policy": params.policy.model_copy(update={"name": "target-only"}), "n": 1})
            reference = (await self.generate(prompt_ids, alone)).completions[0].token_ids
        seed = params.sampling.seed if params.sampling.seed is not None else secrets.randbits(SEED_BITS)
        request = Request(params, seed, on_update=on_update, reference=list(reference) if reference else None)
        session = uuid.uuid4().hex  # ours, never the client's request id: two requests must not share caches
        loop = asyncio.get_running_loop()
        samples = [Sequence(f"{session}/{i}", i, request, SampleState(prompt_ids), loop.create_future())
                   for i in range(params.n)]
        start = time.perf_counter()
        ok = False
        try:
            for s in samples:
                self.submit(s)
            await asyncio.gather(*(s.done for s in samples))
            ok = True
        finally:
            for s in samples:
                self.cancel(s)
            request.stats.wall_time_s = time.perf_counter() - start
            if self.observer:
                self.observer.on_request(request.stats, params.policy.name, ok)
        completions = [Completion(s.sample.text, s.sample.generated, s.sample.finish_reason or FINISH_LENGTH)
                       for s in samples]
        return GenerationResult(completions, request.stats, prompt_tokens=len(prompt_ids))

    def submit(self, sequence: Sequence) -> None:
        """The sequence joins the lane with the fewest sessions, at its next step."""
        running_loop = asyncio.get_running_loop()
        if any(t is not None and not t.done() and t.get_loop() is not running_loop for t in self._tasks):
            raise RuntimeError("a RoundLoop serves one event loop at a time")
        lane = min(range(len(self._lanes)), key=lambda i: len(self._lanes[i]))
        self._lanes[lane].append(sequence)
        task = self._tasks[lane]
        if task is None or task.done():
            self._tasks[lane] = running_loop.create_task(self._run(lane))

    def cancel(self, sequence: Sequence) -> None:
        """The sequence leaves at the next step boundary (its caches are freed then); a no-op once it is done."""
        if not sequence.done.done():
            sequence.done.cancel()
        elif not sequence.done.cancelled():
            sequence.done.exception()  # retrieved: a sample that failed beside another needs no warning

    # ----------------------------------------------------------------------------------------
    # The loop

    async def _run(self, lane: int) -> None:
        running = self._lanes[lane]
        try:
            while True:
                await asyncio.sleep(0)  # requests join, cancellations land
                self._retire([s for s in running if s.over], running)
                if not running:
                    return
                batch = running[:self.batch.max_sessions_per_step]
                if len(running) > len(batch):  # round robin: the others go first next step
                    running[:] = running[len(batch):] + batch
                await self._step(batch)
        except BaseException as exc:  # a bug in the loop: every sample fails rather than hangs
            for s in running:
                if not s.done.done():
                    s.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError("the round loop stopped"))
            running.clear()
            raise

    @property
    def acceptance(self) -> float:
        """The rounds' measured acceptance: P(a candidate is accepted | the ones before were), as
        accepted / (accepted + rejected) over recent rounds, from PRIOR_ACCEPTANCE."""
        return self._accepted / self._verified

    @property
    def catch_up_acceptance(self) -> float:
        """The acceptance a lagging draft's catch-up is judged at: the upper end of the measured one
        (budget.hopeful_acceptance)."""
        return hopeful_acceptance(self._accepted, self._verified)

    @property
    def stop_rate(self) -> float:
        """P(a token ends its generation) over recently finished samples (0 before any)."""
        return self._stopped / self._finished_tokens if self._finished_tokens else 0.0

    def cost_profile(self, sessions: int | None = None) -> CostProfile | None:
        """What the step's budget plans with: a profile given by hand, else the live one for a step of
        `sessions` sessions (None until both roles are measured; `sessions` None: every pass measured)."""
        return given_profile() or self.costs.profile(sessions)

    async def _budget(self, batch: list[Sequence]) -> tuple[list[Sequence], Sequence | None, StepPlan]:
        """The sessions that call the draft this step, the one that probes it (None: no probe; the
        verifier then times a pass one token longer after the step) and the plan they carry. Where
        the decision priced a target pass past the measured curve, the verifier times one first and
        the step is decided again with it: decided after, the sessions of a burst that joins a new
        level caught up a step late (torch, 16 sessions: a plain step of 16 tokens where fixed:4
        made ~77, ~3% of the run; docs/benchmarks.md)."""
        drafting, curve_tokens = self._who_drafts(batch)
        if curve_tokens:
            await self._probe_target(curve_tokens, len(batch))
            drafting, _ = self._who_drafts(batch)
        if not any(s.traits.uses_draft and s.traits.budgeted for s in batch):  # nothing this step reads the costs
            return drafting, None, StepPlan(other_sessions=len(batch) - len(drafting))
        # the costs the step's answer was priced with (an answer that stands: those of its pricing)
        profile = self._idle_profile if self._idle_key is not None else self.cost_profile(len(batch))
        probe = self._off_probe(batch, profile)
        if probe is not None:
            drafting.append(probe)
            self._idle_key = None  # the next step is priced with what the probe measures
        if profile is not None:  # what the next curve probe may cost
            self._curve_credit_ms += CURVE_PROBE_SHARE * profile.pass_ms(len(batch))
        return drafting, probe, StepPlan(profile, other_sessions=len(batch) - len(drafting))

    def _who_drafts(self, batch: list[Sequence]) -> tuple[list[Sequence], int]:
        """The sessions that call the draft this step, and the size of a target pass to time before
        deciding (0: none; `_curve_probe`): budgeted sessions skip the draft while no allocation
        beats plain decoding, one resting after drafting rounds that verified nothing
        (`budget.rest_after`) skips it, and one whose draft would first have to catch up skips it
        while that does not pay. Where that sent no budgeted session to the draft, the answer
        stands for REPRICE_STEPS steps of the same sessions (the same ones ready to draft) unless a
        probe times something meanwhile."""
        drafting = [s for s in batch if s.traits.uses_draft]
        budgeted = [s for s in drafting if s.traits.budgeted]
        if not budgeted:
            return drafting, 0
        ready = [s for s in budgeted if len(s.sample.history) >= s.rests_until]
        cap = max(s.request.params.policy.k or MAX_CANDIDATES for s in budgeted)
        key = (tuple(s.session_id for s in batch), tuple(s.session_id for s in ready), cap)
        if key == self._idle_key and self._idle_age < REPRICE_STEPS:
            self._idle_age += 1
            return [s for s in drafting if not s.traits.budgeted], 0
        chosen, curve_tokens, profile = self._priced(batch, drafting, ready, cap)
        idle = not curve_tokens and not any(s.traits.budgeted for s in chosen)
        self._idle_key, self._idle_age, self._idle_profile = (key, 0, profile) if idle else (None, 0, None)
        return chosen, curve_tokens

    def _priced(self, batch: list[Sequence], drafting: list[Sequence], ready: list[Sequence],
                cap: int) -> tuple[list[Sequence], int, CostProfile | None]:
        """`_who_drafts` from the step's costs, and the costs."""
        profile = self.cost_profile(len(batch))
        if profile is None:
            return drafting, 0, profile
        # every candidate accepted (the bound), the upper end of the measured acceptance, and it
        bound, hopeful, likely = best_allocations(profile, len(batch), cap,
                                                  (1.0, self.catch_up_acceptance, self.acceptance))
        self.drafting = bound.saving > 0
        # who may catch up is judged at the upper end of the measured acceptance, what the sessions
        # will draft at the measured one (where nothing pays at the upper end, nothing does below
        # it); the curve is probed up to what they will draft, where none drafts (the draft off, or
        # no catch-up paying) up to a first candidate's B + 1 tokens
        hopeful = hopeful if self.drafting else bound
        likely = likely if hopeful.drafters else hopeful
        if self.observer:
            self.observer.on_costs(profile, self.drafting)
        if not self.drafting:
            return ([s for s in drafting if not s.traits.budgeted], self._curve_probe(profile, len(batch), len(batch) + 1),
                    profile)
        # a lagging draft catches up only where that may pay; a resting session waits
        lags = [len(s.sample.history) - s.drafted_at for s in ready]
        left = [s.request.params.max_new_tokens - len(s.sample.generated) for s in ready]
        judged = hopeful if all(lag <= IN_STEP_LAG for lag in lags) else draining_allocation(
            profile, hopeful, len(batch), cap, self.catch_up_acceptance, statistics.median_low(left),
            self.stop_rate)
        joins = who_drafts(profile, judged, len(batch), lags, [expected_remaining(n, self.stop_rate) for n in left])
        joined = {s for s, join in zip(ready, joins) if join}
        wanted = max(likely.drafters * likely.candidates, 1) if joined else 1
        return ([s for s in drafting if not s.traits.budgeted or s in joined],
                self._curve_probe(profile, len(batch), len(batch) + wanted), profile)

    def _off_probe(self, batch: list[Sequence], profile: CostProfile | None) -> Sequence | None:
        """While the draft is off, once every `probe_interval` steps a budgeted session carries a
        probe (the draft times a scratch step of the step's size, the verifier a pass one token
        longer: the pass a first candidate would make). Without a profile nothing decided the draft
        off this step (`_who_drafts` kept the budgeted sessions drafting), so nothing probes."""
        budgeted = [s for s in batch if s.traits.uses_draft and s.traits.budgeted]
        if self.drafting or not budgeted or profile is None:
            return None
        self._off_steps += 1
        if self._off_steps < probe_interval(profile, len(batch), self.probe_share):
            return None
        self._off_steps = 0
        return budgeted[0]

    async def _probe_target(self, tokens: int, sessions: int) -> None:
        """Time one scratch target pass of `tokens` tokens for the live profile of a step of
        `sessions` sessions. A probe that fails fails no session: the budget goes on without it."""
        try:
            reply = await self.transport.verify([], probe_tokens=tokens)
        except Exception:  # noqa: BLE001 - a failed probe costs only its measurement
            logger.warning("the verifier's probe of a %d-token pass failed", tokens, exc_info=True)
            return
        self.costs.observe(reply.passes, sessions=sessions)

    def _curve_probe(self, profile: CostProfile, sessions: int, wanted: int) -> int:
        """The size of a target pass to time before this step's decision (0: none): where the budget weighs passes
        of up to `wanted` tokens past what the live curve has measured (`budget.curve_probe`), each
        size once per power of two of the step's sessions (`LiveCosts.profile`: a pass timed in steps
        of half as many sessions does not price a step's): the first at once (a pass the budget is
        about to price), each later one once CURVE_PROBE_SHARE of the plain steps since the last
        pays for it. A profile given by hand is not probed."""
        if given_profile() is not None:
            return 0
        size = curve_probe(profile, wanted)
        key = (size, sessions.bit_length())
        if size is None or key in self._curve_probed or self._curve_credit_ms < profile.pass_ms(size):
            return 0
        self._curve_probed.add(key)
        self._curve_credit_ms = 0.0
        return size

    async def _step(self, batch: list[Sequence]) -> None:
        # propose
        drafting, probe, plan = await self._budget(batch)
        proposals = await self._call("draft", drafting, partial(self._propose_item, probe=probe),
                                     lambda items: self.transport.propose(items, plan), len(batch))
        for s, proposal in proposals.items():
            s.unsent = 0
            if proposal.forward_passes:  # the draft caught up with the history and fed y_1 .. y_{K-1}
                s.drafted_at = len(s.sample.history) + max(len(proposal.candidates) - 1, 0)
        # verify
        verifying = [s for s in batch if not s.over and (s in proposals or s not in drafting)]
        probe_tokens = len(batch) + 1 if probe is not None else 0  # the pass a first candidate would make
        verdicts = await self._call("verifier", verifying, partial(self._verify_item, proposals=proposals),
                                    partial(self.transport.verify, probe_tokens=probe_tokens), len(batch))
        # commit, decide
        for s, verdict in verdicts.items():
            if not s.over:
                try:
                    self._commit(s, proposals.get(s, NO_PROPOSAL), verdict)
                except Exception as exc:  # noqa: BLE001 - one session's failure (a bad verdict, decoding) is its own
                    logger.exception("commit failed for session %s", s.session_id)
                    self._fail(s, exc)

    def _propose_item(self, s: Sequence, full: bool, probe: Sequence | None = None) -> ProposeItem:
        history, params = s.sample.history, s.request.params
        return ProposeItem(
            session_id=s.session_id, history=delta_for(history, None if full else s.synced["draft"]),
            policy=params.policy, sampling=params.sampling, max_candidates=self.rules.candidate_budget(s.sample, params),
            num_generated=len(s.sample.generated), rounds=list(s.outcomes if full else s.outcomes[len(s.outcomes) - s.unsent:]),
            seed=RoundSeed(s.request.seed, s.index, s.round_index), reference=s.request.reference, probe=s is probe)

    def _verify_item(self, s: Sequence, full: bool, proposals: dict) -> VerifyItem:
        proposal = proposals.get(s, NO_PROPOSAL)
        return VerifyItem(
            session_id=s.session_id, history=delta_for(s.sample.history, None if full else s.synced["verifier"]),
            candidates=proposal.candidates, draft_probs=proposal.draft_probs, sampling=s.request.params.sampling,
            seed=RoundSeed(s.request.seed, s.index, s.round_index))

    async def _call(self, role: Role, sequences: list[Sequence], build: Callable[[Sequence, bool], object],
                    send: Callable[[list], object], step_sessions: int) -> dict[Sequence, object]:
        """One batched call for every sequence (as deltas) of a step of `step_sessions` sessions;
        SessionMissing answers are sent again in full, Unreachable ones retried after a backoff;
        Refused ones fail their sequence only."""
        results: dict[Sequence, object] = {}
        pending = [s for s in sequences if not s.over]
        for attempt in range(self.retry.attempts):
            if not pending:
                return results
            items = [build(s, s.synced[role] is None) for s in pending]
            for s in pending:
                s.contacted.add(role)
            try:
                reply: BatchReply = await send(items)
            except Exception as exc:  # noqa: BLE001 - a failure of the call itself fails its sessions, no others
                logger.exception("%s call failed", role)
                for s in pending:
                    self._fail(s, exc)
                return results
            self._record(role, pending, reply.calls)
            self.costs.observe(reply.passes, sessions=step_sessions)
            again, lost = [], False
            for s, item, answer in zip(pending, items, reply.answers):
                if s.over:
                    continue
                match answer:
                    case SessionMissing():
                        if item.history.full:
                            self._fail(s, RuntimeError(f"the {role} answered session_missing to a full history"))
                        else:
                            s.synced[role] = None
                            again.append(s)
                    case Unreachable(reason=reason):
                        logger.warning("%s call for session %s failed (%s); retrying", role, s.session_id, reason)
                        s.synced[role] = None
                        again.append(s)
                        lost = True
                    case Refused(reason=reason):
                        self._fail(s, InvalidRequestError(reason))
                    case Failed(error=error):
                        self._fail(s, error)
                    case _:
                        s.synced[role] = item.history.length
                        results[s] = answer
            pending = again
            if lost and pending:
                await asyncio.sleep(self.retry.backoff(attempt))
        for s in pending:
            self._fail(s, Unavailable(f"the {role} serving this request did not come back; retry"))
        return results

    def _record(self, role: Role, sequences: list[Sequence], calls: list[CallTiming]) -> None:
        """Each request in a call is charged the call's time once (it waited that long), however
        many of its samples the call carried, and its own items' share of the call's bytes."""
        for call in calls:
            transport_s = max(call.wall_s - call.compute_s, 0.0)
            items = Counter(sequences[i].request for i in call.indices)  # a request's items in the call
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

    def _commit(self, s: Sequence, proposal: Proposal, verdict) -> None:
        request, k, n = s.request, len(proposal.candidates), verdict.num_accepted
        if not 0 <= n <= k or not 0 <= verdict.next_token < self.rules.vocab_size:
            raise RuntimeError(f"the verifier answered an impossible verdict ({n} of {k} accepted, "
                               f"next token {verdict.next_token})")
        s.outcomes.append((k, n))
        s.unsent += 1
        if k:  # n accepted, then one rejected unless all k were
            self._accepted = self._accepted * ACCEPTANCE_DECAY + n
            self._verified = self._verified * ACCEPTANCE_DECAY + n + (n < k)
            s.empty_rounds = 0
        elif proposal.forward_passes and s.traits.budgeted:  # a draft pass spent for an empty round
            s.empty_rounds += 1
            s.rests_until = len(s.sample.history) + 1 + rest_after(s.empty_rounds)
        s.round_index += 1
        request.stats.draft_forward_passes += proposal.forward_passes
        request.stats.record_round(k, n)
        if self.observer:
            self.observer.on_round(k, n, request.params.policy.name)
        new_ids, new_text = self.rules.commit(s.sample, verdict.committed(proposal.candidates), request.params)
        request.stats.generated_tokens += len(new_ids)
        if s.sample.finish_reason is not None:
            self._stopped = self._stopped * STOP_RATE_DECAY + (s.sample.finish_reason != FINISH_LENGTH)
            self._finished_tokens = self._finished_tokens * STOP_RATE_DECAY + len(s.sample.generated)
        # decide: the stop conditions were checked while committing
        if request.on_update and (new_ids or new_text or s.sample.finish_reason):
            request.on_update(s.index, new_ids, new_text, s.sample.finish_reason)

    def _fail(self, s: Sequence, exc: BaseException) -> None:
        if s.error is None and not s.done.done():
            s.error = exc

    def _retire(self, leaving: list[Sequence], running: list[Sequence]) -> None:
        """Sequences that are over leave the lane at once; their workers' caches are freed in the
        background (the next step does not wait for it), then their outcome is set."""
        if not leaving:
            return
        for s in leaving:
            running.remove(s)
        task = asyncio.get_running_loop().create_task(self._release(leaving))
        self._releasing[task] = leaving
        task.add_done_callback(self._releasing.pop)

    async def _release(self, leaving: list[Sequence]) -> None:
        """Best effort: a replica that lost the session (or is gone) has nothing to free."""
        calls = [asyncio.wait_for(self.transport.release(role, ids), RELEASE_TIMEOUT_S) for role in ROLES
                 if (ids := [s.session_id for s in leaving if role in s.contacted])]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):  # the request's result does not depend on it
                logger.debug("a release failed: %s", outcome)
        for s in leaving:
            if not s.done.done():
                if s.error is not None:
                    s.done.set_exception(s.error)
                else:
                    s.done.set_result(None)


# Where a step sent no budgeted session to the draft (the draft off, or no catch-up paying), the same
# sessions are priced again after this many steps, at once when one joins, leaves or ends its rest,
# or a probe times something: only plain passes are timed meanwhile, which move the costs slowly, and
# a lag only grows while the tokens left to repay a catch-up shrink. Pricing a step took ~0.4 ms on
# llama.cpp at one session (the allocation grid, the live profile), 0.8% of a plain step there: most
# of what the default policy added to plain decoding while it drafted nothing.
REPRICE_STEPS = 16


def probe_interval(profile: CostProfile | None, sessions: int, share: float = PROBE_SHARE) -> int:
    """Steps between probes while the draft is off: a probe (a draft pass of the step's size and a
    target pass one token longer) costs `share` of the plain steps in between."""
    if profile is None:
        return 1
    probe_ms = profile.draft_ms(sessions) + profile.pass_ms(sessions + 1)
    return max(1, math.ceil(probe_ms / (share * profile.pass_ms(sessions))))


class LocalTransport:
    """The in-process carrier: the workers called directly on this thread, nothing serialized."""

    def __init__(self, draft: DraftWorker, verifier: VerifierWorker):
        self.draft, self.verifier = draft, verifier

    async def propose(self, items: list[ProposeItem], plan: StepPlan = StepPlan()) -> ProposeReply:
        return self._timed(partial(self.draft.propose, plan=plan), items, self.draft)

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> VerifyReply:
        return self._timed(partial(self.verifier.verify, probe_tokens=probe_tokens), items, self.verifier)

    async def release(self, role: Role, session_ids: list[str]) -> None:
        (self.draft if role == "draft" else self.verifier).release(session_ids)

    @staticmethod
    def _timed(call: Callable[[list], list], items: list, worker: DraftWorker | VerifierWorker) -> BatchReply:
        start = time.perf_counter()
        answers = call(items)
        elapsed = time.perf_counter() - start
        return BatchReply(answers, [CallTiming(list(range(len(items))), elapsed, elapsed)], worker.take_timings())
