"""Projected speedups on a GPU: the pass costs the GPU benchmark measured (bench.py, captured) with the
acceptance the default pair measured on real text (a `specdec bench` run's records), by the paper's
round cost model:

    speedup(K) = E(K) t_target(C, 1) / (K t_draft(C, 1) + t_target(C, K + 1)),   E(K) = 1 + sum_{j<=K} S_j

where S_j is the share of rounds whose first j candidates were all accepted (from a fixed-K run of
at least K), C the sessions sharing every pass, t(C, k) the median captured pass of C sessions
feeding k tokens each (linear in k between measured points). `best K` is the K the cost-aware rule
would settle on with this acceptance; the adaptive rule can beat it (it chooses K per round).
`+host` adds the host time per pass that the loop measured (bench.py's loop section, eager
runtime; today's per-session host work, which issue 33 vectorizes) to both sides.

    python -m benchmarks.gpu.project docs/results/gpu/2026-11-27-h100
    python -m benchmarks.gpu.project DIR --records docs/results/bench-humaneval/records.jsonl --spec fixed:14

Caveats, printed with the table: the acceptance is the 0.5B draft's against the 1.5B target (the
7B rows reuse it; a 7B target of the family agrees with the 0.5B draft less often), and the costs are
random-weight passes with a 200-token context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.budget import expected_tokens

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench-humaneval" / "records.jsonl"
DRAFT = "qwen2.5-0.5b"
TARGETS = ("qwen2.5-1.5b", "qwen2.5-7b")


def survival(records: Path, spec: str, temperature: float) -> list[float]:
    """[S_1, S_2, ...]: rounds accepting positions 1..j over rounds that drafted position j."""
    drafted, accepted = [], []
    for line in records.open():
        record = json.loads(line)
        if record["spec"] != spec or record["temperature"] != temperature:
            continue
        stats = record["stats"]
        for j, count in enumerate(stats["drafted_per_position"]):
            if j == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[j] += count
            accepted[j] += stats["accepted_per_position"][j] if j < len(stats["accepted_per_position"]) else 0
    return [a / d for a, d in zip(accepted, drafted) if d]


def pass_curve(passes: dict, batch: int, mode: str) -> dict[int, float]:
    """{k: ms} for one batch size from bench.py's passes rows."""
    curve = {}
    for key, row in passes.items():
        b, k = (int(part.split("=")[1]) for part in key.split(","))
        if b == batch and f"{mode}_ms" in row:
            curve[k] = row[f"{mode}_ms"]
    return curve


def interpolate(curve: dict[int, float], k: int) -> float | None:
    if k in curve:
        return curve[k]
    below, above = [x for x in curve if x < k], [x for x in curve if x > k]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo)


def speedup(accept: list[float], k: int, t_draft: float, target: dict[int, float], host_plain: float = 0.0,
            host_round: float = 0.0) -> float | None:
    """E(k) plain steps (each plus `host_plain` ms) over one round (plus `host_round` ms)."""
    verify = interpolate(target, k + 1)
    if verify is None or k > len(accept):
        return None
    tokens = expected_tokens(accept[:k])
    return tokens * (target[1] + host_plain) / (k * t_draft + verify + host_round)


def host_per_pass(loop: dict, policy: str, concurrency: int) -> float | None:
    """Host ms per verification pass the loop measured at the nearest concurrency."""
    rows = {row["concurrency"]: row for key, row in loop.items()
            if isinstance(row, dict) and key.startswith(policy + "@") and "host_ms_per_target_pass" in row}
    if not rows:
        return None
    nearest = min(rows, key=lambda c: abs(c - concurrency))
    return rows[nearest]["host_ms_per_target_pass"]


def load_results(folder: Path) -> tuple[dict, dict]:
    """(passes by shape, loop rows) from every bench.py JSON in `folder`, in name order: a later run
    fills the pass rows an earlier one lacks, and its loop rows replace the earlier ones."""
    passes, loop = {}, {}
    for path in sorted(folder.glob("*.json")):
        sections = json.loads(path.read_text()).get("sections", {})
        for name, rows in sections.get("passes", {}).items():
            mine = passes.setdefault(name, {})
            for key, row in rows.items():
                if "captured_ms" not in mine.get(key, {}):
                    mine[key] = row
        loop = sections.get("loop", {}).get("qwen2.5-1.5b", loop)
    return passes, loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a folder of bench.py results (*.json)")
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--spec", default="fixed:14", help="the run whose rounds give the acceptance")
    parser.add_argument("--mode", default="captured", choices=("captured", "static", "runtime", "runtime_static"),
                        help="which pass costs (bench.py's passes section): the static cache's pass captured or "
                             "eager, the runtime on its slot cache, or on its static cache (default pair only)")
    args = parser.parse_args()
    passes, loop = load_results(args.results)
    batches = sorted({int(key.split(",")[0].split("=")[1]) for key in passes[DRAFT]})
    print(f"acceptance: {args.records.relative_to(args.records.parents[2])} {args.spec}; costs: {args.mode} passes\n")
    print("| target | T | C | draft ms | target ms k=1 | K=1 | K=3 | K=7 | best K | speedup | +host |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for temperature in (0.0, 1.0):
        accept = survival(args.records, args.spec, temperature)
        for name in TARGETS:
            for batch in batches:
                draft = pass_curve(passes[DRAFT], batch, args.mode).get(1)
                target = pass_curve(passes[name], batch, args.mode)
                if draft is None or 1 not in target:
                    continue
                by_k = {k: speedup(accept, k, draft, target) for k in range(1, len(accept) + 1)}
                by_k = {k: s for k, s in by_k.items() if s is not None}
                best = max(by_k, key=by_k.get)
                host_plain, host_spec = host_per_pass(loop, "target-only", batch), host_per_pass(loop, "fixed", batch)
                with_host = "-"
                if host_plain is not None and host_spec is not None:
                    with_host = f"{speedup(accept, best, draft, target, host_plain, host_spec):.2f}x"
                cells = [f"{by_k[k]:.2f}x" if k in by_k else "-" for k in (1, 3, 7)]
                print(f"| {name} | {temperature:g} | {batch} | {draft:.2f} | {target[1]:.2f} | " + " | ".join(cells)
                      + f" | {best} | {by_k[best]:.2f}x | {with_host} |")
    print("\nS_j (greedy):", ", ".join(f"{s:.3f}" for s in survival(args.records, args.spec, 0.0)))


if __name__ == "__main__":
    main()
