"""How unevenly Serve's consistent-hash ring spreads sessions over a deployment's replicas.

    python -m benchmarks.ring_spread [--held 64] [--replicas 2 4 8] [--draws 200]

A served loop keeps at most what the replicas holding its sessions hold (services/config.py LiveCap),
and a session's replica is the one its id leads to on the router's ring (Serve's ConsistentHashRouter,
its own hash, 100 virtual nodes a replica, each replica a random id). Each draw builds a ring and
places random session ids; it prints, per replica count, how often the busiest replica gets more
than `--held` sessions, and its median and largest load, with the replicas filled to `--held` on
average and to RING_FILL of it. docs/operations.md ("Scale") reports it.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import uuid

from ray.serve.experimental.consistent_hash_router import DEFAULT_NUM_VIRTUAL_NODES, _hash_bytes

from services.config import RING_FILL


def busiest(replicas: int, sessions: int) -> int:
    """The most sessions one replica gets, of `sessions` placed on a new ring of `replicas`."""
    ring = sorted((_hash_bytes(f"{uuid.uuid4().hex[:8]}:{i}".encode()), r)
                  for r in range(replicas) for i in range(DEFAULT_NUM_VIRTUAL_NODES))
    hashes, load = [h for h, _ in ring], [0] * replicas
    for _ in range(sessions):
        at = bisect.bisect_right(hashes, _hash_bytes(uuid.uuid4().hex.encode())) % len(ring)
        load[ring[at][1]] += 1
    return max(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=64, help="sessions one replica holds (the static cache's rows)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    print(f"{'replicas':>8} {'fill':>5} {'P(busiest > held)':>18} {'median busiest':>15} {'most':>5}")
    for replicas in args.replicas:
        for fill in (1.0, RING_FILL):
            loads = [busiest(replicas, int(args.held * replicas * fill)) for _ in range(args.draws)]
            over = sum(load > args.held for load in loads) / args.draws
            print(f"{replicas:>8} {float(fill):>5.2f} {over:>18.3f} {statistics.median(loads):>15.0f} {max(loads):>5}")


if __name__ == "__main__":
    main()
