"""Policies side by side on HumanEval prompts, in one process, on one engine.

    python -m benchmarks.policies --limit 10 --max-new-tokens 128 \
        --policies target-only fixed:4 fixed:8 svip confidence --out results.json

Prints a markdown table (tokens/s over all prompts, verification and discard rates, acceptance,
mean accepted length, speedup over target-only) and checks, for greedy runs, that every policy's
tokens equal target-only's. `name:value` sets --k for fixed/heuristic and --threshold otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from specdec.builder import EngineConfig, build_engine
from specdec.params import build_params
from specdec.metrics import RequestStats
from specdec.prompts import humaneval_prompts

K_POLICIES = ("fixed", "heuristic")


def policy_flags(spec: str) -> dict:
    name, _, value = spec.partition(":")
    if not value:
        return {"policy": name}
    return {"policy": name, "k": int(value)} if name in K_POLICIES else {"policy": name, "threshold": float(value)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="default")
    parser.add_argument("--target", default="default")
    parser.add_argument("--head", default=None)
    parser.add_argument("--draft-format", default="auto")
    parser.add_argument("--target-format", default="auto")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--policies", nargs="+", default=["target-only", "fixed:4", "fixed:8", "svip", "confidence"])
    parser.add_argument("--out", default=None, help="JSON file with every per-prompt record")
    args = parser.parse_args()

    engine = build_engine(EngineConfig(draft=args.draft, target=args.target, head=args.head,
                                       draft_format=args.draft_format, target_format=args.target_format))
    prompts = humaneval_prompts(args.limit)
    engine.generate(prompts[0], build_params(policy="fixed", k=2, max_new_tokens=4))  # warm-up

    records, totals, outputs = [], {}, {}
    for spec in args.policies:
        total = RequestStats()
        for i, prompt in enumerate(prompts):
            params = build_params(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i,
                                  **policy_flags(spec))
            result = engine.generate(prompt, params)
            total.merge(result.stats)
            outputs[(spec, i)] = result.completions[0].token_ids
            records.append({"policy": spec, "prompt": i, **result.to_dict()})
            print(f"{spec:>14} prompt {i:3d}: {result.stats.summary()}", file=sys.stderr, flush=True)
        totals[spec] = total

    mismatches = []
    if args.temperature == 0 and "target-only" in args.policies:
        mismatches = [(spec, i) for (spec, i), ids in outputs.items() if ids != outputs[("target-only", i)]]
    print(table(totals, args, mismatches))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                       "totals": {k: v.to_dict() for k, v in totals.items()}, "records": records,
                       "greedy_mismatches": mismatches}, f, indent=1)
    return 1 if mismatches else 0


def table(totals: dict[str, RequestStats], args, mismatches) -> str:
    base = totals.get("target-only")
    lines = [f"{args.limit} HumanEval prompts, {args.max_new_tokens} new tokens, temperature {args.temperature}; "
             f"{machine()}",
             "",
             "| policy | tokens/s | speedup | verification rate | discard rate | acceptance | mean accepted length |",
             "|---|---|---|---|---|---|---|"]
    for spec, s in totals.items():
        speedup = f"{s.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        lines.append(f"| {spec} | {s.tokens_per_s:.2f} | {speedup} | {s.verification_rate:.3f} | "
                     f"{s.discard_rate:.3f} | {s.acceptance_rate:.1%} | {s.mean_accepted_length:.2f} |")
    if args.temperature == 0 and base:
        lines.append("")
        lines.append("greedy outputs equal target-only: " + ("yes, all" if not mismatches else f"NO: {mismatches}"))
    return "\n".join(lines)


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
