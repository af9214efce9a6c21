"""Draft and Verifier replicas autoscale on their round calls, whichever transport carries them.

Serve's default rule scales a deployment to (its ongoing requests) / target_ongoing_requests,
counting the requests that pass through Serve. With `round_transport: direct` the coordinator calls
each replica's own gRPC server (docs/serving.md, "Round transport"), and Serve sees only a session's
first call, the address lookup. So each replica records the round calls it is serving (Serve's
custom metric, `record_autoscaling_stats` in services/replicas.py) and `round_calls_policy` applies
the default rule to the larger of the two counts: Serve's (the `serve-grpc` and `actor` transports
carry the same calls through it) and the replicas' own. Serve applies the config's bounds, delays
and scaling factors to the result as it does to its own rule's.

A step sends a replica one batched call per coordinator lane whatever its sessions, so the calls in
flight, averaged over the look-back window, are the share of the time its callers keep it busy
(at most the coordinators' lanes): a round deployment's target_ongoing_requests is such a share
(0.7 in the GPU configs), never a count of sessions.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

ROUND_CALLS = "round_calls"  # the custom metric: round calls a replica is serving, queued ones included
POLICY = f"{__name__}:round_calls_policy"


def round_calls_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    if ctx.current_num_replicas == 0:  # Serve's cold start: its wrapper scales up on a request first
        return ctx.target_num_replicas, {}
    recorded = sum(((ctx.aggregated_metrics or {}).get(ROUND_CALLS) or {}).values())
    return max(ctx.total_num_requests, recorded) / ctx.config.get_target_ongoing_requests(), {}
