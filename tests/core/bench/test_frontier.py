"""Pareto frontiers and frontier dominance in the verification/discard plane."""

from __future__ import annotations

import pytest

from specdec.bench.frontier import discard_on_frontier, frontier_dominance, pareto_frontier

POINTS = [(0.25, 0.30), (0.10, 0.50), (0.40, 0.10), (0.20, 0.20)]  # the module docstring's example


def test_frontier_drops_dominated_points_and_sorts():
    assert pareto_frontier(POINTS) == [(0.10, 0.50), (0.20, 0.20), (0.40, 0.10)]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(0.3, 0.2), (0.3, 0.1)]) == [(0.3, 0.1)]  # same verification rate: lower discard
    assert pareto_frontier([(0.5, 0.5), (0.2, 0.1)]) == [(0.2, 0.1)]  # one point dominates everything


def test_discard_on_frontier_interpolates():
    frontier = pareto_frontier(POINTS)
    assert discard_on_frontier(frontier, 0.30) == pytest.approx(0.15)
    assert discard_on_frontier(frontier, 0.20) == pytest.approx(0.20)
    assert discard_on_frontier(frontier, 0.90) == pytest.approx(0.10)  # past the last point: flat
    assert discard_on_frontier(frontier, 0.05) is None  # below the lowest verification rate reached


def test_dominance():
    ours = POINTS
    worse = [(0.30, 0.16), (0.45, 0.12)]
    result = frontier_dominance(ours, worse)
    assert (result.dominated, result.total, result.uncovered, result.dominates) == (2, 2, 0, True)

    better_somewhere = [(0.30, 0.14), (0.45, 0.12)]  # 0.14 lies below the segment's 0.15
    assert not frontier_dominance(ours, better_somewhere).dominates

    out_of_reach = [(0.05, 0.9), (0.45, 0.12)]  # verification 0.05 is lower than ours ever gets
    result = frontier_dominance(ours, out_of_reach)
    assert (result.dominated, result.uncovered, result.dominates) == (1, 1, False)


def test_a_frontier_dominates_itself_but_not_an_empty_one():
    assert frontier_dominance(POINTS, POINTS).dominates
    assert not frontier_dominance(POINTS, []).dominates
    assert frontier_dominance([], POINTS).uncovered == 3
