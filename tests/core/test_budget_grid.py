"""The budget's grids (budget.best_allocation, StepBudget.keep and draft_on price every allocation at
once with numpy) decide as the loops they replaced, kept here as the reference: one allocation, one
candidate or one (steps, sessions) pair at a time, in the same order, the first strictly better kept."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from specdec.budget import Allocation, StepBudget, best_allocation, geometric
from specdec.cost_profile import CostProfile, interpolate


def reference_interpolate(curve: dict[int, float], x: float) -> float:
    points = list(curve.items())
    if len(points) == 1:
        return points[0][1]
    (k_first, t_first), (k_last, t_last) = points[0], points[-1]
    if x > k_last:
        k0, t0 = points[-2]
        slope = max((t_last - t0) / (k_last - k0), (t_last - t_first) / (k_last - k_first), 0.0)
        return t_last + slope * (x - k_last)
    for (k0, t0), (k1, t1) in zip(points, points[1:]):
        if x <= k1:
            break
    return max(t0 + (t1 - t0) * (x - k0) / (k1 - k0), 0.0)


def reference_best_allocation(profile: CostProfile, sessions: int, max_candidates: int, acceptance: float) -> Allocation:
    plain = profile.pass_ms(sessions) / sessions
    best = Allocation(plain, 0, 0, plain)
    for m in range(1, sessions + 1):
        for k in range(1, max_candidates + 1):
            draft = profile.draft_ms(m * (1 + acceptance ** k)) + (k - 1) * profile.draft_ms(m)
            token_ms = (draft + profile.pass_ms(sessions + m * k)) / (sessions + m * geometric(acceptance, k))
            if token_ms < best.token_ms:
                best = Allocation(token_ms, m, k, plain)
    return best


def reference_keep(budget: StepBudget, gains: list[float]) -> list[bool]:
    order = sorted(range(len(gains)), key=lambda s: -gains[s])
    best_m, best, total = 0, budget.rate(), 0.0
    for m, s in enumerate(order, 1):
        total += gains[s]
        rate = budget.rate(total, m)
        if rate > best:
            best_m, best = m, rate
    kept = set(order[:best_m])
    return [s in kept for s in range(len(gains))]


def reference_draft_on(budget: StepBudget, survive, acceptance, left, beside: int = 0) -> list[bool]:
    order = sorted((s for s in range(len(survive)) if left[s] > 0), key=lambda s: -survive[s] * acceptance[s])
    best_m, best = 0, budget.rate()
    for d in range(1, max((left[s] for s in order), default=0) + 1):
        gain, tokens = 0.0, 0
        for m, s in enumerate(order, 1):
            steps = min(d, left[s])
            gain += survive[s] * geometric(acceptance[s], steps)
            tokens += steps
            rate = budget.rate(gain, tokens, d * budget.step_ms(m, beside))
            if rate > best:
                best_m, best = m, rate
    chosen = set(order[:best_m])
    return [s in chosen for s in range(len(survive))]


curves = st.dictionaries(st.integers(1, 80), st.floats(1.0, 500.0), min_size=1, max_size=8)


@st.composite
def profiles(draw) -> CostProfile:
    """Curves from one token and one row on, as measured ones are (the probes time both), so that
    no pass the budget prices is extrapolated to nothing."""
    first = draw(st.floats(1.0, 100.0))
    return CostProfile(t_draft_ms=draw(st.floats(0.5, 50.0)), t_target_ms=draw(curves) | {1: first},
                       t_draft_rows_ms=draw(st.one_of(st.just({}), curves.map(lambda c: c | {1: first / 2}))))


@settings(max_examples=200, deadline=None)
@given(curves, st.lists(st.floats(0.0, 200.0), min_size=1, max_size=20))
def test_the_curve_is_the_pointwise_rule_at_numbers_and_arrays(curve, xs):
    curve = dict(sorted(curve.items()))
    expected = [reference_interpolate(curve, x) for x in xs]
    assert [interpolate(curve, x) for x in xs] == expected
    assert interpolate(curve, np.array(xs)).tolist() == expected


@settings(max_examples=150, deadline=None)
@given(profiles(), st.integers(1, 12), st.integers(1, 20), st.floats(0.05, 1.0))
def test_best_allocation_is_the_loops(profile, sessions, cap, acceptance):
    assert best_allocation(profile, sessions, cap, acceptance) == reference_best_allocation(profile, sessions, cap, acceptance)


@settings(max_examples=150, deadline=None)
@given(profiles(), st.integers(1, 8), st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.05, 1.0), st.integers(0, 12)),
                                                min_size=1, max_size=10),
       st.floats(0.0, 300.0), st.integers(0, 3))
def test_keep_and_draft_on_are_the_loops(profile, sessions, rows, spent, beside):
    budget = StepBudget(profile, expected=float(sessions), tokens=sessions, spent_ms=spent)
    survive, acceptance, left = ([r[i] for r in rows] for i in range(3))
    gains = [p * a for p, a in zip(survive, acceptance)]
    assert budget.keep(gains) == reference_keep(budget, gains)
    assert budget.draft_on(survive, acceptance, left, beside) == reference_draft_on(budget, survive, acceptance, left, beside)
