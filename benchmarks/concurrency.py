"""Concurrent sessions: aggregate tokens/s, request latency and time to first token, in process and
served, at several concurrency levels (the batched engine core: specdec/loop.py).

    python -m benchmarks.concurrency                                   # default pair, the full table
    python -m benchmarks.concurrency --modes in-process --concurrency 1 4 --policies fixed:8
    python -m benchmarks.concurrency --tiny --requests-per-client 1    # tiny random models (smoke)
    python -m benchmarks.concurrency --runtime torch                   # the default pair on torch

C clients each send `--requests-per-client` greedy requests one after another (a closed loop: a
client's next request starts when its last one ends; more where `--min-requests` asks for more at a
small C), HumanEval prompts in turn, so C sessions share every step for most of the run. At each level
the policies run one after the other, so a drift of the machine's speed over the run spares their
ratios to target-only. Aggregate tokens/s is every request's tokens over the wall
time from the first request to the last answer. Latency: request to last token; time to first
token: request to the first committed token (the prefill and a first round). In process the
requests go to the engine's loop; served, through Serve's gRPC proxy as streams. The modes run one
after the other, never together (they would share the cores). `--baseline` adds the batch-1
reference runtime (one pass per session, the unbatched path) at concurrency 1.
Target-only (plain decoding) runs in every mode at every level even when `--policies` leaves it out,
and `vs target-only` divides each row's aggregate tokens/s by target-only's at the same mode and level.
Greedy outputs are compared across every mode and level: a prompt's tokens must not depend on what
shares its batch (any difference is counted and printed). In process each row also says where its
wall time went: the target's passes (how many, the tokens they fed, their time), the draft's, the
probes' scratch passes, and the rest (planning, committing, streaming): a policy that drafts nothing
runs the same passes as target-only, and its rest says what it pays beside them, a figure the
machine's drift between runs does not blur. Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specdec.bench.runner import cpu_name
from specdec.bench.specs import BASELINE, parse_specs, with_baseline
from specdec.builder import EngineConfig, build_engine
from specdec.calls import RoundTransport
from specdec.cost_profile import PassTiming
from specdec.loop import BatchConfig
from specdec.metrics import MS_PER_S
from specdec.params import DEFAULT_DRAFT, GenerationParams
from specdec.prompts import humaneval_prompts
from specdec.protocol import BatchReply, ProposeItem, ProposeReply, Role, StepPlan, VerifyItem, VerifyReply


@dataclass
class Run:
    mode: str
    policy: str
    concurrency: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    drafted: int = 0  # candidates verified (stats.draft_tokens), over every request
    accepted: int = 0
    rounds: int = 0
    rounds_ahead: int = 0  # rounds drafted while the round before verified (stats.rounds_ahead_used)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> greedy tokens
    # served: the coordinator's live profile after the run (its /metrics; what the next run starts with)
    live_profile: dict[str, float] = field(default_factory=dict)
    per_round: list[float] = field(default_factory=list)  # --rounds: each round's tok/s, in order
    passes: list[PassTiming] | None = None  # in process: the passes the workers timed during the run

    def __post_init__(self):
        self.per_round = self.per_round or ([self.tokens_per_s] if self.wall_s else [])

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def merge(self, other: Run) -> Run:
        """This run and another of the same policy and level as one (their requests, tokens and walls
        added): `--rounds`."""
        self.per_round = (self.per_round or [self.tokens_per_s]) + (other.per_round or [other.tokens_per_s])
        self.requests, self.tokens, self.wall_s = self.requests + other.requests, self.tokens + other.tokens, \
            self.wall_s + other.wall_s
        self.latency_s += other.latency_s
        self.first_token_s += other.first_token_s
        self.drafted, self.accepted = self.drafted + other.drafted, self.accepted + other.accepted
        self.rounds, self.rounds_ahead = self.rounds + other.rounds, self.rounds_ahead + other.rounds_ahead
        for index, tokens in other.outputs.items():
            self.outputs.setdefault(index, tokens)
        if self.passes is not None and other.passes is not None:
            self.passes += other.passes
        return self

    def row(self) -> dict:
        def pct(values: list[float], q: float) -> float:
            return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

        return {"mode": self.mode, "policy": self.policy, "concurrency": self.concurrency, "requests": self.requests,
                "tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "latency_p50_s": pct(self.latency_s, 50), "latency_p99_s": pct(self.latency_s, 99),
                "ttft_p50_s": pct(self.first_token_s, 50), "ttft_p99_s": pct(self.first_token_s, 99),
                "drafted": self.drafted, "accepted": self.accepted, "rounds": self.rounds,
                "rounds_ahead": self.rounds_ahead, "per_round_tokens_per_s": self.per_round,
                **({"live_profile": self.live_profile} if self.live_profile else {}),
                **(pass_split(self.passes, self.wall_s) if self.passes is not None else {})}


def pass_split(timings: list[PassTiming], wall_s: float) -> dict:
    """A run's timed passes (each once, however many sessions it carried): the target's passes and
    the tokens they fed, and the wall split among the target's, the draft's, the probes' scratch
    passes (workers.py: the off- and curve probes) and the rest."""
    def seconds(passes) -> float:
        return sum(t.ms for t in passes) / MS_PER_S

    target = [t for t in timings if t.role == "verifier" and not t.probe]
    split = {"target_passes": len(target), "target_tokens": sum(t.tokens for t in target),
             "target_s": seconds(target), "draft_s": seconds(t for t in timings if t.role == "draft" and not t.probe),
             "probe_s": seconds(t for t in timings if t.probe)}
    return {**split, "rest_s": wall_s - split["target_s"] - split["draft_s"] - split["probe_s"]}


class CountingTransport:
    """The in-process transport with every reply's timed passes kept until `take` (the planner
    still gets them): the seam the loop's calls go through, probes included."""

    def __init__(self, inner: RoundTransport):
        self.inner, self.timings = inner, []

    def take(self) -> list[PassTiming]:
        taken, self.timings = self.timings, []
        return taken

    async def propose(self, items: list[ProposeItem], plan: StepPlan, draft: str = DEFAULT_DRAFT) -> ProposeReply:
        return self._counted(await self.inner.propose(items, plan, draft))

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> VerifyReply:
        return self._counted(await self.inner.verify(items, probe_tokens))

    async def release(self, role: Role, session_ids: list[str], draft: str = DEFAULT_DRAFT) -> None:
        await self.inner.release(role, session_ids, draft)

    def _counted(self, reply: BatchReply) -> BatchReply:
        self.timings += reply.passes
        return reply


def client_prompts(client: int, concurrency: int, per_client: int, pool: int) -> list[int]:
    """Prompt indices client `client` sends, in order: the pool in turn across clients."""
    return [(client + r * concurrency) % pool for r in range(per_client)]


async def closed_loop(send, concurrency: int, per_client: int, pool: int, run: Run) -> Run:
    """`send(prompt_index) -> (tokens, seconds to first token, stats)` is awaited for every request
    (stats: the request's, with draft_tokens and accepted_tokens)."""
    async def client(c: int) -> None:
        for index in client_prompts(c, concurrency, per_client, pool):
            start = time.perf_counter()
            tokens, first_s, stats = await send(index)
            run.drafted += stats.draft_tokens
            run.accepted += stats.accepted_tokens
            run.rounds += stats.rounds
            run.rounds_ahead += stats.rounds_ahead_used
            run.latency_s.append(time.perf_counter() - start)
            run.first_token_s.append(first_s)
            run.requests += 1
            run.tokens += len(tokens)
            run.outputs.setdefault(index, tokens)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    run.wall_s = time.perf_counter() - start
    return run


def in_process(models: EngineConfig, prompts: list[str], specs, levels: list[int], per_client: Callable[[int], int],
               max_new_tokens: int, mode: str = "in-process", rounds: int = 1) -> list[Run]:
    """`rounds` > 1: each level's policies run that many times, in their order and then reversed in
    turn (A B B A ...), and a policy's runs count as one: a machine whose speed drifts over the run
    favours neither the first policy nor the last."""
    engine = build_engine(models, progress=False)
    counting = engine.loop.calls.transport = CountingTransport(engine.loop.calls.transport)
    ids = [engine.encode_prompt(p) for p in prompts]
    runs = []
    for level in levels:  # the policies of a level one after the other: a drift of the machine spares the ratios
        merged: dict[str, Run] = {}
        for spec in [s for r in range(rounds) for s in (specs if r % 2 == 0 else specs[::-1])]:
            params = GenerationParams(max_new_tokens=max_new_tokens, policy=spec.policy_config())
            engine.generate_ids(ids[0], params.model_copy(update={"max_new_tokens": 4}))  # warm-up

            async def send(index: int):
                start, first = time.perf_counter(), []

                def on_update(_sample, new_ids, _text, _finish):
                    if new_ids and not first:
                        first.append(time.perf_counter() - start)

                result = await engine.loop.generate(ids[index], params, on_update)
                return result.completions[0].token_ids, first[0] if first else 0.0, result.stats

            counting.take()  # the warm-up's passes are not the run's
            run = asyncio.run(closed_loop(send, level, per_client(level), len(ids), Run(mode, spec.key, level)))
            run.passes = counting.take()
            print(f"  {mode} {spec.key} C={level}: {run.tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)
            merged[spec.key] = merged[spec.key].merge(run) if spec.key in merged else run
        runs += merged.values()
    return runs


def served(models: EngineConfig, prompts: list[str], specs, levels: list[int], per_client: Callable[[int], int],
           max_new_tokens: int, lanes: list[int], threads: int | None, overlaps: list[str] = ["auto"],
           placements: list[str] = ["coordinator"], replica_env: dict[str, str] | None = None) -> list[Run]:
    import grpc
    import ray
    from ray import serve

    from services.config import AppConfig, ReplicaConfig
    from services.launch import start
    from specdec.v1 import generation_pb2, generation_pb2_grpc

    runs = []
    for lane_count, overlap, placement in ((lane_count, overlap, placement) for lane_count in lanes
                                           for overlap in overlaps for placement in placements):
        mode = ", ".join(["served"] + ([f"{lane_count} lanes"] if lane_count > 1 else [])
                         + ([f"overlap {overlap}"] if overlap != "auto" else [])
                         + (["the loop beside the verifier"] if placement == "verifier" else []))
        batch = models.batch.model_copy(update={"lanes": lane_count, "overlap": overlap})
        config = AppConfig(models=models.model_copy(update={"batch": batch}),
                           draft=ReplicaConfig(num_cpus=0.5, threads=threads, env=replica_env or {}),
                           verifier=ReplicaConfig(num_cpus=0.5, threads=threads, env=replica_env or {}),
                           loop_placement=placement)
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            addresses = start(config, http_port=18000, grpc_port=19000)

            async def measure(spec, level: int) -> Run:
                policy = spec.policy_config()
                fields = {"policy": policy.name, "max_new_tokens": max_new_tokens,
                          **({"k": policy.k} if policy.k is not None else {}),
                          **({"threshold": policy.threshold} if policy.threshold is not None else {})}
                channel = grpc.aio.insecure_channel(addresses["grpc"])
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def send(index: int):
                    start, first, tokens = time.perf_counter(), None, []
                    request = generation_pb2.GenerateRequest(text=prompts[index], **fields)
                    async for chunk in stub.GenerateStream(request, timeout=3600):
                        if chunk.token_ids and first is None:
                            first = time.perf_counter() - start
                        tokens.extend(chunk.token_ids)
                    return tokens, first or 0.0, chunk.stats  # the last chunk carries them

                await send(0)  # warm-up
                run = await closed_loop(send, level, per_client(level), len(prompts), Run(mode, spec.key, level))
                await channel.close()
                return run

            for level in levels:  # as in process: the policies of a level one after the other
                for spec in specs:
                    run = asyncio.run(measure(spec, level))
                    run.live_profile = live_profile(addresses["http"])
                    print(f"  live profile after it: {run.live_profile}", file=sys.stderr, flush=True)
                    print(f"  {mode} {spec.key} C={level}: {run.tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)
                    runs.append(run)
        finally:
            serve.shutdown()
            ray.shutdown()
    return runs


def live_profile(http: str) -> dict[str, float]:
    """The served app's live cost profile and whether drafting pays, from its /metrics (Ray exports
    them every few seconds); {} where it cannot be read."""
    import httpx

    try:
        text = httpx.get(f"{http}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = {}
    for metric, labels, value in re.findall(r"(cost_profile_ms|drafting_pays)\{([^}]*)\}\s+(\S+)", text):
        labels = dict(re.findall(r'(role|tokens)="([^"]*)"', labels))
        found[f"{labels['role']}:{labels['tokens']}" if metric == "cost_profile_ms" else metric] = round(float(value), 1)
    return found


def mismatches(runs: list[Run]) -> list[str]:
    """Prompts whose greedy tokens differ between runs (the first run of a prompt is the reference)."""
    reference: dict[int, tuple[str, list[int]]] = {}
    found = []
    for run in runs:
        for index, tokens in run.outputs.items():
            where = f"{run.mode} {run.policy} C={run.concurrency}"
            if index not in reference:
                reference[index] = (where, tokens)
            elif tokens != reference[index][1]:
                first = next((i for i, (a, b) in enumerate(zip(tokens, reference[index][1])) if a != b),
                             min(len(tokens), len(reference[index][1])))
                found.append(f"prompt {index}: {where} differs from {reference[index][0]} at token {first}")
    return found


def by_round(row: dict, plain: dict | None) -> str:
    """`--rounds`: the row's tok/s over target-only's, round by round (each round runs both, next to
    each other): the median and the range of the ratios."""
    if plain is None or len(row.get("per_round_tokens_per_s", [])) < 2:
        return "-"
    ratios = [a / b for a, b in zip(row["per_round_tokens_per_s"], plain["per_round_tokens_per_s"]) if b]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)"


def ahead(row: dict) -> str:
    """'12 of 40': its rounds drafted while the one before verified, of all its rounds ('-' in runs before them)."""
    return f"{row['rounds_ahead']} of {row['rounds']}" if "rounds_ahead" in row else "-"


def table(rows: list[dict]) -> str:
    alone = {(r["mode"], r["policy"]): r["tokens_per_s"] for r in rows if r["concurrency"] == 1}
    plain = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["policy"] == BASELINE}
    plain_rows = {(r["mode"], r["concurrency"]): r for r in rows if r["policy"] == BASELINE}
    in_process = {(r["policy"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["mode"] == "in-process"}
    lines = ["| mode | policy | C | requests | tokens | tok/s (aggregate) | vs C=1 | vs target-only | "
             "vs target-only by round: median (range) | served / in process "
             "| latency p50 / p99 (s) | first token p50 / p99 (s) | drafted / accepted | rounds drafted ahead "
             "| target passes / tokens fed | time in target / draft / probes / rest (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = alone.get((r["mode"], r["policy"]))
        baseline = plain.get((r["mode"], r["concurrency"]))
        local = in_process.get((r["policy"], r["concurrency"]))
        ratio = f"{r['tokens_per_s'] / local:.3f}" if r["mode"].startswith("served") and local else "-"
        scaling = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        speedup = f"{r['tokens_per_s'] / baseline:.2f}x" if baseline else "-"
        lines.append(f"| {r['mode']} | {r['policy']} | {r['concurrency']} | {r['requests']} | {r['tokens']} | "
                     f"{r['tokens_per_s']:.2f} | {scaling} | {speedup} | "
                     f"{by_round(r, plain_rows.get((r['mode'], r['concurrency'])))} | {ratio} | "
                     f"{r['latency_p50_s']:.1f} / {r['latency_p99_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['drafted']} / {r['accepted']} | "
                     f"{ahead(r)} | {where_time_went(r)} |")
    return "\n".join(lines)


def where_time_went(row: dict) -> str:
    """In process: the target's passes and tokens fed, and the wall split among the passes and the rest."""
    if "target_passes" not in row:
        return "- | -"
    return (f"{row['target_passes']} / {row['target_tokens']} | {row['target_s']:.1f} / {row['draft_s']:.1f} / "
            f"{row['probe_s']:.2f} / {row['rest_s']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random models (smoke)")
    parser.add_argument("--modes", nargs="+", default=["in-process", "served"], choices=["in-process", "served"])
    parser.add_argument("--policies", nargs="+", default=["specdec++cost", "fixed:2", "fixed:4"], metavar="SPEC",
                        help="policy specs as `specdec bench` takes them (default: the default policy and two "
                             "fixed K); `specdec++` alone: the head's own h (target-only joins them)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=0,
                        help="at least this many requests a level (more per client where C is small)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=32, help="HumanEval prompts in the pool")
    parser.add_argument("--max-batch-sessions", type=int, default=None)
    parser.add_argument("--max-pass-tokens", type=int, default=None)
    parser.add_argument("--lanes", nargs="+", type=int, default=[1], help="served: batches in flight (1, 2)")
    parser.add_argument("--overlap", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="served: drafting the next round while a round verifies (BatchConfig.overlap), "
                             "an app each")
    parser.add_argument("--draft", default=None, help="the draft (EngineConfig.draft; default: the fused default)")
    parser.add_argument("--loop-placement", nargs="+", default=["coordinator"], choices=["coordinator", "verifier"],
                        help="served: where the round loop runs (AppConfig.loop_placement; each in turn)")
    parser.add_argument("--baseline", action="store_true",
                        help="also the batch-1 reference runtime at concurrency 1 (one pass per session)")
    parser.add_argument("--threads", type=int, default=None, help="served: torch threads per replica")
    parser.add_argument("--replica-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="served: environment of the draft and verifier replicas (ReplicaConfig.env), "
                             "e.g. GOMP_SPINCOUNT=1000")
    parser.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"],
                        help="kernels (auto: llama.cpp for the default pair on a CPU)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="in process: run each level's policies this many times, in order then reversed "
                             "(A B B A), each policy's runs counted as one; the table adds each round's ratio to "
                             "target-only, median and range (a claim wants at least 5)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    batch = BatchConfig.from_flags(args.max_batch_sessions, args.max_pass_tokens)
    prompts = humaneval_prompts(args.prompts)
    if args.tiny:
        from tests.tiny import save_tiny_pair

        draft_dir, target_dir = save_tiny_pair(Path(tempfile.mkdtemp()))
        models = EngineConfig(draft=str(draft_dir), target=str(target_dir), batch=batch)
        prompts = [prompt[-48:] for prompt in prompts]  # the tiny models' context is 256 byte tokens
    else:
        models = EngineConfig(batch=batch, runtime=args.runtime, **({"draft": args.draft} if args.draft else {}))
    specs = with_baseline(parse_specs(args.policies))  # target-only at every mode and level
    levels = sorted(set(args.concurrency))

    def per_client(level: int) -> int:
        return max(args.requests_per_client, -(-args.min_requests // level))

    runs: list[Run] = []
    if args.baseline:
        runs += in_process(models.model_copy(update={"kv_cache": "reference"}), prompts, specs, [1],
                           per_client, args.max_new_tokens, mode="in-process, batch-1 reference")
    if "in-process" in args.modes:
        runs += in_process(models, prompts, specs, levels, per_client, args.max_new_tokens, rounds=args.rounds)
    gc.collect()  # the in-process engine's models go before the served replicas load theirs
    if "served" in args.modes:
        runs += served(models, prompts, specs, levels, per_client, args.max_new_tokens,
                       args.lanes, args.threads, args.overlap, args.loop_placement,
                       dict(pair.split("=", 1) for pair in args.replica_env))
    order = {spec.key: i for i, spec in enumerate(specs)}
    rows = [run.row() for run in sorted(runs, key=lambda r: (r.mode != "in-process", r.mode, order[r.policy], r.concurrency))]
    differ = mismatches(runs)
    print(f"\n{'tiny' if args.tiny else 'default'} pair, greedy, {args.max_new_tokens} new tokens, HumanEval prompts "
          f"(pool of {len(prompts)}), {args.requests_per_client} requests per client"
          f"{f' (at least {args.min_requests} a level)' if args.min_requests else ''}"
          f"{f', {args.rounds} rounds in process (A B B A)' if args.rounds > 1 else ''}, {cpu_name()}, "
          f"{time.strftime('%Y-%m-%d')}; batch {batch.model_dump()}\n")
    print(table(rows))
    print(f"\ngreedy outputs identical across every mode and level: {not differ}")
    for line in differ:
        print(f"- {line}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                                              "rows": rows, "mismatches": differ,
                                              "runs": [asdict(run) for run in runs]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
