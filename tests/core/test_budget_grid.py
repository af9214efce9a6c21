"""The budget's grids (budget.best_allocation, StepBudget.keep and draft_on price every allocation at
once with numpy) decide as the loops they replaced, kept here as the reference: one allocation, one
candidate or one (steps, sessions) pair at a time, in the same order, the first strictly better kept.
numpy's power of an array may round a^k in the last bit where Python's does not, so a choice may
differ only between allocations priced alike to 1e-12."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specdec.budget import Allocation, StepBudget, best_allocation, best_allocations, geometric
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
    if x < k_first:  # along the first segment, at least the first point's cost per token
        (k1, t1) = points[1]
        return max((t1 - t_first) / (k1 - k_first) * (x - k_first) + t_first, t_first * x / k_first)
    for (k0, t0), (k1, t1) in zip(points, points[1:]):  # np.interp's arithmetic
        if x == k0:
            return t0
        if x < k1:
            return (t1 - t0) / (k1 - k0) * (x - k0) + t0
    return t_last


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


def keep_rates(budget: StepBudget, gains: list[float]) -> dict[int, float]:
    """m -> the step's rate with the top m candidates by gain kept (the reference loop's values)."""
    order = sorted(range(len(gains)), key=lambda s: -gains[s])
    rates, total = {0: budget.rate()}, 0.0
    for m, s in enumerate(order, 1):
        total += gains[s]
        rates[m] = budget.rate(total, m)
    return rates


def draft_on_rates(budget: StepBudget, survive, acceptance, left, beside: int = 0) -> dict[int, float]:
    """m -> the best rate over d with the top m sessions drafting d more steps (the reference loop's)."""
    order = sorted((s for s in range(len(survive)) if left[s] > 0), key=lambda s: -survive[s] * acceptance[s])
    rates = {0: budget.rate()}
    for d in range(1, max((left[s] for s in order), default=0) + 1):
        gain, tokens = 0.0, 0
        for m, s in enumerate(order, 1):
            steps = min(d, left[s])
            gain += survive[s] * geometric(acceptance[s], steps)
            tokens += steps
            rates[m] = max(rates.get(m, -np.inf), budget.rate(gain, tokens, d * budget.step_ms(m, beside)))
    return rates


def reference_choice(rates: dict[int, float]) -> int:
    """The loops' choice: the first m whose rate beats every one before it and the ones after."""
    best_m = 0
    for m in sorted(rates):
        if rates[m] > rates[best_m]:
            best_m = m
    return best_m


def chosen_count(chosen: list[bool], rates: dict[int, float]) -> int:
    """How many the grid chose, where that is the reference's choice or priced as it to 1e-12."""
    m, best = sum(chosen), reference_choice(rates)
    assert m == best or rates[m] == pytest.approx(rates[best], rel=1e-12, abs=0)
    return m


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
    got, want = best_allocation(profile, sessions, cap, acceptance), reference_best_allocation(profile, sessions, cap, acceptance)
    # the same allocation, or one priced as it to the last bits
    assert got.token_ms == pytest.approx(want.token_ms, rel=1e-12, abs=0) and got.plain_ms == want.plain_ms
    assert (got.drafters > 0) == (want.drafters > 0) or got.token_ms == pytest.approx(got.plain_ms, rel=1e-12, abs=0)


@settings(max_examples=150, deadline=None)
@given(profiles(), st.integers(1, 8), st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.05, 1.0), st.integers(0, 12)),
                                                min_size=1, max_size=10),
       st.floats(0.0, 300.0), st.integers(0, 3))
def test_keep_and_draft_on_are_the_loops(profile, sessions, rows, spent, beside):
    budget = StepBudget(profile, expected=float(sessions), tokens=sessions, spent_ms=spent)
    survive, acceptance, left = ([r[i] for r in rows] for i in range(3))
    gains = [p * a for p, a in zip(survive, acceptance)]
    kept = budget.keep(gains)
    m = chosen_count(kept, keep_rates(budget, gains))
    assert sorted(range(len(gains)), key=lambda s: -gains[s])[:m] == [s for s in sorted(range(len(gains)),
                                                                      key=lambda s: -gains[s]) if kept[s]]
    on = budget.draft_on(survive, acceptance, left, beside)
    m = chosen_count(on, draft_on_rates(budget, survive, acceptance, left, beside))
    order = sorted((s for s in range(len(survive)) if left[s] > 0), key=lambda s: -survive[s] * acceptance[s])
    assert [s for s in order if on[s]] == order[:m] and not any(on[s] for s in range(len(on)) if left[s] == 0)


@settings(max_examples=100, deadline=None)
@given(profiles(), st.integers(1, 12), st.integers(1, 20), st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4))
def test_several_acceptances_in_one_grid_are_each_ones_allocation(profile, sessions, cap, acceptances):
    together = best_allocations(profile, sessions, cap, acceptances)
    for got, a in zip(together, acceptances, strict=True):
        want = best_allocation(profile, sessions, cap, a)
        assert got.token_ms == pytest.approx(want.token_ms, rel=1e-12, abs=0) and got.plain_ms == want.plain_ms
