"""Choose SpecDec++'s threshold h for a head on validation prompts (never HumanEval, the test set).

    python benchmarks/choose_threshold.py --head specdec/heads/default-pair --prompts 8 \
        --thresholds 0.1 0.3 0.5 0.7 0.9 --temperatures 0 1 --out docs/results/threshold-choice.json [--write]

Runs `specdec++` at every h on the first `--prompts` prompts of the stdlib validation split
(specdec/training/stdlib_prompts.py; the head was trained on the train split only), prints tokens/s,
verification and discard rates per h, and picks the h with the highest tokens/s over all prompts
and temperatures together (one h serves every request). `--write` records it in the head's
head.json as `threshold`, which `specdec++` uses when a request gives none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec.builder import EngineConfig, build_engine
from specdec.head import CONFIG_FILE
from specdec.metrics import RequestStats
from specdec.params import build_params
from specdec.training.stdlib_prompts import stdlib_prompts

VALIDATION_FRACTION = 0.05  # the split of cluster/training/default-pair.yaml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True)
    parser.add_argument("--draft", default="default")
    parser.add_argument("--target", default="default")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--write", action="store_true", help="record the chosen h in the head's head.json")
    args = parser.parse_args()

    prompts = [p for p in stdlib_prompts(VALIDATION_FRACTION) if p.split == "validation"][:args.prompts]
    engine = build_engine(EngineConfig(draft=args.draft, target=args.target, head=args.head))
    engine.generate(prompts[0].text, build_params(policy="fixed", k=2, max_new_tokens=4))  # warm-up

    totals: dict[float, RequestStats] = {h: RequestStats() for h in args.thresholds}
    rows, records = [], []
    for temperature in args.temperatures:
        for h in args.thresholds:
            total = RequestStats()
            for i, prompt in enumerate(prompts):
                params = build_params(policy="specdec++", threshold=h, max_new_tokens=args.max_new_tokens,
                                      temperature=temperature, seed=i)
                stats = engine.generate(prompt.text, params).stats
                total.merge(stats)
                records.append({"threshold": h, "temperature": temperature, "prompt_id": prompt.id,
                                **stats.to_dict()})
            totals[h].merge(total)
            rows.append((temperature, h, total))
            print(f"T={temperature:g} h={h:g}: {total.summary()}", file=sys.stderr, flush=True)

    best = max(args.thresholds, key=lambda h: totals[h].tokens_per_s)
    print(f"{len(prompts)} stdlib validation prompts, {args.max_new_tokens} new tokens\n")
    print("| temperature | h | tokens/s | verification rate | discard rate | mean accepted length |")
    print("|---|---|---|---|---|---|")
    for temperature, h, s in rows:
        print(f"| {temperature:g} | {h:g} | {s.tokens_per_s:.2f} | {s.verification_rate:.3f} | "
              f"{s.discard_rate:.3f} | {s.mean_accepted_length:.2f} |")
    print(f"\nchosen h = {best:g} ({totals[best].tokens_per_s:.2f} tok/s over all temperatures)")

    if args.out:
        Path(args.out).write_text(json.dumps(
            {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "prompt_ids": [p.id for p in prompts],
             "chosen_threshold": best, "records": records}, indent=1) + "\n")
    if args.write:
        path = Path(args.head) / CONFIG_FILE
        config = json.loads(path.read_text())
        config["threshold"] = best
        path.write_text(json.dumps(config, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
