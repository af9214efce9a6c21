"""The step planner's state across steps (specdec/planner.py), driven directly with a profile given
by hand: no model, no clock."""

from __future__ import annotations

import asyncio

import pytest

from specdec.cost_profile import CostProfile, LiveCosts
from specdec.params import build_params
from specdec.planner import RoundOutcome, StepPlanner
from specdec.sequences import LoopSample, Request, SampleState

# A draft step almost free and a pass of 64 tokens barely dearer than one: every round pays.
PAYS = CostProfile(t_draft_ms=0.01, t_target_ms={1: 100.0, 64: 101.0})


def session(loop: asyncio.AbstractEventLoop, policy: str = "specdec++cost", name: str = "s/0") -> LoopSample:
    params = build_params(policy=policy, k=4, max_new_tokens=200).model_copy(update={"draft": "default"})
    return LoopSample(name, 0, Request(params, 0), SampleState([1, 2]), loop.create_future())


def drafting_steps(model_free: bool) -> str:
    """40 steps of one session whose every round verifies nothing: 'D' where it called the draft."""

    async def steps() -> str:
        s, planner = session(asyncio.get_running_loop()), StepPlanner(LiveCosts(), given=PAYS, model_free=model_free)
        called = ""
        for _ in range(40):
            plan = await planner.plan([s])
            calls = s.session_id in plan.drafting
            drafted_after = s.sample.length
            s.sample.generated.append(7)  # the round commits its one token: the target's
            planner.observe([RoundOutcome(s, drafted_after, 0, 0, int(calls and not model_free))], [], 1)
            called += "D" if calls else "."
        return called

    return asyncio.run(steps())


def rests(called: str) -> list[int]:
    return [len(gap) for gap in called.split("D")[1:-1]]


def test_a_session_rests_the_tokens_rest_after_says_after_empty_rounds():
    """After its 1st, 2nd, 3rd ... empty round a session decodes 1, 2, 4 ... tokens without its draft
    (budget.rest_after), its model draft's and its suffix walk's alike. The planner observes a round
    after it committed: its token is in the history already and is no token of the rest."""
    assert rests(drafting_steps(model_free=False)) == [1, 2, 4, 8, 16], drafting_steps(model_free=False)
    assert rests(drafting_steps(model_free=True)) == [1, 2, 4, 8, 16], drafting_steps(model_free=True)


def test_the_oracles_rounds_do_not_move_the_acceptance_estimate():
    """The oracle drops each candidate the target would reject before it is verified (it reads the
    target's tokens in advance), so its rounds never show a rejection: counted, they pushed the
    estimate the next budgeted request is planned at towards 1 (`specdec bench` runs every policy's
    rounds through one engine). A fixed-K round that verifies its candidates counts."""

    async def observed(policy: str) -> float:
        s, planner = session(asyncio.get_running_loop(), policy), StepPlanner(LiveCosts(), given=PAYS)
        for _ in range(50):
            drafted_after = s.sample.length
            s.sample.generated += [7] * 5
            planner.observe([RoundOutcome(s, drafted_after, 4, 4, 4)], [], 1)
        return planner.acceptance

    assert asyncio.run(observed("oracle")) == pytest.approx(0.8)
    assert asyncio.run(observed("fixed")) > 0.95


@pytest.mark.parametrize("share", [0.0, -0.01, float("nan")])
def test_a_probe_share_that_prices_no_probe_is_refused_when_the_planner_is_built(share):
    """The off-probe's interval is its cost over `probe_share` of a plain step: a share of 0 raised
    ZeroDivisionError in the first step the draft was off (every session of it failed), NaN a
    ValueError there, a negative one probed every step. Refused where it is given, not steps later."""
    with pytest.raises(ValueError, match="probe_share"):
        StepPlanner(LiveCosts(), probe_share=share)
    StepPlanner(LiveCosts(), probe_share=1e9)  # above 1: an off-probe every step the draft is off



def test_a_curve_probe_that_failed_is_tried_again():
    """8 sessions on a CPU-like target curve (the second token of a pass costs 150 ms, every later
    one 5): extrapolated past the 1-8 tokens measured, no round pays, so the planner times a 16-token
    pass. Where that probe fails (the verifier between replicas) it is tried again once the plain
    steps have paid for it: marked as done, that size was never timed at this load, and the draft
    stayed off for good."""
    from specdec.cost_profile import PassTiming

    costs = LiveCosts()
    costs.observe([PassTiming("draft", n, 3.0 * n, probe=True) for n in (1, 2, 16)]
                  + [PassTiming("verifier", n, 50.0 if n == 1 else 200.0 + 5.0 * (n - 2), probe=True)
                     for n in range(1, 9)])
    probes = []

    async def time_target(tokens: int) -> list[PassTiming]:
        probes.append(tokens)
        if len(probes) == 1:
            raise ConnectionError("the verifier is gone")
        return [PassTiming("verifier", tokens, 200.0 + 5.0 * (tokens - 2), probe=True)]

    async def steps() -> StepPlanner:
        loop = asyncio.get_running_loop()
        batch = [session(loop, name=f"s/{i}") for i in range(8)]
        planner = StepPlanner(costs, time_target=time_target)
        for _ in range(60):
            await planner.plan(batch)
        return planner

    planner = asyncio.run(steps())
    assert probes[:2] == [16, 16] and planner.drafting, probes
