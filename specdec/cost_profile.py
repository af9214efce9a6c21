"""Measured forward costs for cost-aware stopping (`specdec++cost`, DESIGN.md §5).

A profile holds t_draft, the time of one drafting step, and the time of one target pass by the
number of tokens it feeds, measured with a warm cache (`specdec/bench/forward.py`, `specdec bench`'s
`forward_times`). A verification pass over k candidates feeds k + 1 tokens, so

    t_target(k) = pass(k + 1)      (k = 0: plain decoding, one token)

with `pass` linearly interpolated between the measured token counts and extended past the ends
along the nearest segment's slope (a single point: flat).

Where a profile comes from, first found wins: the file named by the environment variable
`SPECDEC_COST_PROFILE` (a profile JSON as below, or a bench `results.json`: its `cost_profile`, the
costs measured in the loop itself (`specdec/bench/costmodel.py`, `fit_round_costs`), else its
`forward_times`, converted), the `cost_profile` of the head's head.json, else the default profile
of the runtime the draft runs on (`DEFAULT_PROFILES`: the default pair measured on the project's
2-core CPU; another machine or pair should measure its own with `specdec bench`).

    {"t_draft_ms": 22, "t_target_ms": {"1": 35, "2": 65, "4": 110, "8": 237, "16": 305}}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specdec.errors import InvalidRequestError
from specdec.metrics import MS_PER_S

PROFILE_ENV = "SPECDEC_COST_PROFILE"


class CostProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t_draft_ms: float = Field(ge=0.0, description="one drafting step (one token through the draft)")
    t_target_ms: dict[int, float] = Field(min_length=1, description="one target pass, by tokens it feeds")
    source: str = ""  # where it was measured (free text)

    @field_validator("t_target_ms")
    @classmethod
    def _curve(cls, curve: dict[int, float]) -> dict[int, float]:
        if any(k < 1 for k in curve) or any(not (math.isfinite(t) and t > 0) for t in curve.values()):
            raise ValueError("t_target_ms maps token counts >= 1 to positive times")
        return dict(sorted(curve.items()))

    def pass_ms(self, tokens: float) -> float:
        """Time of one target pass over `tokens` tokens (interpolated; module docstring)."""
        points = list(self.t_target_ms.items())
        if len(points) == 1:
            return points[0][1]
        for (k0, t0), (k1, t1) in zip(points, points[1:]):
            if tokens <= k1:
                break  # else the loop ends on the last segment: extrapolated
        return t0 + (t1 - t0) * (tokens - k0) / (k1 - k0)

    def t_target(self, candidates: int) -> float:
        """ms of the verification pass over `candidates` candidates (k + 1 tokens)."""
        return self.pass_ms(candidates + 1)

    def round_ms(self, candidates: int, draft_steps: int | None = None) -> float:
        """T(k) = k * t_draft + t_target(k); `draft_steps` when they differ from k (a dropped candidate)."""
        steps = candidates if draft_steps is None else draft_steps
        return steps * self.t_draft_ms + self.t_target(candidates)

    def can_pay(self, max_candidates: int) -> bool:
        """False when no round of 1..max_candidates candidates beats plain decoding even if every
        candidate were accepted: (k + 1) / T(k) <= 1 / T(0) for all k. Then drafting never pays."""
        plain = 1.0 / self.round_ms(0)
        return any((k + 1) / self.round_ms(k) > plain for k in range(1, max_candidates + 1))

    @classmethod
    def from_forward_times(cls, forward_times: dict, source: str = "") -> CostProfile:
        """From `specdec bench`'s `forward_times` ({"draft_s": {k: s}, "target_s": {k: s}}): t_draft is
        the draft's one-token pass."""
        draft = {int(k): float(v) for k, v in forward_times["draft_s"].items()}
        return cls(t_draft_ms=draft[min(draft)] * MS_PER_S, source=source,
                   t_target_ms={int(k): float(v) * MS_PER_S for k, v in forward_times["target_s"].items()})

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """A profile JSON, or a bench results.json / notes.json (its `cost_profile`, else `forward_times`)."""
        path = Path(path).expanduser()
        try:
            raw = json.loads(path.read_text())
            if isinstance(raw, dict) and raw.get("cost_profile"):
                return cls.model_validate(raw["cost_profile"])
            if isinstance(raw, dict) and "forward_times" in raw:
                return cls.from_forward_times(raw["forward_times"], source=str(path))
            return cls.model_validate(raw)
        except OSError as exc:
            raise InvalidRequestError(f"cannot read cost profile {path}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"bad cost profile {path}: {message}") from None


# The default pair on the torch runtime (int8 draft, fp32 target), costs measured in the loop itself
# (`specdec/bench/costmodel.py`, `fit_round_costs`) over the shipped head's validation bench runs
# (docs/results/head3-validation/C-stdlib and C-prose, 96 generations, 2-core Intel Xeon): a drafting
# step 56 ms (a bare draft pass is 33 ms: sampling, features and the head add the rest), a verification
# pass over k candidates 397 + 23.1 k ms. The bare passes of `forward_times` grow half as fast.
DEFAULT_PROFILE = CostProfile(t_draft_ms=56.0, t_target_ms={1: 396.77, 21: 859.36},
                              source="default pair, torch runtime, in-loop fit on validation runs, 2-core Intel Xeon")


# The default pair on llama.cpp's kernels (models/llamacpp.py), same CPU: `python benchmarks/forward_times.py
# --formats llamacpp` (docs/performance.md); t_draft adds ~1 ms for sampling and the policy.
LLAMACPP_PROFILE = CostProfile(t_draft_ms=35.0, t_target_ms={1: 68.0, 2: 100.0, 3: 123.0, 4: 108.0, 5: 141.0, 6: 161.0,
                                                             8: 194.0, 12: 245.0, 16: 238.0},
                               source="default pair, llama.cpp Q4_K_M, 2-core Intel Xeon (docs/performance.md)")
DEFAULT_PROFILES = {"torch": DEFAULT_PROFILE, "llamacpp": LLAMACPP_PROFILE}


def resolve_profile(head_profile: CostProfile | None, runtime: str = "torch") -> CostProfile:
    """The environment's file, else the head's profile, else the runtime's default (module docstring)."""
    path = os.environ.get(PROFILE_ENV)
    if path:
        return _load_cached(path, _mtime(path))
    return head_profile if head_profile is not None else DEFAULT_PROFILES.get(runtime, DEFAULT_PROFILE)


_CACHE: dict[tuple[str, float], CostProfile] = {}


def _mtime(path: str) -> float:
    try:
        return Path(path).expanduser().stat().st_mtime
    except OSError:
        return -1.0


def _load_cached(path: str, mtime: float) -> CostProfile:
    """Every session makes its policy: read the file once per version, not once per session."""
    key = (path, mtime)
    if key not in _CACHE:
        _CACHE[key] = CostProfile.load(path)
    return _CACHE[key]
