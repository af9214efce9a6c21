"""The paper's cost model (§2, §4.2), as pure functions over counts and times.

Eq. 2.1:  T_total = t_draft * N_draft + t_target * N_target
Eq. 2.3:  latency / token = t_draft + t_draft * N_discarded / N + (t_target - t_draft) * N_target / N

`fit_cost_model` finds (t_draft, t_target) by least squares over many generations, no intercept, as
the paper does (R^2 >= 0.98 there). Target-only decoding is eq. 2.3 with verification rate 1 and
discard rate 0, i.e. t_target per token, so the paper's predicted speedup is t_target / predicted
latency (`CostFit.speedup`). The bench report divides predicted tok/s by target-only's measured
tok/s instead: on CPU the fitted t_target, a pass over K+1 tokens, is dearer than a one-token step.

`fit_round_costs` measures what `specdec++cost` plans with (specdec/cost_profile.py) in the loop
itself rather than on bare forward passes: t_draft is the draft's time per drafting step (sampling,
features and the head included), and a verification pass over k candidates is fitted as
t(k) = a + b k by least squares of each generation's target time on (rounds, candidates drafted).
On the project's CPU a drafting step costs what a bare draft pass costs in the same process (sampling,
features and the head add ~1-2 ms), but a verification pass grows 2-3x faster per candidate than
`specdec bench`'s bare `forward_times` show (docs/training.md, "The loop's own costs").

Worked example: t_draft = 0.03 s, t_target = 0.35 s; a policy with verification rate 0.1 and
discard rate 0.2 predicts 0.03 + 0.03 * 0.2 + 0.32 * 0.1 = 0.068 s/token, i.e. 14.7 tok/s and a
0.35 / 0.068 = 5.1x speedup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from specdec.cost_profile import CostProfile
from specdec.metrics import MS_PER_S, predicted_latency_per_token

MIN_POINTS = 3  # two unknowns: fewer generations leave nothing to test the fit against


@dataclass(frozen=True)
class CostFit:
    t_draft: float  # seconds per draft forward pass
    t_target: float  # seconds per target forward pass
    r2: float  # coefficient of determination of T_total (1 - SS_res / SS_tot around the mean)
    points: int

    def predict(self, n_draft: float, n_target: float) -> float:
        """Eq. 2.1."""
        return self.t_draft * n_draft + self.t_target * n_target

    def latency(self, verification_rate: float, discard_rate: float) -> float:
        """Eq. 2.3: predicted seconds per generated token."""
        return predicted_latency_per_token(self.t_draft, self.t_target, discard_rate, verification_rate)

    def throughput(self, verification_rate: float, discard_rate: float) -> float:
        """Predicted tokens per second (eq. 2.3 inverted)."""
        latency = self.latency(verification_rate, discard_rate)
        return 1.0 / latency if latency > 0 else 0.0

    def speedup(self, verification_rate: float, discard_rate: float) -> float:
        """Predicted speedup over target-only decoding (latency t_target per token)."""
        latency = self.latency(verification_rate, discard_rate)
        return self.t_target / latency if latency > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    residual = float(np.sum((observed - predicted) ** 2))
    total = float(np.sum((observed - observed.mean()) ** 2))
    if total == 0.0:
        return 1.0 if residual == 0.0 else 0.0
    return 1.0 - residual / total


def fit_cost_model(n_draft: Sequence[float], n_target: Sequence[float], wall_s: Sequence[float]) -> CostFit | None:
    """Least squares of T_total on (N_draft, N_target) without intercept (eq. 2.1); None when the
    points cannot determine both coefficients (too few, or the two counts collinear)."""
    x = np.column_stack([np.asarray(n_draft, dtype=float), np.asarray(n_target, dtype=float)])  # [P, 2]
    y = np.asarray(wall_s, dtype=float)  # [P]
    if len(y) < MIN_POINTS or np.linalg.matrix_rank(x) < 2:
        return None
    (t_draft, t_target), *_ = np.linalg.lstsq(x, y, rcond=None)
    return CostFit(float(t_draft), float(t_target), r_squared(y, x @ np.array([t_draft, t_target])), len(y))


def fit_standalone(n_passes: Sequence[float], wall_s: Sequence[float]) -> CostFit | None:
    """Target-only generations: T_total = t_target * N_target (no draft passes); t_draft is 0."""
    x, y = np.asarray(n_passes, dtype=float), np.asarray(wall_s, dtype=float)
    if len(y) < 2 or not np.any(x):
        return None
    t_target = float(x @ y / (x @ x))
    return CostFit(0.0, t_target, r_squared(y, t_target * x), len(y))


def fit_round_costs(records: Sequence[dict], source: str = "") -> CostProfile | None:
    """The loop's own costs from bench records (module docstring); None without enough speculative
    generations of different round lengths to separate a from b."""
    stats = [r["stats"] for r in records if r["stats"].get("draft_forward_passes")]
    rounds = [[sum(s["k_histogram"].values()), sum(int(k) * n for k, n in s["k_histogram"].items())] for s in stats]
    x = np.asarray(rounds, dtype=float).reshape(-1, 2)  # [P, 2]: rounds, candidates verified
    y = np.asarray([s["target_time_s"] for s in stats], dtype=float) * MS_PER_S  # [P]
    if len(y) < MIN_POINTS or np.linalg.matrix_rank(x) < 2:
        return None
    (per_pass, per_candidate), *_ = np.linalg.lstsq(x, y, rcond=None)
    if per_pass <= 0 or per_candidate < 0:
        return None
    t_draft = sum(s["draft_time_s"] for s in stats) / sum(s["draft_forward_passes"] for s in stats) * MS_PER_S
    longest = max(int(k) for s in stats for k in s["k_histogram"])
    return CostProfile(t_draft_ms=round(t_draft, 2), source=source or f"fitted on {len(y)} bench generations",
                       t_target_ms={1: round(per_pass, 2), longest + 1: round(per_pass + per_candidate * longest, 2)})


def speedup_share(policy_speedup: float, oracle_speedup: float) -> float:
    """A policy's speedup as a fraction of the oracle's (the goal asks for >= 0.85)."""
    return policy_speedup / oracle_speedup if oracle_speedup > 0 else 0.0
