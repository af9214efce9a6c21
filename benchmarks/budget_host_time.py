"""The step budget's own host work per step, by batch size (no models: the decisions alone).

    python -m benchmarks.budget_host_time [--profile FILE] [--sessions 1 4 16 64] [--candidates 20]

What deciding adds to a step of B sessions: the loop's side is the step planner's `plan` (one
`StepPlanner`, as a loop's lane has, planning with the given profile: `decide_step` where it
prices the step, the reprice cache where an answer stands), over B budgeted sessions of which one
lags (a catch-up to judge); the draft side per drafting step is `StepBudget.keep` and
`StepBudget.draft_on` over the step's sessions. Against the step's own target pass (plain decoding's
pass over B tokens, from the profile). The profile is the default pair's llama.cpp or torch
reference, or one measured (a bench results.json, `--profile`); the decisions' cost hardly depends on
its numbers, only on B and the candidate cap (a numpy grid over m x k), and on whether the step is
priced (`priced`: the planner's `decide_step` calls per `plan` call).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import timeit

from specdec.budget import StepBudget
from specdec.cost_profile import DEFAULT_PROFILES, CostProfile, LiveCosts
from specdec.params import DEFAULT_DRAFT, build_params
from specdec.planner import RoundOutcome, StepPlanner
from specdec.sequences import LoopSample, Request, SampleState


def median_us(fn, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats)) * 1e6


def finished(coroutine):
    """A coroutine that never suspends, run to its end on this thread (a planner with a given
    profile times no curve probe: its `plan` never awaits), so an event loop's turn is not timed."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine suspended")


def batch_of(sessions: int, cap: int, planner: StepPlanner, name: str = "s") -> list[LoopSample]:
    """B budgeted sessions 100 tokens into a 128-token generation, each draft in step but the last's
    (which lags by its prompt)."""
    params = build_params(policy="specdec++cost", k=cap, max_new_tokens=128, draft=DEFAULT_DRAFT)  # as resolved
    future = asyncio.new_event_loop().create_future()
    batch = [LoopSample(f"{name}/{i}", 0, Request(params, seed=i), SampleState(list(range(140)), list(range(100))),
                        future) for i in range(sessions)]
    planner.observe([RoundOutcome(s, 239, 1, 1, 1) for s in batch[:-1]], [], sessions)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="llamacpp", help="llamacpp, torch or a profile / results.json file")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--candidates", type=int, default=20, help="the candidate cap (MAX_CANDIDATES)")
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    profile = DEFAULT_PROFILES.get(args.profile) or CostProfile.load(args.profile)
    k, a = args.candidates, args.acceptance

    print(f"profile: {profile.source}; candidate cap {k}, acceptance {a}; medians of {args.repeats}")
    print("| sessions | loop: plan (us) | priced | a priced plan (us) | draft side: per drafting step (us) | "
          "target pass (ms) | share of pass |")
    print("|---|---|---|---|---|---|---|")
    for sessions in args.sessions:
        planner = StepPlanner(LiveCosts(), given=profile)
        batch = batch_of(sessions, k, planner)
        calls = 0

        def loop_side():
            nonlocal calls
            calls += 1
            finished(planner.plan(batch))

        fresh = StepPlanner(LiveCosts(), given=profile)  # two batches in turn: every plan is priced
        batches = [batch_of(sessions, k, fresh, name) for name in ("a", "b")]

        def priced_plan():
            finished(fresh.plan(batches[fresh.priced % 2]))

        def draft_side():
            budget = StepBudget(profile, expected=float(sessions), tokens=sessions, spent_ms=profile.draft_ms(sessions))
            kept = budget.keep([a] * sessions)
            for _ in range(sum(kept)):
                budget.add(a)
            budget.draft_on([a] * sessions, [a] * sessions, [k - 1] * sessions)

        loop_us, draft_us = median_us(loop_side, args.repeats), median_us(draft_side, args.repeats)
        priced_us, pass_ms = median_us(priced_plan, args.repeats), profile.pass_ms(sessions)
        print(f"| {sessions} | {loop_us:.0f} | {planner.priced / calls:.2f} | {priced_us:.0f} | {draft_us:.0f} | "
              f"{pass_ms:.0f} | {(loop_us + draft_us) / 1000 / pass_ms:.2%} |")


if __name__ == "__main__":
    main()
