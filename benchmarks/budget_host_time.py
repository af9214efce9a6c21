"""The step budget's own host work per step, by batch size (no models: the decisions alone).

    python benchmarks/budget_host_time.py [--profile FILE] [--sessions 1 4 16 64] [--candidates 20]

What the budget adds to a step of B sessions, in the loop (`RoundLoop._who_drafts`: the best allocation at
the bound, at the upper end of the measured acceptance and at it, the draining batch's where a session
lags, then `who_drafts`) and on the draft side per drafting step
(`StepBudget.keep` and `StepBudget.draft_on` over the step's sessions), against the step's own
target pass (plain decoding's pass over B tokens, from the profile). The profile is the default
pair's llama.cpp or torch default, or one measured (a bench results.json, `--profile`); the
decisions' cost hardly depends on its numbers, only on B and the candidate cap (a numpy grid over m x k).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from specdec.budget import (PRIOR_WEIGHT, StepBudget, best_allocations, draining_allocation, hopeful_acceptance,
                            who_drafts)
from specdec.cost_profile import DEFAULT_PROFILES, CostProfile


def median_us(fn, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats)) * 1e6


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
    print("| sessions | loop: per step (us) | draft side: per drafting step (us) | target pass (ms) | share of pass |")
    print("|---|---|---|---|---|")
    for sessions in args.sessions:
        lags, remaining = [1] * (sessions - 1) + [200], [100] * sessions

        def loop_side():  # RoundLoop._who_drafts
            upper = hopeful_acceptance(a * PRIOR_WEIGHT, PRIOR_WEIGHT)
            _, hopeful, _ = best_allocations(profile, sessions, k, (1.0, upper, a))
            judged = draining_allocation(profile, hopeful, sessions, k, upper, 126, 13 / 1225)
            who_drafts(profile, judged, sessions, lags, remaining)

        def draft_side():
            budget = StepBudget(profile, expected=float(sessions), tokens=sessions, spent_ms=profile.draft_ms(sessions))
            kept = budget.keep([a] * sessions)
            for _ in range(sum(kept)):
                budget.add(a)
            budget.draft_on([a] * sessions, [a] * sessions, [k - 1] * sessions)

        loop_us, draft_us = median_us(loop_side, args.repeats), median_us(draft_side, args.repeats)
        pass_ms = profile.pass_ms(sessions)
        print(f"| {sessions} | {loop_us:.0f} | {draft_us:.0f} | {pass_ms:.0f} | "
              f"{(loop_us + draft_us) / 1000 / pass_ms:.2%} |")


if __name__ == "__main__":
    main()
