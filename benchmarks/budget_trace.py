"""Trace the step planner's decisions in one process (docs/planner.md's load bugs were found with it).

    python -m benchmarks.budget_trace target-only@16 specdec++cost@16   # policy@sessions, in order
    python -m benchmarks.budget_trace --runtime torch --prompts prose specdec++cost@1

Each argument runs `sessions` HumanEval (or prose) prompts at once (greedy, --max-new-tokens,
default 128) on one engine, so the live profile carries over from run to run as it does in
benchmarks/concurrency.py. Per run it prints tokens/s and the candidates drafted / accepted, then
every step that called the draft: batch size, sessions drafting, the saving at the bound, at the
measured acceptance and at the one a catch-up is judged at (ms a token, budget.drafting_saving),
the step's wall time, the smallest draft lags and each drafting session's K; then the live
profile. --out DIR writes each run's whole trace as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from specdec.bench.specs import parse_specs
from specdec.budget import MAX_CANDIDATES, drafting_saving
from specdec.builder import EngineConfig, build_engine
from specdec.params import GenerationParams
from specdec.prompts import humaneval_prompts, prose_test_prompts


def traced(loop, trace: list[dict]) -> None:
    """Wrap each lane's planner's `plan`, the loop's `_step` and its transport's `propose` and
    `verify` so that every step appends its record to `trace` (with the candidates each drafting
    session's round got: K = 0 after a drafting pass is a pass the budget spent for nothing, and the
    target pass the verifier timed before the step's decision, `pass_probe`)."""
    step, transport = loop._step, loop.calls.transport
    propose, verify = transport.propose, transport.verify
    probed: list[int] = []

    def traced_plan(planner):
        plan = planner.plan

        async def traced(batch):
            step_plan = await plan(batch)
            record = {"sessions": len(batch), "drafting": len(step_plan.drafting), "probe": step_plan.probe is not None,
                      "pass_probe": probed.pop() if probed else 0, "acceptance": round(planner.acceptance, 3),
                      "lags": sorted(planner.lag(s) for s in batch)[:3]}
            if step_plan.costs is not None:
                costs = step_plan.costs
                record["saving_bound"] = round(drafting_saving(costs, len(batch), MAX_CANDIDATES), 1)
                record["saving"] = round(drafting_saving(costs, len(batch), MAX_CANDIDATES, planner.acceptance), 1)
                record["saving_catch_up"] = round(drafting_saving(costs, len(batch), MAX_CANDIDATES,
                                                                  planner.catch_up_acceptance), 1)
            trace.append(record)
            return step_plan

        return traced

    async def traced_step(planner, batch):
        start = time.perf_counter()
        await step(planner, batch)
        trace[-1]["step_ms"] = round((time.perf_counter() - start) * 1000)

    async def traced_propose(items, plan):
        reply = await propose(items, plan)
        trace[-1]["K"] = [len(answer.candidates) for answer in reply.answers if hasattr(answer, "candidates")]
        return reply

    async def traced_verify(items, probe_tokens=0):
        if not items:
            probed.append(probe_tokens)
        return await verify(items, probe_tokens)

    for planner in loop.planners:
        planner.plan = traced_plan(planner)
    loop._step = traced_step
    transport.propose, transport.verify = traced_propose, traced_verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="POLICY@SESSIONS")
    parser.add_argument("--runtime", default="llamacpp", choices=["auto", "torch", "llamacpp"])
    parser.add_argument("--prompts", default="humaneval", choices=["humaneval", "prose"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs = [(spec, int(sessions)) for spec, sessions in (run.rsplit("@", 1) for run in args.runs)]

    engine = build_engine(EngineConfig(runtime=args.runtime), progress=False)
    prompts = {"humaneval": humaneval_prompts, "prose": prose_test_prompts}[args.prompts]
    ids = [engine.encode_prompt(p) for p in prompts(max(n for _, n in runs))]
    trace: list[dict] = []
    traced(engine.loop, trace)
    engine.generate_ids(ids[0], GenerationParams(max_new_tokens=4))  # warm-up
    for spec, sessions in runs:
        params = GenerationParams(max_new_tokens=args.max_new_tokens, policy=parse_specs([spec])[0].policy_config())

        async def together():
            return await asyncio.gather(*(engine.loop.generate(ids[i], params) for i in range(sessions)))

        trace.clear()
        start = time.perf_counter()
        results = asyncio.run(together())
        wall = time.perf_counter() - start
        tokens = sum(len(r.completions[0].token_ids) for r in results)
        drafted = sum(r.stats.draft_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        print(f"== {spec} x {sessions}: {tokens} tokens in {wall:.1f} s, {tokens / wall:.2f} tok/s, "
              f"{drafted} candidates drafted, {accepted} accepted", flush=True)
        for record in trace:
            if record["drafting"] or record["pass_probe"]:
                print("  ", record)
        print("   profile:", engine.cost_profile())
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{spec.replace(':', '_')}@{sessions}.json").write_text(json.dumps(trace, indent=1))


if __name__ == "__main__":
    main()
