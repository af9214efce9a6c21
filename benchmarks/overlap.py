"""Drafting the next round while the target verifies (BatchConfig.overlap), measured with the draft
and the verifier in two processes on this machine.

    python -m benchmarks.overlap [--k 1 3] [--replica-threads 1 2] [--runs 8] [--new-tokens 96]
                                 [--hidden 384] [--layers 2] [--pad 6] [--vocab 8192] [--out FILE.json]
    python -m benchmarks.overlap --default-pair --k 2 --replica-threads 2 --runs 4

The draft is a tiny random Qwen2; the target is the same model padded with layers that add nothing
(benchmarks/models.py `padded`): the two agree on every token, so every round is accepted and every
guess of the bonus token right, and the draft's step costs a share of the target's pass set by
`--pad`. Each runs in a replica process of its own (benchmarks/transport.py `replicas`: a gRPC
server handing each batch to one torch thread of `--replica-threads` threads). One session decodes
greedy at fixed K over our gRPC round services with overlap off, on and auto (the planner decides
from the costs and the factor it measures), runs interleaved; then in process with overlap auto.

With `--default-pair` the default pair itself (its runtime as `specdec generate` picks it: llama.cpp
here), drafting HumanEval prompts: acceptance as the pair has it, passes that use every core given.

Reported per K and thread count: ms per generated token in each mode (median over runs, 10th-90th
percentile), on/off and auto/off by pairs of runs, and the share of rounds that were drafted ahead. With
one thread a replica, the two processes have a core each: the draft is on a device of its own and
drafting ahead can pay. With two, each pass wants both cores and the other process's pass takes
them: the planner should find that it does not pay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.transport import Pair, replicas, spread
from benchmarks.models import tiny_model
from specdec.bench.forward import synthetic_tokens
from specdec.builder import EngineConfig, build_draft, build_engine, build_target
from specdec.engine import SpecDecEngine
from specdec.loop import BatchConfig, RoundLoop
from specdec.metrics import MS_PER_S
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.prompts import humaneval_prompts

PROMPT_TOKENS = 32
MODES = ("off", "on", "auto")


async def decode(loop: RoundLoop, prompt: list[int], params: GenerationParams) -> tuple[float, float]:
    """(ms per generated token, share of its rounds that were drafted ahead) of one request."""
    start = time.perf_counter()
    result = await loop.generate(prompt, params)
    stats = result.stats
    return (time.perf_counter() - start) * MS_PER_S / stats.generated_tokens, stats.rounds_ahead_used / stats.rounds


class DefaultPair:
    """The default pair as `specdec generate` builds it, `threads` a role (picklable: each replica's
    process builds its own)."""

    def __init__(self, threads: int | None = None):
        self.config = EngineConfig(threads=threads)

    def runtimes(self):
        return build_draft(self.config, progress=False)[0], build_target(self.config, progress=False)[0]

    def engine(self) -> SpecDecEngine:
        return build_engine(self.config, progress=False)


async def measure(pair, addresses: dict, k: int, runs: int, new_tokens: int, vocab: int) -> dict:
    from services.transports import GrpcTransport

    engine = pair.engine() if isinstance(pair, DefaultPair) else SpecDecEngine(*pair.runtimes())
    prompts = ([engine.encode_prompt(p) for p in humaneval_prompts(runs + 1)] if isinstance(pair, DefaultPair)
               else [synthetic_tokens(PROMPT_TOKENS, vocab, offset=31 * run) for run in range(runs + 1)])
    transport = GrpcTransport(addresses["draft"], addresses["verifier"])
    loops = {mode: RoundLoop(transport, engine.rules, BatchConfig(overlap=mode)) for mode in MODES}
    loops["in_process_auto"] = RoundLoop(engine.loop.calls.transport, engine.rules, BatchConfig(overlap="auto"))
    params = GenerationParams(max_new_tokens=new_tokens, chat_template=False, policy=PolicyConfig(name="fixed", k=k))
    per_token = {mode: [] for mode in loops}
    ahead = {mode: [] for mode in loops}
    try:
        for run in range(runs + 1):  # the first warms every loop up (and its planner measures)
            prompt = prompts[run]
            order = list(loops) if run % 2 == 0 else list(reversed(loops))
            for mode in order:
                ms, share = await decode(loops[mode], prompt, params)
                if run:
                    per_token[mode].append(ms)
                    ahead[mode].append(share)
    finally:
        await transport.close()
    row = {mode: spread(values) | {"ahead_share": statistics.median(ahead[mode])} for mode, values in per_token.items()}
    for mode in ("on", "auto"):
        row[f"{mode}/off"] = spread([a / b for a, b in zip(per_token[mode], per_token["off"])])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3], help="fixed K per round")
    parser.add_argument("--replica-threads", type=int, nargs="+", default=[1, 2], help="torch threads a replica")
    parser.add_argument("--runs", type=int, default=8, help="timed runs per mode (after one warm-up)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=2, help="the draft's layers")
    parser.add_argument("--pad", type=int, default=6, help="layers the target adds (they add nothing to its outputs)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--default-pair", action="store_true", help="the default pair on HumanEval prompts")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    results = {}
    for threads in args.replica_threads:
        torch.set_num_threads(threads)  # the in-process loop's too
        pair = DefaultPair(threads) if args.default_pair else Pair(tiny_model, (args.hidden, args.layers, 0, args.vocab),
                                                                   pad=args.pad)
        with replicas(pair, threads) as (addresses, _):
            for k in args.k:
                key = f"threads={threads},K={k}"
                results[key] = row = asyncio.run(measure(pair, addresses, k, args.runs, args.new_tokens, args.vocab))
                print(f"{key}: ms/token " + ", ".join(
                    f"{mode} {row[mode]['median']:.2f} [{row[mode]['p10']:.2f}, {row[mode]['p90']:.2f}]"
                    + f" (ahead {row[mode]['ahead_share']:.0%})"
                    for mode in (*MODES, "in_process_auto"))
                    + f"; on/off {row['on/off']['median']:.3f}, auto/off {row['auto/off']['median']:.3f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
