"""`specdec generate` on the torch and the llama.cpp runtimes, one fresh process per generation, as a
user runs it: tokens/s (decoding, from the run's own stats) and the process's peak resident memory.

    python -m benchmarks.runtimes --limit 3 --out docs/results/runtimes.json

Each prompt runs once per (runtime, policy) in an interleaved order (prompt by prompt), so slow
drifts of the machine spread over all configurations alike. Prints a table; --out keeps the records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = (  # (runtime, policy or None for the default)
    ("torch", None),
    ("llamacpp", None),
    ("llamacpp", "target-only"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from specdec.bench.prompt_sets import load_prompts
    from specdec.bench.runner import cpu_name

    prompts = load_prompts(args.prompts)[: args.limit]
    records = []
    for i, prompt in enumerate(prompts):
        for runtime, policy in CONFIGS:
            record = measure(prompt, runtime, policy, args.max_new_tokens, args.temperature)
            record["prompt"] = i
            records.append(record)
            print(f"prompt {i} {runtime:8s} {record['policy']:12s} {record['tokens_per_s']:6.2f} tok/s  "
                  f"peak RSS {record['peak_rss_gib']:.2f} GiB", flush=True)
    print_table(records)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"records": records, "date": time.strftime("%Y-%m-%d"),
                                        "cpu": cpu_name()}, indent=1) + "\n")


def measure(prompt: str, runtime: str, policy: str | None, max_new_tokens: int, temperature: float) -> dict:
    """One generation in a fresh process: its stats and its peak resident memory (wait4's rusage)."""
    cmd = [sys.executable, "-m", "specdec.cli", "generate", prompt, "--json", "--runtime", runtime,
           "--max-new-tokens", str(max_new_tokens), "--temperature", str(temperature), "--seed", "0"]
    if policy:
        cmd += ["--policy", policy]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read()[-2000:]}")
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    return {"runtime": runtime, "policy": policy or "default", "tokens_per_s": stats["tokens_per_s"],
            "generated_tokens": stats["generated_tokens"], "wall_s": stats["wall_time_s"],
            "process_s": time.perf_counter() - start, "peak_rss_gib": usage.ru_maxrss / 2**20, "stats": stats}


def print_table(records: list[dict]) -> None:
    base = statistics.mean(r["tokens_per_s"] for r in records if r["runtime"] == "torch")
    print("\n| runtime | policy | tok/s (mean) | vs torch | peak RSS (max) |\n|---|---|---|---|---|")
    for runtime, policy in CONFIGS:
        rows = [r for r in records if r["runtime"] == runtime and r["policy"] == (policy or "default")]
        mean = statistics.mean(r["tokens_per_s"] for r in rows)
        print(f"| {runtime} | {policy or 'default'} | {mean:.2f} | {mean / base:.2f}x | "
              f"{max(r['peak_rss_gib'] for r in rows):.2f} GiB |")


if __name__ == "__main__":
    main()
