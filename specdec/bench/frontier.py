"""Pareto frontiers in the (verification rate, discard rate) plane (the paper's Figure 4).

Both rates are better lower: fewer target passes per token and fewer wasted draft tokens per token.
A family's frontier is its non-dominated operating points, sorted by verification rate (so discard
rates fall along it). Between two frontier points the frontier is the straight segment: mixing two
operating points over prompts reaches roughly any point on it.

Worked example: points (0.10, 0.50), (0.20, 0.20), (0.25, 0.30), (0.40, 0.10). (0.25, 0.30) is
dominated by (0.20, 0.20); the frontier is (0.10, 0.50) -> (0.20, 0.20) -> (0.40, 0.10). A point
(0.30, 0.16) of another family lies above the segment (0.20, 0.20)-(0.40, 0.10), whose discard rate
at verification 0.30 is 0.15, so the frontier dominates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Point = tuple[float, float]  # (verification rate, discard rate)
TOLERANCE = 1e-9


def pareto_frontier(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points (minimising both coordinates), by increasing verification rate."""
    frontier: list[Point] = []
    for v, d in sorted(points):
        if not frontier or d < frontier[-1][1] - TOLERANCE:
            if frontier and abs(frontier[-1][0] - v) <= TOLERANCE:
                frontier[-1] = (v, d)  # same verification rate, lower discard
            else:
                frontier.append((v, d))
    return frontier


def discard_on_frontier(frontier: Sequence[Point], verification_rate: float) -> float | None:
    """The frontier's discard rate at `verification_rate` (linear between points, flat past the
    last one: a higher verification rate can always be had at the last point's discard rate);
    None below the frontier's lowest verification rate, which it cannot reach."""
    if not frontier or verification_rate < frontier[0][0] - TOLERANCE:
        return None
    for (v0, d0), (v1, d1) in zip(frontier, frontier[1:]):
        if verification_rate <= v1:
            return d0 + (d1 - d0) * (verification_rate - v0) / (v1 - v0)
    return frontier[-1][1]


@dataclass(frozen=True)
class Dominance:
    dominated: int  # points of the other frontier on or above this one
    total: int  # points of the other frontier
    uncovered: int  # of those, points at a verification rate this frontier cannot reach

    @property
    def dominates(self) -> bool:
        return self.total > 0 and self.dominated == self.total

    def to_dict(self) -> dict:
        return {"dominated": self.dominated, "total": self.total, "uncovered": self.uncovered,
                "dominates": self.dominates}


def frontier_dominance(ours: Sequence[Point], theirs: Sequence[Point]) -> Dominance:
    """How many points of `theirs`' frontier `ours`' frontier weakly dominates."""
    mine, other = pareto_frontier(ours), pareto_frontier(theirs)
    dominated = uncovered = 0
    for v, d in other:
        level = discard_on_frontier(mine, v)
        if level is None:
            uncovered += 1
        elif level <= d + TOLERANCE:
            dominated += 1
    return Dominance(dominated, len(other), uncovered)
