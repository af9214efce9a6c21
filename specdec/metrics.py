"""Per-request metrics: the paper's (verification rate, discard rate) and what vLLM users expect
(acceptance rate and acceptance by position, mean accepted length, K per round, time split).

Cost model (paper eq. 2.1-2.3): T_total = t_draft * N_draft + t_target * N_target, and
latency / token = t_draft + t_draft * N_discarded / N + (t_target - t_draft) * N_target / N.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MS_PER_S = 1000.0

# Why the step planner (planner.py) kept a session whose policy drafts off the draft for a round.
NOT_MEASURED = "not_measured"  # nothing timed on this machine yet: an off-probe measures it first
NO_ROUND_PAYS = "no_round_pays"  # no round beats plain decoding at the costs measured here
CATCH_UP = "catch_up"  # its draft lags and catching it up would not repay
RESTING = "resting"  # its last drafting rounds verified nothing (budget.rest_after)
HELD = {NOT_MEASURED: "no costs measured here yet", NO_ROUND_PAYS: "no round pays at the costs measured here",
        CATCH_UP: "catching the draft up would not repay", RESTING: "resting after rounds that verified nothing"}


@dataclass
class RequestStats:
    generated_tokens: int = 0  # N
    draft_forward_passes: int = 0  # N_draft
    target_forward_passes: int = 0  # N_target
    rounds: int = 0
    draft_tokens: int = 0  # candidates sent to verification
    accepted_tokens: int = 0  # candidates the target accepted
    discarded_tokens: int = 0  # N_discarded: candidates rejected
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: rounds with a candidate at position j+1
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rounds accepting position j+1
    k_histogram: Counter[int] = field(default_factory=Counter)  # K -> rounds
    # Rounds in which the session's policy drafts but the step planner kept it off the draft, by why
    # (HELD).
    held: Counter[str] = field(default_factory=Counter)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    # Served only (0 in process): round-trip time of the round calls minus the replicas' compute,
    # and the serialized bytes of every round request and reply.
    transport_time_s: float = 0.0
    transport_bytes: int = 0
    # Rounds drafted ahead while the round before verified (loop.py), and those used: the others'
    # draft passes count in draft_forward_passes, spent for nothing.
    rounds_ahead: int = 0
    rounds_ahead_used: int = 0

    def record_round(self, num_candidates: int, num_accepted: int, held: str | None = None) -> None:
        """A verified round; `held`: why the session did not call the draft for it, if it did not."""
        self.rounds += 1
        if held:
            self.held[held] += 1
        self.target_forward_passes += 1
        self.draft_tokens += num_candidates
        self.accepted_tokens += num_accepted
        self.discarded_tokens += num_candidates - num_accepted
        self.k_histogram[num_candidates] += 1
        if num_candidates:
            _add_prefix_counts(self.drafted_per_position, num_candidates)
            _add_prefix_counts(self.accepted_per_position, num_accepted, len(self.drafted_per_position))

    def merge(self, other: RequestStats) -> None:
        for name in ("generated_tokens", "draft_forward_passes", "target_forward_passes", "rounds",
                     "draft_tokens", "accepted_tokens", "discarded_tokens",
                     "draft_time_s", "target_time_s", "wall_time_s", "transport_time_s", "transport_bytes",
                     "rounds_ahead", "rounds_ahead_used"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, count in enumerate(theirs):
                mine[j] += count
        self.k_histogram.update(other.k_histogram)
        self.held.update(other.held)

    @property
    def verification_rate(self) -> float:
        return _ratio(self.target_forward_passes, self.generated_tokens)

    @property
    def discard_rate(self) -> float:
        return _ratio(self.discarded_tokens, self.generated_tokens)

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, counting the correction or bonus token."""
        return _ratio(self.accepted_tokens + self.rounds, self.rounds)

    @property
    def acceptance_by_position(self) -> list[float]:
        accepted = self.accepted_per_position
        return [_ratio(accepted[j] if j < len(accepted) else 0, d) for j, d in enumerate(self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.generated_tokens, self.wall_time_s)

    def to_dict(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "draft_forward_passes": self.draft_forward_passes,
            "target_forward_passes": self.target_forward_passes,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "discarded_tokens": self.discarded_tokens,
            "verification_rate": self.verification_rate,
            "discard_rate": self.discard_rate,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "k_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
            "draft_held": dict(sorted(self.held.items())),
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.tokens_per_s,
            "transport_time_s": self.transport_time_s,
            "transport_bytes": self.transport_bytes,
            "rounds_ahead": self.rounds_ahead,
            "rounds_ahead_used": self.rounds_ahead_used,
        }

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.wall_time_s:.1f}s ({self.tokens_per_s:.2f} tok/s) | "
                f"verification rate {self.verification_rate:.3f} | discard rate {self.discard_rate:.3f} | "
                f"acceptance {self.acceptance_rate:.1%} | mean accepted length {self.mean_accepted_length:.2f} | "
                f"draft {self.draft_time_s:.1f}s / target {self.target_time_s:.1f}s{self.held_summary()}")

    def held_summary(self) -> str:
        """Where the planner kept the draft off: ' | draft off in 120 of 128 rounds: no round pays at the
        costs measured here' (its most common reason), else ''."""
        if not self.held:
            return ""
        reason, _ = self.held.most_common(1)[0]
        return f" | draft off in {sum(self.held.values())} of {self.rounds} rounds: {HELD.get(reason, reason)}"


def aggregate_summary(stats: list[RequestStats], wall_time_s: float) -> str:
    """One line for requests that ran together: their tokens over the wall time they shared."""
    tokens = sum(s.generated_tokens for s in stats)
    return (f"{len(stats)} requests together: {tokens} tokens in {wall_time_s:.1f}s "
            f"({_ratio(tokens, wall_time_s):.2f} tok/s aggregate)")


def predicted_latency_per_token(t_draft: float, t_target: float, discard_rate: float,
                                verification_rate: float) -> float:
    """Paper eq. 2.3."""
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate


def _add_prefix_counts(counts: list[int], length: int, width: int = 0) -> None:
    """counts[j] += 1 for j < length; `counts` at least `width` long (a position drafted and never
    accepted counts 0, not nothing)."""
    counts.extend([0] * (max(length, width) - len(counts)))
    for j in range(length):
        counts[j] += 1


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
