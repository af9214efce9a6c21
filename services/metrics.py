"""Serving metrics, exported by Ray's metrics agent in Prometheus format (Ray prefixes `ray_`).

Named after vLLM's speculative-decoding counters (`vllm:spec_decode_num_drafts`, ...): drafts,
draft tokens, accepted tokens, accepted tokens per position. Ours next to them: target passes,
generated and discarded tokens (verification rate = target passes / generated tokens, discard
rate = discarded / generated, as PromQL ratios of counters), K per round, the time a round
call spends in the draft, the target and transport, and the live cost profile the verification
budget plans with (specdec/budget.py): a drafting step by sessions, a target pass by tokens, and
whether drafting pays at all.
"""

from __future__ import annotations

import httpx
import ray
from ray.serve import metrics

from specdec.cost_profile import CostProfile, bucket
from specdec.metrics import RequestStats

PREFIX = "specdec_"  # no colon: Ray exports through OpenTelemetry, whose instrument names refuse one
# Accepted positions past this share one label value ("17+"): a request's k or rounds must not grow
# the series without bound.
MAX_POSITION_LABEL = 16
MS_BUCKETS = [0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500]
K_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 24.5, 32.5]  # K + 0.5: bucket edges between integers


class RayRoundMetrics:
    """The coordinator's RoundObserver."""

    def __init__(self):
        def counter(name: str, description: str, tags: tuple[str, ...] = ("policy",)):
            return metrics.Counter(PREFIX + name, description=description, tag_keys=tags)

        self.drafts = counter("spec_decode_num_drafts", "Rounds that verified candidates (vLLM's num_drafts)")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Candidates sent to verification")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Candidates the target accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted candidates by position (1-based)", ("policy", "position"))
        self.target_passes = counter("target_forward_passes", "Target verification passes (N_target)")
        self.generated_tokens = counter("generated_tokens", "Tokens generated (N)")
        self.discarded_tokens = counter("discarded_tokens", "Candidates rejected (N_discarded)")
        self.requests = counter("requests", "Finished requests", ("policy", "outcome"))
        self.held_rounds = counter("draft_held_rounds", "Rounds whose policy drafts that the step planner kept off "
                                   "the draft, by reason (no_round_pays: no round pays at the costs measured here; "
                                   "catch_up, resting, not_measured)", ("policy", "reason"))
        self.k_per_round = metrics.Histogram(PREFIX + "candidates_per_round", description="K per round",
                                             boundaries=K_BUCKETS, tag_keys=("policy",))
        self.call_ms = metrics.Histogram(PREFIX + "round_call_ms", description="Round call time by part (ms)",
                                         boundaries=MS_BUCKETS, tag_keys=("role", "part"))
        self.call_bytes = metrics.Counter(PREFIX + "round_call_bytes", description="Round request + reply bytes",
                                          tag_keys=("role",))
        self.cost_ms = metrics.Gauge(PREFIX + "cost_profile_ms", description="Live cost profile: a drafting step by "
                                     "sessions, a target pass by tokens (ms; tokens: the timing bucket's)",
                                     tag_keys=("draft", "role", "tokens"))
        self.drafting = metrics.Gauge(PREFIX + "drafting_pays", description="1 while some allocation of candidates "
                                      "beats plain decoding at the measured costs, else 0 (the draft is off)",
                                      tag_keys=("draft",))
        self._profiles: dict[str, CostProfile] = {}

    def on_round(self, num_candidates: int, num_accepted: int, policy: str, held: str | None = None) -> None:
        tags = {"policy": policy}
        if held:
            self.held_rounds.inc(1, {"policy": policy, "reason": held})
        self.target_passes.inc(1, tags)
        self.k_per_round.observe(num_candidates, tags)
        if num_candidates:  # Ray counters take only positive increments
            self.drafts.inc(1, tags)
            self.draft_tokens.inc(num_candidates, tags)
        if num_candidates > num_accepted:
            self.discarded_tokens.inc(num_candidates - num_accepted, tags)
        if num_accepted:
            self.accepted_tokens.inc(num_accepted, tags)
            for position in range(1, min(num_accepted, MAX_POSITION_LABEL) + 1):
                self.accepted_per_pos.inc(1, {"policy": policy, "position": str(position)})
            if num_accepted > MAX_POSITION_LABEL:
                self.accepted_per_pos.inc(num_accepted - MAX_POSITION_LABEL,
                                          {"policy": policy, "position": f"{MAX_POSITION_LABEL + 1}+"})

    def on_call(self, role: str, compute_ms: float, transport_ms: float, num_bytes: int) -> None:
        self.call_ms.observe(compute_ms, {"role": role, "part": "compute"})
        self.call_ms.observe(transport_ms, {"role": role, "part": "transport"})
        if num_bytes:
            self.call_bytes.inc(num_bytes, {"role": role})

    def on_costs(self, profile: CostProfile, drafting: bool, draft: str) -> None:
        self.drafting.set(1.0 if drafting else 0.0, {"draft": draft})
        if profile is self._profiles.get(draft):  # a snapshot is rebuilt only when a timing came in
            return
        self._profiles[draft] = profile
        for role, curve in (("draft", profile.t_draft_rows_ms or {1: profile.t_draft_ms}), ("verifier", profile.t_target_ms)):
            for tokens, ms in curve.items():  # (by bucket: a bucket's median tokens move as it is timed)
                self.cost_ms.set(ms, {"draft": draft, "role": role, "tokens": str(bucket(tokens))})

    def on_request(self, stats: RequestStats, policy: str, outcome: str) -> None:
        self.requests.inc(1, {"policy": policy, "outcome": outcome})
        if stats.generated_tokens:
            self.generated_tokens.inc(stats.generated_tokens, {"policy": policy})


async def prometheus_text() -> str:
    """This node's metrics, as Ray's metrics agent exports them (every actor on the node)."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(url)
        response.raise_for_status()
        return response.text
