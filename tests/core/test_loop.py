"""The round loop (specdec/loop.py) over the in-process workers: continuous batching, the step
limit, lanes, retries and session_missing, failures that stay with their session."""

from __future__ import annotations

import asyncio
from functools import partial
from dataclasses import replace

import pytest
import torch

from specdec.sequences import DraftTraits
from specdec.errors import Unavailable
from specdec.features import FEATURES_DISTRIBUTION
from specdec.calls import LocalTransport, RetryPolicy
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import build_params
from specdec.protocol import BatchReply, SessionMissing, Unreachable
from specdec.workers import DraftWorker, VerifierWorker

HEADED = {"default": DraftTraits(has_head=True)}  # the rules of a pair with a head

PROMPTS = [[5, 72, 101, 108], list(range(40, 61)), [257, 100, 101, 102], list(range(120, 135)), [7, 8, 9]]
PARAMS = build_params(policy="fixed", k=3, max_new_tokens=24)
FAST_RETRY = RetryPolicy(attempts=6, first_backoff_s=0.001, max_backoff_s=0.002)


class CountingTransport(LocalTransport):
    """The in-process workers; records the sessions of every call and can answer some items itself."""

    def __init__(self, engine, answer=None):
        super().__init__(DraftWorker(engine.draft, engine.head), VerifierWorker(engine.target))
        self.calls: list[tuple[str, list[str]]] = []
        self.answer = answer  # (role, call number, item) -> an answer instead of the worker's, or None

    async def propose(self, items, plan, draft="default"):
        return await self._forward("draft", items, lambda items: super(CountingTransport, self).propose(items, plan, draft))

    async def verify(self, items, probe_tokens=0):
        return await self._forward("verifier", items, partial(super().verify, probe_tokens=probe_tokens))

    async def _forward(self, role, items, call):
        self.calls.append((role, [item.session_id for item in items]))
        reply = await call(items)
        if self.answer:
            for i, item in enumerate(items):
                replaced = self.answer(role, len(self.calls), item)
                if replaced is not None:
                    reply.answers[i] = replaced
        return reply


def run(loop: RoundLoop, requests) -> list:
    async def together():
        return await asyncio.gather(*(loop.generate(prompt, params) for prompt, params in requests),
                                    return_exceptions=True)
    return asyncio.run(together())


def expected(engine, prompt, params=PARAMS) -> list[int]:
    return engine.generate_ids(prompt, params).completions[0].token_ids


def fail_step(loop: RoundLoop, at: int, message: str = "a bug in a step"):
    """The loop's planner raises at its `at`-th step (from 1), as a bug in a step would; returns it."""
    planner = loop.planners[0]
    plan, steps = planner.plan, []

    async def failing(batch):
        steps.append(len(batch))
        if len(steps) == at:
            raise RuntimeError(message)
        return await plan(batch)

    planner.plan = failing
    return planner


def test_a_step_takes_at_most_max_sessions_and_every_session_gets_its_turn(tiny_engine):
    transport = CountingTransport(tiny_engine)
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(max_sessions_per_step=2))
    results = run(loop, [(prompt, PARAMS) for prompt in PROMPTS])
    assert max(len(ids) for _, ids in transport.calls) == 2
    for prompt, result in zip(PROMPTS, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt)
    assert loop.live_sessions == 0 and len(transport.draft.sessions) == len(transport.verifier.sessions) == 0


def test_a_request_joins_running_sessions_between_steps(tiny_engine):
    transport = CountingTransport(tiny_engine)
    loop = RoundLoop(transport, tiny_engine.rules)
    long = build_params(policy="fixed", k=2, max_new_tokens=60)

    async def scenario():
        first = asyncio.create_task(loop.generate(PROMPTS[0], long))
        while len(transport.calls) < 4:  # two steps of the first request alone
            await asyncio.sleep(0)
        second = await loop.generate(PROMPTS[1], PARAMS)
        return await first, second

    first, second = asyncio.run(scenario())
    sizes = [len(ids) for role, ids in transport.calls if role == "verifier"]
    assert sizes[0] == 1 and 2 in sizes  # the second request joined the running one's steps
    assert first.completions[0].token_ids == expected(tiny_engine, PROMPTS[0], long)
    assert second.completions[0].token_ids == expected(tiny_engine, PROMPTS[1])


def test_sessions_past_what_the_workers_hold_wait_instead_of_evicting_each_other(tiny_engine):
    """Found by a bug hunt: a request with n past the workers' session stores made every step evict
    the sessions the next one served (round robin over LRU stores), so each round resent and
    prefilled its whole history. Past max_live_sessions the samples wait their turn instead."""
    from specdec.sessions import SessionStore

    transport = CountingTransport(tiny_engine)
    transport.draft.sessions, transport.verifier.sessions = SessionStore(4), SessionStore(4)
    full = []
    forward = transport.verify

    async def verify(items, probe_tokens=0):
        full.extend(item.session_id for item in items if item.history.full)
        return await forward(items, probe_tokens)

    transport.verify = verify
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(max_sessions_per_step=2, max_live_sessions=4))
    params = build_params(policy="fixed", k=2, max_new_tokens=16, n=7)
    (result,) = run(loop, [(PROMPTS[1], params)])
    assert sorted(full) == sorted(set(full)) and len(full) == 7  # each session's history sent once, in full
    assert [c.token_ids for c in result.completions] == [expected(tiny_engine, PROMPTS[1], params)] * 7
    assert max(len(ids) for role, ids in transport.calls if role == "verifier") == 2
    assert loop.live_sessions == 0 and not loop._waiting


def test_a_step_that_fails_fails_its_sessions_and_the_waiting_ones_go_on(tiny_engine):
    """Found by a review: a failed step left the samples waiting past max_live_sessions waiting for
    good, and every later request behind them. Failing once the workers hold its session (its
    release then takes a while), the waiting sample joined the ending task and waited for the next
    request, and the planner kept the failed session's state."""
    loop = RoundLoop(CountingTransport(tiny_engine), tiny_engine.rules, BatchConfig(max_live_sessions=1))
    planner = fail_step(loop, 3)

    async def scenario():
        first = asyncio.create_task(loop.generate(PROMPTS[0], PARAMS))
        second = asyncio.create_task(loop.generate(PROMPTS[1], PARAMS))
        with pytest.raises(RuntimeError, match="a bug in a step"):
            await asyncio.wait_for(first, 30)
        waited = await asyncio.wait_for(second, 30)  # (no other request comes to wake the loop)
        return waited, await asyncio.wait_for(loop.generate(PROMPTS[2], PARAMS), 30)

    second, later = asyncio.run(scenario())
    assert second.completions[0].token_ids == expected(tiny_engine, PROMPTS[1])
    assert later.completions[0].token_ids == expected(tiny_engine, PROMPTS[2])
    assert not planner._sessions


def test_samples_a_failed_step_drops_count_as_retired(tiny_engine):
    """A served loop raises its live cap by the samples that left it since it last moved
    (services/config.py `toward`): those whose step failed left too. Before, only those that ended
    counted, so a loop whose step failed (its waiting samples admitted at once) rose more slowly."""
    loop = RoundLoop(CountingTransport(tiny_engine), tiny_engine.rules, BatchConfig(max_live_sessions=2))
    fail_step(loop, 2)

    async def scenario():
        failed = [asyncio.create_task(loop.generate(prompt, PARAMS)) for prompt in PROMPTS[:2]]
        waiting = asyncio.create_task(loop.generate(PROMPTS[2], PARAMS))
        outcomes = await asyncio.wait_for(asyncio.gather(*failed, return_exceptions=True), 30)
        assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
        assert loop.retired == 2  # the two failed; the waiting one joined in their place
        await asyncio.wait_for(waiting, 30)
        return loop.retired

    assert asyncio.run(scenario()) == 3


def test_a_raised_live_limit_lets_the_waiting_samples_join_at_once(tiny_engine):
    """A served loop's cap rises as the replicas holding its sessions scale (services/config.py
    LiveCap): the samples waiting past the old limit join then, not when a live one ends."""
    transport = CountingTransport(tiny_engine)
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(max_live_sessions=1))

    async def scenario():
        requests = [asyncio.create_task(loop.generate(prompt, PARAMS)) for prompt in PROMPTS[:3]]
        await asyncio.sleep(0)
        assert loop.live_sessions == 1 and len(loop._waiting) == 2
        loop.set_live_limits(BatchConfig(max_live_sessions=3))
        assert loop.live_sessions == 3 and not loop._waiting
        return await asyncio.wait_for(asyncio.gather(*requests), 60)

    results = asyncio.run(scenario())
    assert [r.completions[0].token_ids for r in results] == [expected(tiny_engine, p) for p in PROMPTS[:3]]
    assert max(len(ids) for _, ids in transport.calls) == 3  # the three in one step


def test_a_failed_step_leaves_no_task_exception_unretrieved(tiny_engine):
    """A step that fails hands its error to its samples, whose requests answer it; the lane's task
    re-raised it too, where no one awaits the task, and asyncio logged every failed step once more as
    "Task exception was never retrieved", with its traceback."""
    import gc

    loop = RoundLoop(CountingTransport(tiny_engine), tiny_engine.rules, BatchConfig())
    fail_step(loop, 1, "a verifier gone")
    unretrieved = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
        outcome = await asyncio.wait_for(asyncio.gather(loop.generate(PROMPTS[0], PARAMS), return_exceptions=True), 30)
        await asyncio.sleep(0)
        gc.collect()
        return outcome

    outcome, = asyncio.run(scenario())
    assert isinstance(outcome, RuntimeError) and str(outcome) == "a verifier gone"
    assert not unretrieved, unretrieved


def test_a_sample_cancelled_while_waiting_lets_the_samples_behind_it_join(tiny_engine):
    """Found by a review: the samples wait in arrival order, so one past max_live_positions keeps
    those behind it waiting even where they fit. When its client went away while it waited, the
    samples behind it still waited until a live session ended (a whole long generation), not at once."""
    transport = CountingTransport(tiny_engine)
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(max_live_positions=80))
    long = build_params(policy="fixed", k=2, max_new_tokens=60)
    short = build_params(policy="fixed", k=2, max_new_tokens=5)

    async def scenario():
        live = asyncio.create_task(loop.generate(PROMPTS[0], long))  # reserves 4 + 60 positions
        blocked = asyncio.create_task(loop.generate(PROMPTS[1], long))  # 21 + 60: not beside it
        behind = asyncio.create_task(loop.generate(PROMPTS[2], short))  # 4 + 5 would fit, waits its turn
        await asyncio.sleep(0)
        assert loop.live_sessions == 1 and len(loop._waiting) == 2
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)
        assert not loop._waiting and loop.live_sessions == 2  # it joins now, beside the live one
        return await asyncio.wait_for(asyncio.gather(live, behind), 60)

    live, behind = asyncio.run(scenario())
    assert live.completions[0].token_ids == expected(tiny_engine, PROMPTS[0], long)
    assert behind.completions[0].token_ids == expected(tiny_engine, PROMPTS[2], short)


def test_the_oracle_takes_a_cap_k(tiny_engine):
    """Its hindsight run (target-only) kept the request's k and was refused: k does not apply."""
    params = build_params(policy="oracle", k=2, max_new_tokens=12)
    assert tiny_engine.generate_ids(PROMPTS[1], params).completions[0].token_ids == expected(tiny_engine, PROMPTS[1], params)


def test_two_lanes_split_the_sessions_and_change_no_output(tiny_engine):
    transport = CountingTransport(tiny_engine)
    loop = RoundLoop(transport, tiny_engine.rules, BatchConfig(lanes=2))
    results = run(loop, [(prompt, PARAMS) for prompt in PROMPTS[:4]])
    assert max(len(ids) for _, ids in transport.calls) == 2  # four sessions, two lanes of two
    for prompt, result in zip(PROMPTS, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt)


def test_unreachable_and_missing_sessions_are_retried_in_full(tiny_engine):
    """Every third call loses one session's replica, every fifth finds another's cache gone: the
    loop sends those rounds again in full and every output is the engine's."""
    def answer(role, call, item):
        if call % 3 == 0 and item.session_id.endswith("/0") and not item.history.full:
            return Unreachable("replica gone")
        if call % 5 == 0 and not item.history.full:
            return SessionMissing()
        return None

    transport = CountingTransport(tiny_engine, answer)
    loop = RoundLoop(transport, tiny_engine.rules, retry=FAST_RETRY)
    results = run(loop, [(prompt, PARAMS) for prompt in PROMPTS[:3]])
    for prompt, result in zip(PROMPTS, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt)


def test_a_replica_that_never_comes_back_fails_its_sessions_only(tiny_engine):
    victim: list[str] = []

    def answer(role, call, item):
        if role == "verifier" and call > 4 and (not victim or item.session_id == victim[0]):
            victim[:1] = [item.session_id]
            return Unreachable("replica gone")
        return None

    loop = RoundLoop(CountingTransport(tiny_engine, answer), tiny_engine.rules, retry=FAST_RETRY)
    results = run(loop, [(prompt, PARAMS) for prompt in PROMPTS[:3]])
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 1 and isinstance(failed[0], Unavailable) and "did not come back" in str(failed[0])
    for prompt, result in zip(PROMPTS, results):
        if not isinstance(result, Exception):
            assert result.completions[0].token_ids == expected(tiny_engine, prompt)


def test_a_failing_callback_stops_its_sample_only(tiny_engine):
    loop = RoundLoop(CountingTransport(tiny_engine), tiny_engine.rules)

    def broken(*_):
        raise ValueError("the consumer broke")

    async def scenario():
        return await asyncio.gather(loop.generate(PROMPTS[0], PARAMS, broken), loop.generate(PROMPTS[1], PARAMS),
                                    return_exceptions=True)

    failed, ok = asyncio.run(scenario())
    assert isinstance(failed, ValueError)
    assert ok.completions[0].token_ids == expected(tiny_engine, PROMPTS[1])


def test_batch_config_bounds():
    with pytest.raises(ValueError):
        BatchConfig(max_sessions_per_step=0)
    with pytest.raises(ValueError):
        BatchConfig(lanes=9)


# ------------------------------------------------------------------------------------------------
# The verification budget on a fake clock


class FakeClock(LocalTransport):
    """The in-process workers (with an acceptance head), every pass timed by `cost(role, tokens)`
    instead of the clock; counts the candidates drafted and the probes sent."""

    def __init__(self, engine, head, cost, draft=None):
        super().__init__(DraftWorker(draft or engine.draft, head), VerifierWorker(engine.target))
        self.cost, self.candidates, self.probes, self.steps = cost, 0, 0, 0
        self.pass_probes: list[int] = []  # target pass sizes the verifier was asked to time
        self.events: list[tuple[str, int]] = []  # ("propose", sessions drafting), ("verify", items), ("probe", tokens)
        self.on_verify = lambda: None  # called at every verification of a step

    def timed(self, reply):
        reply.passes = [replace(t, ms=self.cost(t.role, t.tokens)) for t in reply.passes]
        return reply

    async def propose(self, items, plan, draft="default"):
        self.probes += sum(item.probe for item in items)
        self.events.append(("propose", sum(not item.probe for item in items)))
        reply = self.timed(await super().propose(items, plan, draft))
        self.candidates += sum(len(a.candidates) for a in reply.answers)
        return reply

    async def verify(self, items, probe_tokens=0):
        self.steps += bool(items)
        if items:
            self.on_verify()
        self.pass_probes += [probe_tokens] if probe_tokens else []
        self.events.append(("verify", len(items)) if items else ("probe", probe_tokens))
        return self.timed(await super().verify(items, probe_tokens))


def cheap(role: str, tokens: int) -> float:
    """Drafting pays: a draft pass 1 ms a token, a target pass 50 + 10 ms a token past the first."""
    return 1.0 * tokens if role == "draft" else 50.0 + 10.0 * (tokens - 1)


def costly(role: str, tokens: int) -> float:
    """The draft's host got busy: 60 ms a token, and no round can beat a plain 50 ms pass
    (2 tokens in 60 + 60 ms even if y_1 is accepted; longer rounds do worse)."""
    return 60.0 * tokens if role == "draft" else cheap(role, tokens)


def budgeted_loop(engine, cost, head_bias: float | None = None) -> tuple[FakeClock, RoundLoop]:
    """A loop whose default policy has a head, on a fake clock, seeded by the workers' probes. The
    target drafts for itself: every greedy candidate is accepted. `head_bias`: a head that judges
    each candidate at its own step and estimates every one's acceptance at sigmoid(head_bias)."""
    from specdec.head import AcceptanceHead, HeadConfig
    from specdec.models.runtime import DraftRuntime
    from specdec.sequences import RequestRules

    self_draft = DraftRuntime(engine.target.model)
    features = {} if head_bias is None else {"features": FEATURES_DISTRIBUTION}  # judges y_i at step i
    head = AcceptanceHead(HeadConfig(hidden_size=self_draft.hidden_size, depth=0, draft_identity="x", **features)).eval()
    if head_bias is not None:
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(head_bias)
    transport = FakeClock(engine, head, cost, self_draft)
    rules = RequestRules(None, engine.eos_token_ids, engine.max_context, engine.target.vocab_size, HEADED)
    loop = RoundLoop(transport, rules, probe_share=0.5)
    for worker in (transport.draft, transport.verifier):
        worker.probe()
        loop.costs["default"].observe(transport.timed(BatchReply([], [], worker.take_timings())).passes)
    return transport, loop


def test_each_draft_is_planned_on_its_own_costs_in_the_same_steps(tiny_engine):
    """Two drafts whose sessions share the steps, on a fake clock: the default's steps are cheap, the
    other's ("slow") costly. Each draft's planner prices its own sessions with its own live costs:
    the cheap draft's drafts, the slow one's stays off (only off-probes reach it), and both outputs
    are target-only's."""
    from collections import Counter

    from specdec.sequences import RequestRules

    transport, _ = budgeted_loop(tiny_engine, cheap)
    transport.drafts["slow"] = slow = DraftWorker(transport.draft.draft, transport.draft.head)
    drafted, propose = Counter(), transport.propose

    async def priced_per_draft(items, plan, draft="default"):
        transport.cost = costly if draft == "slow" else cheap  # the workers run synchronously: no other call meanwhile
        reply = await propose(items, plan, draft)
        transport.cost = cheap
        drafted[draft] += sum(len(a.candidates) for a in reply.answers)
        return reply

    transport.propose = priced_per_draft
    rules = RequestRules(None, tiny_engine.eos_token_ids, tiny_engine.max_context, tiny_engine.target.vocab_size,
                         {"default": DraftTraits(has_head=True), "slow": DraftTraits(has_head=True)})
    loop = RoundLoop(transport, rules, probe_share=0.5)
    transport.verifier.probe()
    target = transport.timed(BatchReply([], [], transport.verifier.take_timings())).passes
    for name, worker, cost in (("default", transport.draft, cheap), ("slow", slow, costly)):
        worker.probe()
        loop.costs[name].observe([replace(t, ms=cost(t.role, t.tokens)) for t in worker.take_timings()] + target)
    requests = [(PROMPTS[0], build_params(policy="specdec++cost", k=4, max_new_tokens=100, draft=draft))
                for draft in ("default", "slow")]
    results = run(loop, requests)
    plain = expected(tiny_engine, PROMPTS[0], build_params(policy="target-only", max_new_tokens=100))
    assert [r.completions[0].token_ids for r in results] == [plain, plain]
    planners = {p.draft: p for p in loop.planners}
    assert planners["default"].drafting and not planners["slow"].drafting
    assert drafted["default"] > 20 and drafted["slow"] == 0, drafted
    assert results[1].stats.held.get("no_round_pays", 0) > 50, results[1].stats.held


def test_the_budget_turns_drafting_off_when_the_costs_say_so_and_back_on(tiny_engine):
    """A fake clock: while drafting pays the default policy drafts; once the measured costs say no
    round can pay (the draft got slow), the draft stops within a few rounds (only rare probes reach
    it); when it is fast again, a probe sees it and drafting resumes. The output is target-only's
    throughout."""
    transport, loop = budgeted_loop(tiny_engine, cheap)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=120)

    def phase(cost) -> tuple[int, int, list[int]]:
        transport.cost, transport.candidates, transport.probes = cost, 0, 0
        [result] = run(loop, [(PROMPTS[0], params)])
        return transport.candidates, transport.probes, result.completions[0].token_ids

    plain = expected(tiny_engine, PROMPTS[0], build_params(policy="target-only", max_new_tokens=120))
    drafted, _, ids = phase(cheap)
    assert drafted > 20 and loop.planners[0].drafting and ids == plain
    drafted, probes, ids = phase(costly)
    assert not loop.planners[0].drafting and drafted < 20 and probes >= 1 and ids == plain
    drafted, probes, ids = phase(cheap)
    assert loop.planners[0].drafting and probes >= 1 and drafted > 20 and ids == plain


def slightly(role: str, tokens: int) -> float:
    """Drafting saves ~6 ms of a plain 100 ms token at best (3 candidates, all accepted, the first
    step feeding 2 tokens: (60 + 60 + 256) / 4 = 94 ms), under the margin a catch-up needs."""
    return 30.0 * tokens if role == "draft" else 100.0 + 52.0 * (tokens - 1)


@pytest.mark.parametrize("clock", ["costly", "slightly"])
def test_a_step_that_drafts_nothing_is_priced_again_every_few_steps_and_after_a_probe(tiny_engine, monkeypatch, clock):
    """costly: drafting never pays (the draft off); slightly: it pays, but not the session's catch-up.
    Either way no budgeted session calls the draft, and after the first pricing the loop prices the
    same session again only every REPRICE_STEPS steps, and at once in the step after a probe (whose
    timings may change the answer). The output is target-only's."""
    from specdec.planner import REPRICE_STEPS

    transport, loop = budgeted_loop(tiny_engine, costly if clock == "costly" else slightly)
    planner = loop.planners[0]
    planner.probe_share = 0.06  # costly: a probe every 40 steps
    counts = []  # the planner's pricings so far, at each verification
    transport.on_verify = lambda: counts.append(planner.priced)
    [result] = run(loop, [(PROMPTS[1], build_params(policy="specdec++cost", k=4, max_new_tokens=100))])
    assert transport.candidates == 0 and planner.drafting == (clock == "slightly")
    priced = [step for step, (before, after) in enumerate(zip([counts[0]] + counts, counts)) if after > before]
    gaps = [b - a for a, b in zip(priced, priced[1:])]
    assert gaps and max(gaps) == REPRICE_STEPS + 1, priced
    assert len(priced) < transport.steps / 4, (priced, transport.steps)
    if clock == "costly":
        assert transport.probes >= 1 and any(gap <= REPRICE_STEPS for gap in gaps), priced
    assert result.completions[0].token_ids == expected(
        tiny_engine, PROMPTS[1], build_params(policy="target-only", max_new_tokens=100))


def test_each_lane_plans_its_own_steps(tiny_engine):
    """Two lanes, a session each, the draft off (no round pays): each lane's planner keeps its own
    reprice cache and probe schedule, so each prices its steps only every REPRICE_STEPS or so (with
    one state for both, the lanes' steps alternated its cache key and every step was priced again).
    The outputs are target-only's."""
    from specdec.sequences import RequestRules

    transport, _ = budgeted_loop(tiny_engine, costly)
    rules = RequestRules(None, tiny_engine.eos_token_ids, tiny_engine.max_context, tiny_engine.target.vocab_size, HEADED)
    loop = RoundLoop(transport, rules, BatchConfig(lanes=2), probe_share=0.06)
    for worker in (transport.draft, transport.verifier):
        worker.probe()
        loop.costs["default"].observe(transport.timed(BatchReply([], [], worker.take_timings())).passes)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=100)
    results = run(loop, [(PROMPTS[0], params), (PROMPTS[1], params)])
    plain = build_params(policy="target-only", max_new_tokens=100)
    assert transport.candidates == 0 and transport.steps >= 200
    for planner in loop.planners:
        assert not planner.drafting and 1 <= planner.priced <= transport.steps / 2 / 4, planner.priced
    for prompt, result in zip(PROMPTS, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt, plain)


def test_no_session_drafts_before_costs_are_measured(tiny_engine):
    """A loop with nothing measured (a served coordinator's first step): no budgeted session calls
    the draft, one carries an off-probe; its timings and the verifier's come back with the replies
    and the next steps are priced with them. The output is target-only's."""
    transport, loop = budgeted_loop(tiny_engine, cheap)
    fresh = RoundLoop(transport, loop.calls.rules)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=40)
    [result] = run(fresh, [(PROMPTS[0], params)])
    assert transport.events[0] == ("propose", 0) and transport.probes >= 1  # the probe item drafts nothing
    assert result.stats.held["not_measured"] == 1 and transport.candidates > 0
    assert result.completions[0].token_ids == expected(tiny_engine, PROMPTS[0], build_params(policy="target-only",
                                                                                           max_new_tokens=40))


def barely(role: str, tokens: int) -> float:
    """Drafting saves ~6 ms a token at best (3 candidates, all accepted: (120 + 256) / 4 = 94 ms
    against a plain 100): over 120 tokens less than a 21-token prompt's catch-up (20 x 40 ms)."""
    return 40.0 * tokens if role == "draft" else 100.0 + 52.0 * (tokens - 1)


def test_a_draft_that_lags_does_not_catch_up_for_a_saving_that_cannot_repay_it(tiny_engine):
    """The draft is off (no round pays), probes run, then costs change so that drafting barely pays:
    the session's draft would first have to prefill all it has not seen, which the rest of the
    generation cannot earn back, so it stays off. (A probe does not feed the session's cache.)"""
    transport, loop = budgeted_loop(tiny_engine, costly)
    transport.cost = lambda role, tokens: (costly if transport.steps < 40 else barely)(role, tokens)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=120)
    [result] = run(loop, [(PROMPTS[1], params)])
    assert transport.probes >= 1 and loop.planners[0].drafting  # probes ran; drafting pays again at the end
    assert transport.candidates == 0 and result.stats.draft_forward_passes == 0


def test_a_session_whose_drafting_rounds_verify_nothing_rests_longer_each_time(tiny_engine):
    """The head judges every candidate unlikely (a = 0.05), so the step's budget drops each y_1 it
    drafts: every drafting round verifies nothing. Without a rest the session would call the draft
    every step (120); it rests 1, 2, 4, ... up to 32 tokens after each such round instead. The output
    is target-only's."""
    transport, loop = budgeted_loop(tiny_engine, cheap, head_bias=-3.0)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=120)
    [result] = run(loop, [(PROMPTS[0], params)])
    assert transport.candidates == 0 and loop.planners[0].drafting
    assert 3 <= result.stats.draft_forward_passes <= 10
    plain = build_params(policy="target-only", max_new_tokens=120)
    assert result.completions[0].token_ids == expected(tiny_engine, PROMPTS[0], plain)


def steep_then_flat(role: str, tokens: int) -> float:
    """A CPU-like target curve: the second token of a pass costs 150 ms, every later one 5 ms; a
    draft pass 3 ms a row. Extrapolated from the 1-8 tokens the probes and 8 sessions' plain steps
    time, passes past 8 cost 25.7 ms a token and no round of at most 4 candidates can pay (plain:
    230 / 8 = 28.75 ms a token); measured, 8 sessions drafting 1 candidate each take (48 + 270) / 16
    = 19.9 ms a token."""
    if role == "draft":
        return 3.0 * tokens
    return 50.0 if tokens == 1 else 200.0 + 5.0 * (tokens - 2)


@pytest.mark.parametrize("probes", [False, True])
def test_the_loop_times_the_longer_passes_the_budget_would_choose_before_ruling_drafting_out(
        tiny_engine, monkeypatch, probes):
    """8 sessions on the steep-then-flat clock: the budget extrapolates the target curve past 8
    tokens and rules drafting out. With curve probes the verifier times a 16-token pass, drafting
    pays by the measured curve, and the sessions draft (longer passes are probed later, each size
    once); with the probes switched off (and a catch-up judged at the measured acceptance, whose
    optimism would find the longer passes too) they never draft. The output is target-only's."""
    if not probes:
        monkeypatch.setattr("specdec.budget.curve_probe", lambda profile, wanted: None)
        monkeypatch.setattr("specdec.planner.hopeful_acceptance", lambda accepted, trials: accepted / trials)
    transport, loop = budgeted_loop(tiny_engine, steep_then_flat)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=80)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(8)]
    results = run(loop, [(prompt, params) for prompt in prompts])
    curve = [size for size in transport.pass_probes if size != 9]  # 9: the probes while the draft is off
    if probes:
        assert curve[:2] == [16, 32] and len(set(curve)) == len(curve), transport.pass_probes  # each size once
        # timed before the step's decision: the sessions draft in the step the 16-token pass was timed for
        after = transport.events[transport.events.index(("probe", 16)) + 1]
        assert after[0] == "propose" and after[1] > 0, transport.events
        assert {16, 32} <= set(loop.costs["default"].curve("verifier")), loop.costs["default"].curve("verifier")  # measured, not extrapolated
        assert transport.candidates > 100 and loop.planners[0].drafting, (transport.pass_probes, transport.candidates)
    else:
        assert not curve and transport.candidates == 0
    plain = build_params(policy="target-only", max_new_tokens=80)
    for prompt, result in zip(prompts, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt, plain)


def test_a_probe_that_fails_fails_no_session(tiny_engine):
    """The verifier refuses every probe sent before a step's decision (a replica gone in between):
    the sessions go on deciding without it and finish with target-only's output."""
    transport, loop = budgeted_loop(tiny_engine, steep_then_flat)
    verify = transport.verify

    async def failing_probes(items, probe_tokens=0):
        if not items:
            raise Unavailable("the verifier is gone")
        return await verify(items, probe_tokens)

    transport.verify = failing_probes
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=40)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(8)]
    results = run(loop, [(prompt, params) for prompt in prompts])
    assert 16 not in loop.costs["default"].curve("verifier")  # nothing measured, nothing failed
    plain = build_params(policy="target-only", max_new_tokens=40)
    for prompt, result in zip(prompts, results):
        assert result.completions[0].token_ids == expected(tiny_engine, prompt, plain)


def pays_only_at_the_bound(role: str, tokens: int) -> float:
    """Drafting pays only if nearly every candidate is accepted: a draft pass 30 + 10 ms a row, a
    target pass 100 + 40 ms a token past the first. At a = 1 a round of 20 candidates takes ~80 ms
    a token against a plain 100; at the prior acceptance (0.8) every round takes more than 100."""
    return 30.0 + 10.0 * tokens if role == "draft" else 100.0 + 40.0 * (tokens - 1)


def test_the_loop_times_no_longer_pass_than_the_sessions_would_draft_into(tiny_engine):
    """One session on a clock where only all-accepted rounds pay: at the acceptance the loop expects,
    nobody drafts, so no pass past the measured curve is priced and none is timed (the all-accepted
    bound, 20 candidates, would have probed 16 and 32 tokens: on llama.cpp at 8 sessions a 256-token
    scratch pass, 6% of a served run). The output is target-only's."""
    transport, loop = budgeted_loop(tiny_engine, pays_only_at_the_bound)
    params = build_params(policy="specdec++cost", max_new_tokens=80)
    [result] = run(loop, [(PROMPTS[0], params)])
    assert loop.planners[0].drafting and transport.candidates == 0 and transport.pass_probes == [], transport.pass_probes
    plain = build_params(policy="target-only", max_new_tokens=80)
    assert result.completions[0].token_ids == expected(tiny_engine, PROMPTS[0], plain)


def pays_above_the_prior(role: str, tokens: int) -> float:
    """Drafting pays, but barely at the prior acceptance: a draft pass 8 ms a row, a target pass
    100 + 60 ms a token past the first. At a = 0.8 the best round saves ~3 ms of a plain 100 (under
    the 5% a catch-up needs); at 0.92 ~12.5 ms, which repays a 21-token prompt's prefill (160 ms)
    within 13 tokens."""
    return 8.0 * tokens if role == "draft" else 100.0 + 60.0 * (tokens - 1)


@pytest.mark.parametrize("hopeful", [True, False])
def test_a_catch_up_is_judged_at_the_upper_end_of_what_the_rounds_measured(tiny_engine, monkeypatch, hopeful):
    """One session whose draft must first prefill its prompt, on a clock where that pays at any
    acceptance above ~0.85 and the draft (the target's copy) has every candidate accepted. Judged at
    the prior rate (0.8), as before `hopeful_acceptance`, it never drafts and so never learns the
    rate; judged at the upper end of the prior's spread (0.92) it catches up, its rounds measure the
    acceptance, and it drafts on. The output is target-only's either way."""
    if not hopeful:
        monkeypatch.setattr("specdec.planner.hopeful_acceptance", lambda accepted, trials: accepted / trials)
    transport, loop = budgeted_loop(tiny_engine, pays_above_the_prior, head_bias=3.0)
    params = build_params(policy="specdec++cost", k=4, max_new_tokens=120)
    [result] = run(loop, [(PROMPTS[1], params)])
    if hopeful:
        assert transport.candidates > 60 and loop.planners[0].acceptance > 0.9, (transport.candidates, loop.planners[0].acceptance)
    else:
        assert transport.candidates == 0 and loop.planners[0].acceptance == pytest.approx(0.8)
    plain = build_params(policy="target-only", max_new_tokens=120)
    assert result.completions[0].token_ids == expected(tiny_engine, PROMPTS[1], plain)


def test_the_stop_rate_follows_how_the_finished_samples_ended(tiny_engine):
    """A sample that runs to max_new_tokens adds its tokens and no stop; one that ends at EOS adds
    one stop: the rate a catch-up's expected remaining tokens are figured at."""
    from specdec.sequences import RequestRules

    transport, loop = budgeted_loop(tiny_engine, cheap)
    plain = build_params(policy="target-only", max_new_tokens=40)
    [full] = run(loop, [(PROMPTS[0], plain)])
    assert loop.planners[0].stop_rate == 0.0 and full.completions[0].finish_reason == "length"
    eos = full.completions[0].token_ids[20]  # the same prompt again, with that token as its EOS
    loop.rules = RequestRules(None, [eos], tiny_engine.max_context, tiny_engine.target.vocab_size, HEADED)
    [stopped] = run(loop, [(PROMPTS[0], plain)])
    assert stopped.completions[0].finish_reason == "stop"
    generated = len(full.completions[0].token_ids) + len(stopped.completions[0].token_ids)
    assert 1.0 / generated <= loop.planners[0].stop_rate <= 1.0 / (0.98 * generated)


def test_rest_after_doubles_up_to_its_cap():
    from specdec.budget import MAX_REST, rest_after

    assert [rest_after(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 32, 32] and MAX_REST == 32


def flat_target(role: str, tokens: int) -> float:
    """A draft pass 2 ms a row, a target pass 100 + 1 ms a token past the first: at the prior
    acceptance (0.8) rounds of ~10 candidates take ~33 ms a token against a plain 100 (the start-up
    probe timed passes of up to 8 tokens), and a 60-token prompt's prefill into the draft 118 ms."""
    return 2.0 * tokens if role == "draft" else 100.0 + 1.0 * (tokens - 1)


def test_no_longer_pass_is_timed_while_no_session_catches_up(tiny_engine):
    """One session on a clock where long rounds pay, in generations of 1 token that cannot repay the
    prompt's prefill into the draft (67 ms saved against 118): the session never drafts, so no pass
    past the measured curve is timed for the rounds it would draft (on llama.cpp at 8 sessions a 16-
    and a 32-token pass, 3% of a run that drafted nothing)."""
    transport, loop = budgeted_loop(tiny_engine, flat_target)
    params, prompt = build_params(policy="specdec++cost", max_new_tokens=1), list(range(40, 100))
    for _ in range(3):
        [result] = run(loop, [(prompt, params)])
    assert loop.planners[0].drafting and transport.candidates == 0 and transport.pass_probes == [], transport.pass_probes
    plain = build_params(policy="target-only", max_new_tokens=1)
    assert result.completions[0].token_ids == expected(tiny_engine, prompt, plain)


def test_the_planner_drafts_ahead_where_its_measured_phase_says_it_pays():
    """A 7B-like pass (7.3 ms) and a 3 ms draft step, one session of k = 1: drafting ahead is tried
    to measure it, kept where the verify phase with it costs the larger of the two (7.4 ms), and
    turned off where it costs their sum (13.35 ms: the calls wait on each other), then tried again
    once every OVERLAP_PROBE_STEPS steps."""
    from specdec.cost_profile import CostProfile, LiveCosts
    from specdec.planner import OVERLAP_PROBE_STEPS, StepPlanner

    profile = CostProfile(t_draft_ms=3.0, t_target_ms={1: 7.3, 2: 7.35, 4: 7.5})
    session = object()

    def steps(overlapped_ms: float, count: int) -> list[bool]:
        planner, chosen = StepPlanner(LiveCosts(), given=profile), []
        for _ in range(count):
            chosen.append(bool(planner.ahead({session: 1}, 2, 1)))
            planner.observe_phase(overlapped_ms if chosen[-1] else 7.35)
        return chosen

    assert all(steps(7.4, 100))  # the draft on a device of its own
    serial = steps(13.35, 1 + 3 * (OVERLAP_PROBE_STEPS + 1))
    assert serial[0] and sum(serial) == 4  # the first, then once after every OVERLAP_PROBE_STEPS off
    rounds = {session: 1}
    assert StepPlanner(LiveCosts(), given=profile).ahead({}, 1, 1) == []  # nobody may draft ahead
    assert StepPlanner(LiveCosts(), given=profile, overlap="off").ahead(rounds, 2, 1) == []
    assert StepPlanner(LiveCosts(), overlap="on").ahead(rounds, 2, 1) == [session]  # nothing measured: on is on
    # a step that verifies nothing (its sessions lost with a replica) prices its phase at nothing: it
    # is not measured against that (CI: a ZeroDivisionError ended a served loop with overlap on)
    steep = CostProfile(t_draft_ms=3.0, t_target_ms={1: 1.0, 2: 3.0})  # a pass of 0 tokens: 0 ms
    empty = StepPlanner(LiveCosts(), given=steep)
    assert empty.ahead({}, 0, 1) == []
    empty.observe_phase(0.2)
