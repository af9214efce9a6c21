"""The by-round ratios of the concurrency JSONs made before the fix of 2026-12-02 (benchmarks/concurrency.py
`Run.merge`): each row's first round was the first two rounds' tokens over their walls together; it is
recovered here from that and the second round's figure (every round of a row ran the same tokens).
For the files made before the fix only (every JSON under docs/results/planner/ up to
recheck-2026-12-02b/llamacpp-rounds5.json).

    python docs/results/planner/first-round-correction.py docs/results/planner/*.json docs/results/planner/*/*.json
"""

import json
import statistics
import sys


def rounds_of(path: str) -> dict[tuple[str, int], list[float]]:
    data = json.load(open(path))
    per_run = data["rows"][0]["tokens"] / data["args"]["rounds"]
    fixed = {}
    for row in data["rows"]:
        merged, second = row["per_round_tokens_per_s"][:2]
        second_wall = per_run / second
        first_wall = 2 * per_run / merged - second_wall
        fixed[(row["policy"], row["concurrency"])] = [per_run / first_wall] + row["per_round_tokens_per_s"][1:]
    return fixed


for path in sys.argv[1:]:
    data = json.load(open(path))
    if data.get("args", {}).get("rounds", 1) < 2 or "rows" not in data:
        continue
    fixed = rounds_of(path)
    for (policy, level), tps in fixed.items():
        if policy != "target-only":
            ratios = [a / b for a, b in zip(tps, fixed[("target-only", level)])]
            print(f"{path}: {policy} C = {level}: {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)")
