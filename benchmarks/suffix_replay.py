"""The suffix draft projected onto measured GPU passes (issue 68): its rounds replayed on the target's
own greedy outputs, priced with a GPU run's captured passes (benchmarks/gpu/bench.py).

For each prompt of a `specdec bench` run, the target-only record's greedy output is decoded again
offline through the real `SuffixProposer` (the index, the estimates learning as they go, the step's
budget choosing each round over the walk) with the GPU shape's pass curve at one session as its
costs: a round of K candidates costs pass(K + 1) plus the host's time a pass, and commits the
candidates the output agrees with plus one token. Target-only costs pass(1) plus the host a token.
Decoding only (the prefill is the same for both); greedy; the outputs are the CPU target's (the
default pair's 1.5B), a proxy for a larger target's on the same prompts.

    python -m benchmarks.suffix_replay docs/results/suffix/2026-12-05-editing --prompts editing --limit 12 \\
        --gpu docs/results/gpu/2026-12-04-h200 docs/results/gpu/2026-12-04-h200-b
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.gpu.project import host_per_pass, interpolate, load_results, pass_curve
from specdec.bench.prompt_sets import load_prompts
from specdec.builder import EngineConfig, build_rules
from specdec.cost_profile import CostProfile
from specdec.metrics import MS_PER_S
from specdec.models.suffix import MatchHead, SuffixDraft, SuffixSession
from specdec.policies import PolicyConfig, make_policy
from specdec.proposers import SuffixProposer
from specdec.protocol import StepPlan
from specdec.rounds import DraftRow
from specdec.sampling import SamplingParams

MAX_CANDIDATES = 15  # a round's pass stays within the measured curve (16 tokens)


def replay(proposer: SuffixProposer, prompt: list[int], output: list[int], costs: CostProfile, host_ms: float,
           curve: dict[int, float]) -> tuple[float, float, int]:
    """(speculative ms, target-only ms, rounds) to decode `output` after `prompt`."""
    session, history, spent, rounds = SuffixSession(), list(prompt), 0.0, 0
    policy = make_policy(PolicyConfig(name="specdec++cost"), head=MatchHead())
    while len(history) < len(prompt) + len(output):
        left = len(prompt) + len(output) - len(history)
        row = DraftRow(session, history, policy, min(MAX_CANDIDATES, left - 1), len(history) - len(prompt),
                       SamplingParams(), None)
        start = time.perf_counter()
        [proposal] = proposer.propose([row], StepPlan(costs=costs), [])
        spent += (time.perf_counter() - start) * MS_PER_S  # the walk, on this CPU
        truth = output[len(history) - len(prompt):]
        accepted = 0
        for y, token in zip(proposal.candidates, truth):
            if y != token:
                break
            accepted += 1
        spent += interpolate(curve, len(proposal.candidates) + 1) + host_ms
        history = history + truth[:accepted + 1]
        rounds += 1
    return spent, len(output) * (curve[1] + host_ms), rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path, help="a specdec bench folder with target-only greedy records")
    parser.add_argument("--prompts", default="editing")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--gpu", type=Path, nargs="+", required=True, help="bench.py result folders (merged)")
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    args = parser.parse_args()

    rules = build_rules(EngineConfig(), progress=False)
    prompts = [rules.encode_prompt(p) for p in load_prompts(args.prompts, args.limit)]
    records = [json.loads(line) for line in (args.bench / "records.jsonl").read_text().splitlines() if line]
    outputs = {r["prompt"]: r["token_ids"] for r in records if r["spec"] == "target-only" and r["temperature"] == 0}
    passes, loop, _, _ = load_results(*args.gpu)
    host_ms = host_per_pass(loop, "target-only", 1) or 0.0
    print(f"{len(outputs)} prompts of {args.prompts}, the target's greedy outputs from {args.bench}; "
          f"host {host_ms:.2f} ms a pass; decoding only, one session")
    for shape in args.shapes:
        curve = pass_curve(passes[shape], 1, "captured")
        costs = CostProfile(t_draft_ms=0.01, t_target_ms=curve)
        proposer = SuffixProposer(SuffixDraft(rules.vocab_size))  # estimates learn across the prompts, as served
        spec = plain = 0.0
        ratios, rounds = [], 0
        for index, output in sorted(outputs.items()):
            s, p, r = replay(proposer, prompts[index], output, costs, host_ms, curve)
            spec, plain, rounds = spec + s, plain + p, rounds + r
            ratios.append(p / s)
        tokens = sum(len(o) for o in outputs.values())
        ratios.sort()
        print(f"{shape}: pass(1) {curve[1]:.2f} ms, pass(16) {curve.get(16, float('nan')):.2f} ms; "
              f"{tokens} tokens in {rounds} rounds ({tokens / rounds:.2f} a pass): {plain / spec:.2f}x target-only "
              f"(per prompt median {ratios[len(ratios) // 2]:.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
