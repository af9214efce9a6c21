"""Several coordinators calling one verifier replica: their Verify calls share its passes.

    python -m benchmarks.shared_passes [--loops 4] [--sessions 4] [--runs 5] [--new-tokens 80]
                                       [--vocab 151936] [--out docs/results/transport/NAME.json]

`--loops` round loops (each a coordinator: a RoundLoop with a gRPC transport of its own) decode `--sessions` sessions each, all at once, on one draft and one verifier replica
(benchmarks/transport.py `replicas`: a process each, the models on one torch thread each). Tiny
random weights with the default pair's vocabulary, the target drafting for itself (fixed K = 4:
every candidate accepted). Runs alternate between the verifier as served (services/servicers.py
`VerifyBatcher`: the calls that wait for its torch thread together run as one pass) and each call
alone. Reported per mode: tokens a second over all loops, and the verifier's passes per Verify call,
median (min-max) over the runs. A GPU's pass costs about the same for 1 session as for 64, so
there a pass saved is a pass's time; on a CPU a pass costs more the more tokens it feeds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

from benchmarks.models import VOCAB
from benchmarks.transport import K, PROMPT_TOKENS, SHARE_PASSES, replicas, tiny_pair
from services.transports import GrpcTransport
from specdec.bench.forward import synthetic_tokens
from specdec.loop import BatchConfig, RoundLoop
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import SamplingParams
from specdec.sequences import RequestRules


def run_loops(addresses: dict, rules: RequestRules, loops: int, sessions: int, new_tokens: int, seed: int) -> float:
    """Every loop's sessions decoded at once; the wall seconds it took. The loops share this
    process's event loop (grpc.aio serves one), each with a transport and channels of its own."""
    params = GenerationParams(max_new_tokens=new_tokens, chat_template=False, policy=PolicyConfig(name="fixed", k=K),
                              sampling=SamplingParams(temperature=0.0, seed=0))

    async def coordinator(i: int) -> None:
        transport = GrpcTransport(addresses["draft"], addresses["verifier"])
        loop = RoundLoop(transport, rules, BatchConfig(max_sessions_per_step=sessions, overlap="off"))
        prompts = [synthetic_tokens(PROMPT_TOKENS, rules.vocab_size, offset=97 * (i * sessions + j) + seed)
                   for j in range(sessions)]
        try:
            await asyncio.gather(*(loop.generate(p, params) for p in prompts))
        finally:
            await transport.close()

    async def all_loops():
        await asyncio.gather(*(coordinator(i) for i in range(loops)))

    start = time.perf_counter()
    asyncio.run(all_loops())
    return time.perf_counter() - start


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=4, help="coordinators calling the verifier")
    parser.add_argument("--sessions", type=int, default=4, help="sessions each decodes at once")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per mode (after one warm-up each)")
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each replica (1: one core each; more, and on 2 cores their OpenMP "
                             "teams spin on each other's cores)")
    parser.add_argument("--pad", type=int, default=0,
                        help="layers added to the target that change nothing but its cost (models.py `padded`)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    pair = dataclasses.replace(tiny_pair(args.vocab), pad=args.pad)
    from specdec.engine import SpecDecEngine

    rules = SpecDecEngine(*pair.runtimes()).rules
    tokens = args.loops * args.sessions * args.new_tokens
    modes = {"shared": "1", "alone": "0"}
    figures = {mode: {"tokens_per_s": [], "passes_per_call": []} for mode in modes}
    with replicas(pair, args.threads, {SHARE_PASSES: "1"}) as (shared, shared_pipes), \
            replicas(pair, args.threads, {SHARE_PASSES: "0"}) as (alone, alone_pipes):
        served = {"shared": (shared, shared_pipes[1]), "alone": (alone, alone_pipes[1])}
        for run in range(args.runs + 1):  # the first warms up both
            for mode in (modes if run % 2 == 0 else reversed(list(modes))):  # alternate who goes first
                addresses, verifier = served[mode]
                verifier.send("batcher")
                before = verifier.recv()
                seconds = run_loops(addresses, rules, args.loops, args.sessions, args.new_tokens, run)
                verifier.send("batcher")
                after = verifier.recv()
                if run == 0:
                    continue
                figures[mode]["tokens_per_s"].append(tokens / seconds)
                figures[mode]["passes_per_call"].append((after["passes"] - before["passes"]) /
                                                        max(1, after["calls"] - before["calls"]))
                print(f"run {run} {mode:>6}: {tokens / seconds:8.1f} tok/s, "
                      f"{figures[mode]['passes_per_call'][-1]:.2f} passes a Verify call", flush=True)
    result = {"settings": vars(args) | {"out": str(args.out) if args.out else None},
              **{mode: {name: spread(values) for name, values in f.items()} for mode, f in figures.items()}}
    for mode in modes:
        row = result[mode]
        print(f"{mode:>6}: {row['tokens_per_s']['median']:.1f} tok/s ({row['tokens_per_s']['min']:.1f}-"
              f"{row['tokens_per_s']['max']:.1f}), {row['passes_per_call']['median']:.2f} passes a Verify call")
    ratio = result["shared"]["tokens_per_s"]["median"] / result["alone"]["tokens_per_s"]["median"]
    print(f"shared / alone: {ratio:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result | {"shared_over_alone": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
