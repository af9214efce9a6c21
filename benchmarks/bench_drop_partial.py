#!/usr/bin/env python
# usage: python benchmarks/bench_drop_partial.py docs/results/bench-humaneval/records.jsonl
"""Drop the records of prompts that not every spec finished (the prompt in flight when the run was
stopped), so a resumed run on another machine redoes each prompt whole."""
import json, sys, collections
path = sys.argv[1]
lines = [l for l in open(path) if l.strip()]
recs = [json.loads(l) for l in lines]
count = collections.Counter((r["temperature"], r["prompt"]) for r in recs)
full = max(count.values())
partial = {k for k, n in count.items() if n < full and not (k[0] > 0 and n == full - 1)}
print("per-prompt counts max", full, "partial:", sorted(partial))
keep = [l for l, r in zip(lines, recs) if (r["temperature"], r["prompt"]) not in partial]
open(path, "w").writelines(keep)
print(f"kept {len(keep)} of {len(lines)}")
