"""Forward time of each role per weight format, with a warm KV cache.

    python benchmarks/forward_times.py --role draft --formats fp32 onednn int8 --ks 1 2 4 8 16
    python benchmarks/forward_times.py --role target --formats fp32 onednn --ks 1 2 4 8 16

Prints a markdown table of median milliseconds for one pass over k tokens after a ~200-token prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.builder import load_model
from specdec.models.runtime import CausalLMRuntime
from specdec.models.sources import resolve_model

PROMPT_TOKENS = 200


def time_pass(runtime: CausalLMRuntime, k: int, repeats: int) -> float:
    session = runtime.new_session()
    prompt = [(i * 7919) % 30000 + 100 for i in range(PROMPT_TOKENS)]
    runtime._forward(session, prompt, num_outputs=1)
    times = []
    for r in range(repeats + 1):
        tokens = [(r * 31 + j) % 30000 + 100 for j in range(k)]
        start = time.perf_counter()
        runtime._forward(session, tokens, num_outputs=k)
        times.append(time.perf_counter() - start)
        runtime.rollback(session, PROMPT_TOKENS)
    return statistics.median(times[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["draft", "target"], required=True)
    parser.add_argument("--source", default="default")
    parser.add_argument("--formats", nargs="+", default=["fp32", "onednn"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    model_dir = resolve_model(args.source, role=args.role)
    print(f"{args.role} {model_dir.name}, {torch.get_num_threads()} threads, median ms per pass")
    print("| format | " + " | ".join(f"k={k}" for k in args.ks) + " |")
    print("|---" * (len(args.ks) + 1) + "|")
    for fmt in args.formats:
        runtime = CausalLMRuntime(load_model(model_dir, args.role, fmt, progress=False))
        row = [f"{time_pass(runtime, k, args.repeats):.0f}" for k in args.ks]
        print(f"| {fmt} | " + " | ".join(row) + " |", flush=True)
        del runtime


if __name__ == "__main__":
    main()
