"""Forward costs for the cost-aware rule and the batch's verification budget (`specdec++cost`,
specdec/budget.py; docs/planner.md).

A profile holds the time of a drafting step by the sessions (rows) it advances, and the time of a
target pass by the tokens it feeds. A verification pass over k candidates feeds k + 1 tokens, so for
one session

    t_target(k) = pass(k + 1)      (k = 0: plain decoding, one token)

with `pass` (and the drafting step's curve) linearly interpolated between the measured points and
extended past the last at the steeper of its last segment and its whole span's mean slope (a single
point: flat; `interpolate`).

Where the step planner's profile comes from (specdec/planner.py): measured where it runs
(`LiveCosts`, below: every drafting step and verification pass is timed, seeded by a short probe
when the workers start), unless a profile is given by hand: the file named by the environment
variable `SPECDEC_COST_PROFILE` when the loop is built (a profile JSON as below, or a bench
`results.json`: `CostProfile.load`). Before anything is measured no budgeted session drafts: a
profile measured elsewhere does not say what pays here.

    {"t_draft_ms": 22, "t_target_ms": {"1": 35, "2": 65, "4": 110, "8": 237, "16": 305}}
    (optional: "t_draft_rows_ms": {"1": 22, "8": 60}, a drafting step by the sessions in it; without
    it a step costs t_draft_ms per session)
"""

from __future__ import annotations

import json
import math
import os
import statistics
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specdec.errors import InvalidRequestError, one_line, validation_message
from specdec.metrics import MS_PER_S

PROFILE_ENV = "SPECDEC_COST_PROFILE"


class CostProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t_draft_ms: float = Field(ge=0.0, allow_inf_nan=False,
                              description="one drafting step of one session (one token through the draft)")
    t_target_ms: dict[int, float] = Field(min_length=1, description="one target pass, by tokens it feeds")
    # A drafting step by the sessions it advances (one token each); empty: t_draft_ms per session.
    t_draft_rows_ms: dict[int, float] = Field(default_factory=dict)
    source: str = ""  # where it was measured (free text)

    @field_validator("t_target_ms", "t_draft_rows_ms")
    @classmethod
    def _curve(cls, curve: dict[int, float]) -> dict[int, float]:
        if any(k < 1 for k in curve) or any(not (math.isfinite(t) and t > 0) for t in curve.values()):
            raise ValueError("a cost curve maps token counts >= 1 to positive times")
        return dict(sorted(curve.items()))

    def pass_ms(self, tokens):
        """Time of one target pass over `tokens` tokens, a number or an array (interpolated; module
        docstring)."""
        return interpolate(self.t_target_ms, tokens)

    def draft_ms(self, rows):
        """Time of one drafting step advancing `rows` sessions, a number or an array (0: none, no
        pass). Without a measured curve, t_draft_ms per session: on a CPU a pass grows with its rows,
        and the overestimate errs towards plain decoding."""
        if np.ndim(rows) == 0:
            if rows <= 0:
                return 0.0
            return interpolate(self.t_draft_rows_ms, rows) if self.t_draft_rows_ms else self.t_draft_ms * rows
        rows = np.asarray(rows, dtype=float)
        ms = interpolate(self.t_draft_rows_ms, rows) if self.t_draft_rows_ms else self.t_draft_ms * rows
        return np.where(rows > 0, ms, 0.0)

    def t_target(self, candidates: int) -> float:
        """ms of the verification pass over `candidates` candidates (k + 1 tokens)."""
        return self.pass_ms(candidates + 1)

    @classmethod
    def from_forward_times(cls, forward_times: dict, source: str = "") -> CostProfile:
        """From `specdec bench`'s `forward_times` ({"draft_s": {k: s}, "target_s": {k: s}}): t_draft is
        the draft's one-token pass."""
        draft = {int(k): float(v) for k, v in forward_times["draft_s"].items()}
        return cls(t_draft_ms=draft[min(draft)] * MS_PER_S, source=source,
                   t_target_ms={int(k): float(v) * MS_PER_S for k, v in forward_times["target_s"].items()})

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """A profile JSON, or a bench results.json / notes.json: its `live_profile` (the curves the loop
        measured and planned with), else its `cost_profile` (eq. 2.1's linear fit over the rounds,
        which misprices a curve with a step in it: docs/planner.md), else its bare `forward_times`."""
        path = Path(path).expanduser()
        try:
            raw = json.loads(path.read_text())
            if isinstance(raw, dict) and raw.get("live_profile"):
                if not isinstance(raw["live_profile"], dict):
                    raise ValueError("live_profile must be an object")
                live = {k: v for k, v in raw["live_profile"].items() if k != "drafting"}
                return cls.model_validate({**live, "source": f"{live.get('source', '')} ({path})".strip()})
            if isinstance(raw, dict) and raw.get("cost_profile"):
                return cls.model_validate(raw["cost_profile"])
            if isinstance(raw, dict) and "forward_times" in raw:
                return cls.from_forward_times(raw["forward_times"], source=str(path))
            return cls.model_validate(raw)
        except OSError as exc:
            raise InvalidRequestError(f"cannot read cost profile {path}: {exc.strerror or exc}") from None
        except ValidationError as exc:
            raise InvalidRequestError(f"bad cost profile {path}: {validation_message(exc)}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"bad cost profile {path}: {one_line(exc)}") from None


# Reference profiles of the default pair, measured once on the project's 2-core Intel Xeon, for the
# offline tools (benchmarks/replay_rules.py, budget_host_time.py) and tests; the loop never plans with
# them (docs/planner.md, "Before anything is measured"). torch: the in-loop fit over the shipped head's
# validation runs (docs/results/head3-validation/); llama.cpp: benchmarks/forward_times.py.
DEFAULT_PROFILE = CostProfile(t_draft_ms=56.0, t_target_ms={1: 396.77, 21: 859.36},
                              source="default pair, torch runtime, in-loop fit on validation runs, 2-core Intel Xeon")

LLAMACPP_PROFILE = CostProfile(t_draft_ms=35.0, t_target_ms={1: 68.0, 2: 100.0, 3: 123.0, 4: 108.0, 5: 141.0, 6: 161.0,
                                                             8: 194.0, 12: 245.0, 16: 238.0},
                               source="default pair, llama.cpp Q4_K_M, 2-core Intel Xeon (docs/performance.md)")
DEFAULT_PROFILES = {"torch": DEFAULT_PROFILE, "llamacpp": LLAMACPP_PROFILE}


def describe_profile(profile: CostProfile | None, drafting: bool) -> str:
    """One line for `--debug` and logs: the curves and whether drafting pays at all."""
    if profile is None:
        return "costs: nothing measured yet"
    draft = ", ".join(f"{k}: {v:.1f}" for k, v in (profile.t_draft_rows_ms or {1: profile.t_draft_ms}).items())
    target = ", ".join(f"{k}: {v:.1f}" for k, v in profile.t_target_ms.items())
    return (f"costs ({profile.source}): drafting step ms by sessions {{{draft}}}; target pass ms by tokens "
            f"{{{target}}}; drafting {'pays' if drafting else 'does not pay: the draft is off'}")


class Curve:
    """A measured curve (tokens or sessions -> ms) as arrays, evaluated at a number or an array of
    them (the budget prices a grid of allocations at once: budget.py): linear between its points (as
    measured: a dip where the kernels batch well stays). Past the last point it grows at the steeper
    of its last segment and its whole span's mean slope, never less: a noisy last point (a live
    bucket of few timings) must not make longer passes look cheap, let alone free. Before the first
    point, along the first segment, but never below the first point's cost per token (a curve
    measured from 16 tokens on, steep at first, made shorter passes free)."""

    def __init__(self, points: dict[int, float]):
        self.k_list, self.t_list = [float(k) for k in points], [float(t) for t in points.values()]
        self.ks, self.ts = np.array(self.k_list), np.array(self.t_list)
        ks, ts = self.k_list, self.t_list
        self.slope = 0.0 if len(ks) == 1 else max((ts[-1] - ts[-2]) / (ks[-1] - ks[-2]),
                                                  (ts[-1] - ts[0]) / (ks[-1] - ks[0]), 0.0)
        self.first_slope = 0.0 if len(ks) == 1 else (ts[1] - ts[0]) / (ks[1] - ks[0])

    def __call__(self, x):
        if isinstance(x, (int, float, np.number)):  # the same arithmetic without numpy's ~10 us a call
            return self._at(float(x))
        x = np.asarray(x, dtype=float)
        if len(self.k_list) == 1:
            y = np.full(x.shape, self.t_list[0])
        else:
            ks, ts = self.ks, self.ts
            y = np.where(x > ks[-1], ts[-1] + self.slope * (x - ks[-1]), np.interp(x, ks, ts))
            if x.size and x.min() < ks[0]:
                y = np.where(x < ks[0], np.maximum(self.first_slope * (x - ks[0]) + ts[0], ts[0] * x / ks[0]), y)
        return y if y.ndim else float(y)

    def _at(self, x: float) -> float:
        """np.interp's arithmetic inside the curve (a point's own value at it, else the segment's
        slope times the distance from its start, plus its start), the class docstring's outside."""
        ks, ts = self.k_list, self.t_list
        if len(ks) == 1:
            return ts[0]
        if x > ks[-1]:
            return ts[-1] + self.slope * (x - ks[-1])
        if x < ks[0]:
            return max(self.first_slope * (x - ks[0]) + ts[0], ts[0] * x / ks[0])
        j = bisect_right(ks, x) - 1
        if ks[j] == x:
            return ts[j]
        return (ts[j + 1] - ts[j]) / (ks[j + 1] - ks[j]) * (x - ks[j]) + ts[j]


def interpolate(curve: dict[int, float], x):
    """`curve` at x (a number or an array): `Curve`, built once per curve (a budget evaluates one
    profile's curves many times a step)."""
    return _curve(tuple(curve.items()))(x)


@lru_cache(maxsize=256)
def _curve(points: tuple[tuple[int, float], ...]) -> Curve:
    return Curve(dict(points))


def given_profile() -> CostProfile | None:
    """The profile given by hand (`SPECDEC_COST_PROFILE`), which overrides the measured one; read
    once, when a loop is built."""
    path = os.environ.get(PROFILE_ENV)
    return CostProfile.load(path) if path else None


# ----------------------------------------------------------------------------------------------
# Measured where it runs

PassRole = str  # "draft" (a drafting step, by the tokens it feeds: one per session) or "verifier"


@dataclass(frozen=True)
class PassTiming:
    """One timed pass: a drafting step or a verification, host work around the forward included
    (sampling, the head, Algorithm 1: what the loop pays for it)."""

    role: PassRole
    tokens: int  # tokens fed: the sessions of a drafting step (more when the draft catches up), a pass's tokens
    ms: float
    probe: bool = False  # a scratch pass timed by a worker's probe (workers.py), not a round's


def bucket(tokens: int) -> int:
    """Token counts timed together: exact up to 32, then two significant bits (32, 48, 64, 96, ...)."""
    if tokens <= 32:
        return tokens
    step = 1 << (tokens.bit_length() - 2)
    return tokens // step * step


class LiveCosts:
    """The live profile. Each role's pass times are kept by token bucket, with the role's speed
    factored out: a bucket holds its last WINDOW timings divided by the role's `level` when each
    came in, and counts at level x the median of them (an outlier moves nothing). The level is
    anchored: each bucket keeps a base, the median of its first MIN_SAMPLES timings (in level
    units), and every timing divided by its bucket's base estimates the level; once the median of
    the last LEVEL_WINDOW estimates is off the level by more than LEVEL_BAND, the level becomes
    that median. So a change of the machine's speed (a busy host, another thread count) moves the
    whole curve within LEVEL_WINDOW passes of any size, sizes not being timed included, and a
    change of one size alone moves its bucket within WINDOW // 2 + 1 of its passes. While the
    draft is off only the target is timed; the level of a role not timed for IDLE_TIMINGS timings
    moves with the other's.

    A bucket counts once it holds MIN_SAMPLES timings, or at once when a probe measured it (the
    planner's glossary: specdec/planner.py); a probe's timing replaces what its bucket held.
    `profile()` is None until both roles have a bucket.

    A target pass costs more the more sessions hold a cache (attention reads every cached token),
    so each timing keeps the sessions of the step it was made in, and `profile(sessions)`, the
    costs for a step of that many, leaves out the target passes longer than the step's plain one
    that were timed in steps of at most half as many sessions; past the plain pass such a step
    plans along the curve's slope until a curve probe times a pass at its size. docs/planner.md
    ("Live costs") tells the runs that made each rule."""

    WINDOW = 9
    MIN_SAMPLES = 3
    LEVEL_WINDOW = 5
    LEVEL_BAND = 0.15
    # A role not timed for this many timings (of the other role: the draft while it is off) is idle,
    # and its level moves with the other's (`_track_level`).
    IDLE_TIMINGS = 20

    def __init__(self):
        # role -> bucket -> its last timings: (tokens, ms / level, sessions of the step)
        self._times: dict[PassRole, dict[int, deque[tuple[int, float, int]]]] = {"draft": {}, "verifier": {}}
        self._level: dict[PassRole, float] = {"draft": 1.0, "verifier": 1.0}
        self._estimates: dict[PassRole, deque[float]] = {role: deque(maxlen=self.LEVEL_WINDOW) for role in self._times}
        self._seeded: set[tuple[PassRole, int]] = set()
        self._base: dict[tuple[PassRole, int], list[float]] = {}  # a bucket's first timings, in level units
        self._snapshots: dict[int | None, CostProfile | None] = {}
        self.observed = 0  # timings folded in
        self._last_timed: dict[PassRole, int] = {role: 0 for role in self._times}  # `observed` at its last timing

    def observe(self, timings: Iterable[PassTiming], sessions: int = 1) -> None:
        """Fold in the timings of a step of `sessions` sessions (a worker's start-up probe: 1)."""
        for t in timings:
            if t.tokens < 1 or not (math.isfinite(t.ms) and t.ms > 0) or t.role not in self._times:
                continue
            key = bucket(t.tokens)
            window = self._times[t.role].setdefault(key, deque(maxlen=self.WINDOW))
            base = self._base.setdefault((t.role, key), [])
            if base:
                self._track_level(t.role, t.ms / statistics.median(base))
            if t.probe:  # a deliberate fresh measurement of a size the rounds may not be timing
                window.clear()
                self._seeded.add((t.role, key))
            window.append((t.tokens, t.ms / self._level[t.role], sessions))
            if len(base) < self.MIN_SAMPLES:
                base.append(t.ms / self._level[t.role])
            self.observed += 1
            self._last_timed[t.role] = self.observed
            self._snapshots.clear()

    def _track_level(self, role: PassRole, estimate: float) -> None:
        estimates = self._estimates[role]
        estimates.append(estimate)
        level = statistics.median(estimates)
        if len(estimates) == estimates.maxlen and abs(level / self._level[role] - 1.0) > self.LEVEL_BAND:
            for other in self._level:  # an idle role's curve moves with the machine (IDLE_TIMINGS)
                if other != role and self.observed - self._last_timed[other] > self.IDLE_TIMINGS:
                    self._level[other] *= level / self._level[role]
                    self._estimates[other].clear()  # measured at the level it had: they would pull it back
            self._level[role] = level

    def curve(self, role: PassRole, sessions: int | None = None) -> dict[int, float]:
        """tokens -> ms: each counted bucket's median tokens and level x median time; with `sessions`,
        a target pass longer than `sessions` tokens only if timed in steps of more than half as many
        sessions (the class docstring)."""
        curve, level = {}, self._level[role]
        for key, window in self._times[role].items():
            if len(window) >= self.MIN_SAMPLES or (role, key) in self._seeded:
                tokens = round(statistics.median(n for n, _, _ in window))
                if role == "verifier" and sessions is not None and tokens > sessions \
                        and 2 * statistics.median(b for _, _, b in window) <= sessions:
                    continue
                curve[tokens] = level * statistics.median(ms for _, ms, _ in window)
        return dict(sorted(curve.items()))

    def profile(self, sessions: int | None = None) -> CostProfile | None:
        """The live costs for a step of `sessions` sessions (None: every measured pass, as reported)."""
        if sessions not in self._snapshots:
            draft, target = self.curve("draft"), self.curve("verifier", sessions)
            self._snapshots[sessions] = None if not (draft and target) else CostProfile(
                t_draft_ms=interpolate(draft, 1), t_draft_rows_ms=draft, t_target_ms=target,
                source=f"measured in the loop ({self.observed} passes)")
        return self._snapshots[sessions]
