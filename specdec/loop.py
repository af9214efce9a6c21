"""The round loop: the paper's MDP step, written once, over a batch of sessions.

    while sessions:
        admit(waiting)                          # requests join between steps; their prefill joins this step
        plan = planner.plan(batch)              # who calls the draft (planner.py: the costs measured here)
        proposals = calls.propose(plan)         # one batched call per draft: its sessions' rounds
        verdicts = calls.verify(proposals)      # one batched call: a ragged target pass, rollback per session
          ‖ calls.propose_ahead(...)            # where it pays: the next rounds drafted meanwhile
        for s in batch: commit(s); decide(s)    # history, stream, stop conditions; finished sessions leave
        planner.observe(outcomes, timings)      # the rounds' acceptance, the passes' costs

The step's parts each have one home: the planner decides (planner.py over budget.py's pure
decision), the calls carry the rounds and keep each session's wire state (calls.py: deltas,
retries, replicas that come back), the loop commits what the target verified. docs/architecture.md
("The step") follows one step's batch through them.

Sessions join and leave between steps (continuous batching): a request's samples join the lane with
the fewest sessions; a finished, failed or cancelled session leaves at once and its workers' caches
are freed. A step takes at most `max_sessions_per_step` sessions, the others wait their turn
(round robin). With `lanes` > 1 each lane is a loop of its own over its own sessions, with
planners of its own, so the draft can draft one lane's batch while the verifier checks another's.
Sessions of different drafts (`GenerationParams.draft`) share a step: each draft's planner plans
its sessions and each draft drafts them (concurrently where served), then one Verify checks all.
What shares a pass changes only rounding (fp32), and the output is the target's whatever the draft
proposes; the one visible effect is the int8 draft's (models/formats.py): it scales activations per
pass, so a seeded sampled request's draws may depend on what shares its draft steps, and on whether
its rounds were drafted ahead (which cuts its passes otherwise), while greedy outputs never do.

Drafting ahead (`BatchConfig.overlap`, PEARL's post-verify): while a step verifies, the sessions the
planner chooses draft their next round after the candidates being verified, its first token a guess
of the bonus token (`_keep_ahead` says when it is kept). Where the draft has a device or process of
its own, the step then costs the larger of verifying and drafting ahead instead of their sum.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.budget import PROBE_SHARE
from specdec.calls import NO_PROPOSAL, RetryPolicy, RoundCalls, RoundTransport, calls_overlap
from specdec.errors import InvalidRequestError, validation_message
from specdec.metrics import MS_PER_S, RequestStats
from specdec.params import FINISH_LENGTH, GenerationParams
from specdec.planner import RoundOutcome, StepPlanner, lane_planners
from specdec.protocol import Proposal, StepPlan, request_seed
from specdec.sequences import LoopSample, Request, RequestRules, RoundObserver, SampleState, UpdateCallback
from specdec.sessions import DEFAULT_MAX_SESSIONS
from specdec.verification import Verdict

logger = logging.getLogger(__name__)


class BatchConfig(BaseModel):
    """How many sessions share a step, and how the work is cut into passes."""

    model_config = ConfigDict(extra="forbid")

    # Sessions one step advances at most; the others wait for the next step (round robin).
    max_sessions_per_step: int = Field(16, ge=1)
    # Sessions the loop decodes at once; samples past it wait until one finishes. At most what the
    # workers hold: their session stores (a served app's sessions.max_sessions) and their runtimes'
    # caches (static rows, llama.cpp sequences; the engine and a served app's LiveCap cap it): past
    # it each step would evict the sessions the next one serves (round robin over LRU stores and
    # slots), and every round would resend or re-prefill its session's whole history.
    max_live_sessions: int = Field(DEFAULT_MAX_SESSIONS, ge=1)
    # Positions the live sessions may hold in all: each reserves its prompt and max_new_tokens (at
    # most the context) and a sample that does not fit waits, as TGI's max_batch_total_tokens. Set
    # where the workers' caches share one budget (llama.cpp's unified cache: past it a step whose
    # sessions all fed failed every one of them). None: no limit.
    max_live_positions: int | None = Field(None, ge=1)
    # Tokens one forward pass feeds at most (a longer batch runs as several passes; a single
    # session's feed is never split). None: no limit. Read by the runtimes (builder.py).
    max_tokens_per_pass: int | None = Field(None, ge=1)
    # Concurrent loops over disjoint sessions: 2 lets the draft work on one lane's batch while the
    # verifier checks the other's (served; in process the calls run on one thread anyway).
    lanes: int = Field(1, ge=1, le=8)
    # Draft a session's next round while its round verifies (PEARL's post-verify): `auto` where the
    # planner measures that it saves time (a draft on a device or process of its own), `on`, `off`.
    overlap: Literal["auto", "on", "off"] = "auto"

    def within(self, sessions: int | None, positions: int | None) -> BatchConfig:
        """This config with its live sessions and positions at most what the workers' caches hold
        (None: no limit there)."""
        update = {}
        if sessions is not None and sessions < self.max_live_sessions:
            update["max_live_sessions"] = sessions
        if positions is not None and (self.max_live_positions is None or positions < self.max_live_positions):
            update["max_live_positions"] = positions
        return self.model_copy(update=update)

    @classmethod
    def from_flags(cls, max_batch_sessions: int | None = None, max_pass_tokens: int | None = None,
                   overlap: str | None = None) -> BatchConfig:
        """From the command line's flags (None: the default); raises InvalidRequestError in one line
        that names the flag."""
        flags = {"max_sessions_per_step": max_batch_sessions, "max_tokens_per_pass": max_pass_tokens,
                 "overlap": overlap}
        try:
            return cls(**{key: value for key, value in flags.items() if value is not None})
        except ValidationError as exc:
            names = {"max-sessions-per-step": "max-batch-sessions", "max-tokens-per-pass": "max-pass-tokens"}
            raise InvalidRequestError(validation_message(exc, names)) from None


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


class RoundLoop:
    def __init__(self, transport: RoundTransport, rules: RequestRules, batch: BatchConfig = BatchConfig(),
                 observer: RoundObserver | None = None, retry: RetryPolicy = RetryPolicy(),
                 probe_share: float = PROBE_SHARE):
        self.rules, self.batch, self.observer = rules, batch, observer
        self.calls = RoundCalls(transport, rules, retry, observer)
        # "auto" overlaps nothing where the calls cannot run at once (in process)
        self.overlap = "off" if batch.overlap == "auto" and not calls_overlap(transport) else batch.overlap
        drafts = rules.drafts.items()
        self._planners = lane_planners(batch.lanes, list(rules.drafts), self.calls.time_target, observer, probe_share,
                                       self.overlap, {name for name, traits in drafts if traits.model_free},
                                       {name for name, traits in drafts if traits.fused})
        # each draft's live profile, shared by the lanes (the workers' probes seed it)
        self.costs = {draft: planner.costs for draft, planner in self._planners[0].items()}
        self._lanes: list[list[LoopSample]] = [[] for _ in range(batch.lanes)]
        self._waiting: deque[LoopSample] = deque()  # past max_live_sessions, in arrival order
        self._tasks: list[asyncio.Task | None] = [None] * batch.lanes
        self._releasing: dict[asyncio.Task, list[LoopSample]] = {}  # retired samples' releases, off the step path
        self.retired = 0  # samples that have left the lanes, ever

    @property
    def planners(self) -> list[StepPlanner]:
        """Every lane's planners, lane by lane (the default draft's first)."""
        return [planner for lane in self._planners for planner in lane.values()]

    @property
    def live_sessions(self) -> int:
        """Samples being decoded (or releasing their workers' caches)."""
        return sum(len(lane) for lane in self._lanes) + sum(len(leaving) for leaving in self._releasing.values())

    # ----------------------------------------------------------------------------------------
    # Requests

    async def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                       on_update: UpdateCallback | None = None, reference: Sequence[int] | None = None,
                       counted: bool = True) -> GenerationResult:
        """Decode a request's samples in the shared batch. Raises InvalidRequestError before any
        model work, or the first sample's error. `reference`: the oracle's hindsight, the target's
        greedy tokens for this prompt and budget, when the caller has them (else decoded here,
        untimed, and not `counted` as a request of its own by the observer)."""
        prompt_ids = list(prompt_ids)
        params = self.rules.validate(prompt_ids, params)
        prompt_ids = [operator.index(t) for t in prompt_ids]  # numpy's and torch's integers as Python's
        if params.policy.name != "oracle":
            reference = None
        elif reference is None:
            target_only = params.policy.model_copy(update={"name": "target-only", "k": None, "threshold": None})
            alone = params.model_copy(update={"policy": target_only, "n": 1})
            reference = (await self.generate(prompt_ids, alone, counted=False)).completions[0].token_ids
        request = Request(params, request_seed(params.sampling.seed), on_update=on_update,
                          reference=list(reference) if reference else None)
        session = uuid.uuid4().hex  # ours, never the client's request id: two requests must not share caches
        loop = asyncio.get_running_loop()
        samples = [LoopSample(f"{session}/{i}", i, request, SampleState(prompt_ids), loop.create_future())
                   for i in range(params.n)]
        start = time.perf_counter()
        outcome = "error"
        try:
            for s in samples:
                self.submit(s)
            await asyncio.gather(*(s.done for s in samples))
            outcome = "ok"
        except asyncio.CancelledError:  # its client went away: no fault of the server's
            outcome = "cancelled"
            raise
        finally:
            self.cancel(*samples)  # at once: none of them joins as a sibling waiting ahead of it leaves
            request.stats.wall_time_s = time.perf_counter() - start
            if self.observer and counted:
                self.observer.on_request(request.stats, params.policy.name, outcome)
        completions = [Completion(s.sample.text, s.sample.generated, s.sample.finish_reason or FINISH_LENGTH)
                       for s in samples]
        return GenerationResult(completions, request.stats, prompt_tokens=len(prompt_ids))

    def submit(self, sample: LoopSample) -> None:
        """The sample joins the lane with the fewest sessions, at its next step; past
        max_live_sessions it waits for a session to finish."""
        running_loop = asyncio.get_running_loop()
        if any(t is not None and not t.done() and t.get_loop() is not running_loop for t in self._tasks):
            raise RuntimeError("a RoundLoop serves one event loop at a time")
        self._waiting.append(sample)
        self._admit()

    def set_live_limits(self, batch: BatchConfig) -> None:
        """`batch`'s live limits from now on (a served loop's, as the replicas holding its sessions
        scale): waiting samples join where they now fit; live ones stay past a lowered limit."""
        self.batch = self.batch.model_copy(update={"max_live_sessions": batch.max_live_sessions,
                                                   "max_live_positions": batch.max_live_positions})
        self._admit()

    def _admit(self) -> None:
        """Waiting samples join, in arrival order, while fewer than max_live_sessions are live and
        the positions they reserve fit max_live_positions."""
        running_loop = asyncio.get_running_loop()
        most = self.batch.max_live_positions
        held = sum(self._reserved(s) for lane in self._lanes for s in lane) if most else 0
        while self._waiting and sum(map(len, self._lanes)) < self.batch.max_live_sessions:
            if most and held and held + self._reserved(self._waiting[0]) > most:
                break  # (a sample alone always joins: the context bounds what it reserves)
            if most:
                held += self._reserved(self._waiting[0])
            self._join(self._waiting.popleft(), running_loop)

    def _reserved(self, s: LoopSample) -> int:
        """The cache positions a sample may come to hold: its prompt and its tokens, at most the context."""
        return min(len(s.sample.prompt) + s.request.params.max_new_tokens, self.rules.max_context)

    def _join(self, sample: LoopSample, running_loop: asyncio.AbstractEventLoop) -> None:
        lane = min(range(len(self._lanes)), key=lambda i: len(self._lanes[i]))
        self._lanes[lane].append(sample)
        task = self._tasks[lane]
        if task is None or task.done():
            self._tasks[lane] = running_loop.create_task(self._run(lane))

    def cancel(self, *samples: LoopSample) -> None:
        """The samples leave: waiting ones at once, live ones at the next step boundary (their caches
        are freed then); a no-op for those that are done."""
        waited = [s for s in samples if s in self._waiting]
        for s in waited:
            self._waiting.remove(s)
        for s in samples:
            if not s.done.done():
                s.done.cancel()
            elif not s.done.cancelled():
                s.done.exception()  # retrieved: a sample that failed beside another needs no warning
        if waited:  # one that did not fit max_live_positions kept those behind it waiting: they may fit now
            self._admit()

    # ----------------------------------------------------------------------------------------
    # The loop

    async def _run(self, lane: int) -> None:
        running, planners = self._lanes[lane], self._planners[lane]
        try:
            while True:
                await asyncio.sleep(0)  # requests join, cancellations land
                self._retire([s for s in running if s.over], running, planners.values())
                if not running:
                    return
                batch = running[:self.batch.max_sessions_per_step]
                if len(running) > len(batch):  # round robin: the others go first next step
                    running[:] = running[len(batch):] + batch
                await self._step(planners, batch)
        except BaseException as exc:  # a bug in the loop, or Ctrl-C: every sample fails rather than hangs
            leaving = list(running)
            for s in running:
                if not s.done.done():
                    s.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError("the round loop stopped"))
            running.clear()
            self.retired += len(leaving)  # they left as surely as ended ones: a raised cap counts them
            for planner in planners.values():
                planner.forget(leaving)
            # The waiting samples go on in the lane's next task, started now: admitted while this one
            # still released, they joined a task that was ending and waited for the next request.
            if self._tasks[lane] is asyncio.current_task():
                self._tasks[lane] = None
            self._admit()
            try:  # their workers' caches go too (an interrupted engine kept them until their TTL)
                await self.calls.release(leaving)
            except Exception:
                logger.warning("releasing the sessions of a stopped lane failed", exc_info=True)
            if not isinstance(exc, Exception):  # Ctrl-C, a cancelled task: on to whoever stops
                raise
            # an error is its samples' now, answered by their requests: raised here, where no one awaits
            # the lane's task, asyncio logged each failed step again ("Task exception was never retrieved")

    async def _step(self, planners: dict[str, StepPlanner], batch: list[LoopSample]) -> None:
        plans = {draft: await planner.plan(batch) for draft, planner in planners.items()}
        drafting = [s for s in batch if s.session_id in plans[s.draft].drafting and s.ahead is None]
        proposed = await asyncio.gather(*(self.calls.propose([s for s in drafting if s.draft == draft], plan, draft)
                                          for draft, plan in plans.items()))
        proposals = {s: p for answered, _ in proposed for s, p in answered.items()}
        if self.overlap != "off":
            for s in batch:  # rounds drafted while the last step verified
                if s.ahead is not None:
                    proposals[s], s.ahead = s.ahead, None
        verifying = [s for s in batch if not s.over and (s in proposals or s.session_id not in plans[s.draft].drafting)]
        ahead = self._plan_ahead(planners, verifying, proposals, len(batch)) if self.overlap != "off" else {}
        start = time.perf_counter()
        verify = self.calls.verify(verifying, proposals, max(p.probe_tokens for p in plans.values()))
        if any(ahead.values()):
            (verdicts, verified), *drafted_ahead = await asyncio.gather(verify, *(
                self.calls.propose_ahead(sessions, proposals, plans[draft], draft) for draft, sessions in ahead.items()))
        else:
            (verdicts, verified), drafted_ahead = await verify, []
        phase_ms = (time.perf_counter() - start) * MS_PER_S
        outcomes = [self._commit(s, proposals.get(s, NO_PROPOSAL), verdict, plans[s.draft])
                    for s, verdict in verdicts.items() if not s.over]
        for answered, _ in drafted_ahead:
            for s, proposal in answered.items():
                self._keep_ahead(s, proposals[s], proposal, verdicts.get(s))
        # Passes timed beside each other measure their contention, which the phase's factor prices:
        # the live costs keep what a pass costs alone.
        alone = [] if drafted_ahead else verified
        for planner, (_, drafted) in zip(planners.values(), proposed):
            planner.observe_phase(phase_ms)
            planner.observe([o for o in outcomes if o is not None], drafted + alone, len(batch))

    def _plan_ahead(self, planners: dict[str, StepPlanner], verifying: list[LoopSample],
                    proposals: dict[LoopSample, Proposal], sessions: int) -> dict[str, list[LoopSample]]:
        """Per draft, the sessions whose next round is drafted while this step verifies (its planner's answer)."""
        verify_tokens = sum(len(proposals.get(s, NO_PROPOSAL).candidates) + 1 for s in verifying)
        return {draft: planner.ahead({s: len(proposals[s].candidates) for s in verifying
                                      if s.draft == draft and self._may_draft_ahead(s, proposals.get(s))},
                                     verify_tokens, sessions)
                for draft, planner in planners.items()}

    def _may_draft_ahead(self, s: LoopSample, proposal: Proposal | None) -> bool:
        """Whether the session's next round may be drafted while this one verifies: it has candidates
        from a model draft (a feature draft would need the target's states of them; a model-free one
        drafts in microseconds: nothing to hide; a fused one's round ahead would be the model's
        alone, where the plan may hold it), its policy reads no reference, and its tokens left allow
        a next round of one candidate."""
        traits = self.rules.drafts[s.draft]
        return (proposal is not None and bool(proposal.candidates) and not traits.reads_features
                and not traits.model_free and not traits.fused
                and not s.traits.needs_reference
                and self.rules.candidate_budget(s.sample, s.request.params, ahead=len(proposal.candidates) + 1) > 0)

    def _keep_ahead(self, s: LoopSample, proposal: Proposal, ahead: Proposal, verdict: Verdict | None) -> None:
        """A round drafted ahead after `proposal`'s candidates, its first token a guess of the bonus
        token: it is the session's next round where every candidate was accepted and the guess is
        the target's token (its draws were conditioned on that history); else it is thrown away,
        and the draft told to drop what verification rejected. Either way lossless: whether it is
        kept depends on tokens before it only, and it is verified like any round."""
        accepted, stats = verdict.num_accepted if verdict is not None else 0, s.request.stats
        stats.rounds_ahead += 1
        if (verdict is not None and not s.over and accepted == len(proposal.candidates)
                and ahead.candidates[:1] == [verdict.next_token] and len(ahead.candidates) > 1):
            s.ahead = Proposal(ahead.candidates[1:], ahead.draft_probs[1:], ahead.forward_passes)
            stats.rounds_ahead_used += 1
        else:  # its passes were spent for nothing (a kept round's count when it commits)
            stats.draft_forward_passes += ahead.forward_passes
            self.calls.ahead_verified(s, len(proposal.candidates), accepted)

    def _commit(self, s: LoopSample, proposal: Proposal, verdict: Verdict, plan: StepPlan) -> RoundOutcome | None:
        """The round's tokens join the sample's history (streamed, stop conditions checked); None
        where the verdict is impossible or committing fails: that sample fails, no other."""
        request, k, n = s.request, len(proposal.candidates), verdict.num_accepted
        drafted_after = s.sample.length
        try:
            if not 0 <= n <= k or not 0 <= verdict.next_token < self.rules.vocab_size:
                raise RuntimeError(f"the verifier answered an impossible verdict ({n} of {k} accepted, "
                                   f"next token {verdict.next_token})")
            s.round_index += 1
            held = plan.held.get(s.session_id) if not proposal.candidates else None  # one drafted ahead is not held
            request.stats.record_round(k, n, held)
            request.stats.draft_forward_passes += proposal.forward_passes
            if self.observer:
                self.observer.on_round(k, n, request.params.policy.name, held)
            new_ids, new_text = self.rules.commit(s.sample, verdict.committed(proposal.candidates), request.params)
            request.stats.generated_tokens += len(new_ids)
            # decide: the stop conditions were checked while committing
            if request.on_update and (new_ids or new_text or s.sample.finish_reason):
                request.on_update(s.index, new_ids, new_text, s.sample.finish_reason)
        except Exception as exc:  # noqa: BLE001 - one sample's failure (a bad verdict, decoding) is its own
            logger.exception("commit failed for session %s", s.session_id)
            s.fail(exc)
            return None
        return RoundOutcome(s, drafted_after, k, n, proposal.forward_passes)

    def _retire(self, leaving: list[LoopSample], running: list[LoopSample], planners: Iterable[StepPlanner]) -> None:
        """Samples that are over leave the lane at once; their workers' caches are freed in the
        background (the next step does not wait for it), then their outcome is set."""
        if not leaving:
            return
        for s in leaving:
            running.remove(s)
        self.retired += len(leaving)
        for planner in planners:
            planner.forget(leaving)
        self._admit()
        task = asyncio.get_running_loop().create_task(self._release(leaving))
        self._releasing[task] = leaving
        task.add_done_callback(self._releasing.pop)

    async def _release(self, leaving: list[LoopSample]) -> None:
        await self.calls.release(leaving)
        for s in leaving:
            if not s.done.done():
                if s.error is not None:
                    s.done.set_exception(s.error)
                else:
                    s.done.set_result(None)
