"""The suffix draft projected onto measured passes (issue 68): its rounds replayed on the target's
own greedy outputs, priced with a GPU run's captured passes (benchmarks/gpu/bench.py) or with the
default target's llama.cpp passes timed on this machine (`--cpu`).

For each prompt of a `specdec bench` run, the target-only record's greedy output is decoded again
offline through the real `SuffixProposer` (the index, the estimates learning as they go, the step's
budget choosing each round over the walk) with a pass curve at one session as its costs: a round of
K candidates costs pass(K + 1) plus the host's time a pass, and commits the candidates the output
agrees with plus one token. Target-only costs pass(1) plus the host a token. Decoding only (the
prefill is the same for both; `--cpu` also times each prompt's prefill here and gives the speedup
with it, as `specdec bench` counts); greedy; the outputs are the CPU target's (the default pair's
1.5B), a proxy for a larger target's on the same prompts.

Beside the walk, a copy oracle that knows the output bounds what any draft copying earlier text can
do on that curve (`copy_oracle`), and the walk's own candidates stopped where the output leaves them
(`walk_oracle`) split the gap between the two: what the candidates lose, and what the stopping does.
`--walk-cost 1 8 64` times the walks themselves, host work on any device: ms a step for that many
sessions decoding the outputs at once (`walk_cost`).

    python -m benchmarks.suffix_replay docs/results/suffix/2026-12-05-editing --prompts editing --limit 12 \\
        --gpu docs/results/gpu/2026-12-04-h200 docs/results/gpu/2026-12-04-h200-b
    python -m benchmarks.suffix_replay docs/results/suffix/2026-12-05-editing-60-target --prompts editing --cpu
    python -m benchmarks.suffix_replay docs/results/suffix/2026-12-05-editing-60-target --prompts editing \\
        --gpu docs/results/gpu/2026-12-04-h200 --shapes qwen2.5-7b --walk-cost 1 8 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.gpu.project import host_per_pass, interpolate, load_results, pass_curve
from specdec.bench.prompt_sets import load_prompts
from specdec.budget import MAX_CANDIDATES
from specdec.builder import EngineConfig, build_rules
from specdec.cost_profile import CostProfile
from specdec.metrics import MS_PER_S
from specdec.models.runtime import common_prefix_length
from specdec.models.suffix import MatchHead, SuffixDraft, SuffixSession
from specdec.policies import PolicyConfig, make_policy
from specdec.proposers import SuffixProposer
from specdec.protocol import StepPlan
from specdec.rounds import DraftRow
from specdec.sampling import SamplingParams

GPU_CANDIDATES = 15  # a round's pass stays within a GPU run's measured curve (16 tokens)
CPU_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the pass sizes `--cpu` times (the copy oracle's rounds reach 32 tokens)


def replay(proposer: SuffixProposer, prompt: list[int], output: list[int], costs: CostProfile, host_ms: float,
           curve: dict[int, float], most: int = GPU_CANDIDATES) -> tuple[float, float, int]:
    """(speculative ms, target-only ms, rounds) to decode `output` after `prompt`, at most `most`
    candidates a round."""
    session, history, spent, rounds = SuffixSession(), list(prompt), 0.0, 0
    policy = make_policy(PolicyConfig(name="specdec++cost"), head=MatchHead())
    while len(history) < len(prompt) + len(output):
        left = len(prompt) + len(output) - len(history)
        row = DraftRow(session, history, policy, min(most, left - 1), len(history) - len(prompt),
                       SamplingParams(), None)
        start = time.perf_counter()
        [proposal] = proposer.propose([row], StepPlan(costs=costs), [])
        spent += (time.perf_counter() - start) * MS_PER_S  # the walk, on this CPU
        truth = output[len(history) - len(prompt):]
        accepted = common_prefix_length(proposal.candidates, truth)
        spent += interpolate(curve, len(proposal.candidates) + 1) + host_ms
        history = history + truth[:accepted + 1]
        rounds += 1
    return spent, len(output) * (curve[1] + host_ms), rounds


def walk_oracle(proposer: SuffixProposer, prompt: list[int], output: list[int], curve: dict[int, float],
                host_ms: float, most: int) -> tuple[float, int]:
    """(ms, rounds) to decode `output` after `prompt` with the walk's candidates (walked as far as
    `most`) and a stopping rule that knows the output: each round keeps the candidates the output
    agrees with, as far as makes the round's pass cheapest a token on `curve`."""
    session, history, spent, rounds = SuffixSession(), list(prompt), 0.0, 0
    policy = make_policy(PolicyConfig(name="fixed", k=most))
    while len(history) < len(prompt) + len(output):
        left = len(prompt) + len(output) - len(history)
        row = DraftRow(session, history, policy, min(most, left - 1), len(history) - len(prompt),
                       SamplingParams(), None)
        [proposal] = proposer.propose([row], StepPlan(), [])
        truth = output[len(history) - len(prompt):]
        agreed = common_prefix_length(proposal.candidates, truth)
        k = max(range(agreed + 1), key=lambda k: (k + 1) / interpolate(curve, k + 1))
        spent += interpolate(curve, k + 1) + host_ms
        history = history + truth[:k + 1]
        rounds += 1
    return spent, rounds


def copy_oracle(prompt: list[int], output: list[int], curve: dict[int, float], host_ms: float) -> tuple[float, int]:
    """(ms, rounds) to decode `output` after `prompt` with a draft that knows it: each round takes
    the longest run of the output's next tokens that occurs in the text before (prompt and output
    so far), as far as makes the round's pass cheapest a token on `curve` (up to its last point).
    No draft that copies earlier text does better a round: it bounds the suffix draft's walk."""
    chars = "".join(map(chr, prompt + output))  # tokens as characters: str.find searches in C
    most, spent, rounds, done = max(curve) - 1, 0.0, 0, 0
    while done < len(output):
        at, left = len(prompt) + done, len(output) - done - 1
        lo, hi = 0, min(most, left)  # binary search: a run that occurs has every prefix occur too
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chars.find(chars[at:at + mid], 0, at) != -1:
                lo = mid
            else:
                hi = mid - 1
        k = max(range(lo + 1), key=lambda k: (k + 1) / interpolate(curve, k + 1))
        spent += interpolate(curve, k + 1) + host_ms
        done, rounds = done + k + 1, rounds + 1
    return spent, rounds


WALK_STEPS = 48  # timed steps of `walk_cost`, after WALK_WARMUP (the sessions' first walks index their prompts)
WALK_WARMUP = 4


def walk_cost(texts: list[tuple[list[int], list[int]]], sessions: int, costs: CostProfile, vocab_size: int,
              most: int = GPU_CANDIDATES) -> tuple[float, float]:
    """(median, 90th percentile) ms of one step's walks for `sessions` sessions at once, session s
    decoding the (prompt, output) pair s of `texts` (round robin) as the replay does: each round
    commits the candidates the output agrees with plus one token."""
    proposer = SuffixProposer(SuffixDraft(vocab_size))
    policy = PolicyConfig(name="specdec++cost")
    rows = [(SuffixSession(), make_policy(policy, head=MatchHead()), *texts[s % len(texts)]) for s in range(sessions)]
    done = [0] * sessions
    times = []
    for step in range(WALK_WARMUP + WALK_STEPS):
        batch = [DraftRow(session, prompt + output[:done[s]], each, min(most, max(len(output) - done[s] - 1, 0)),
                          done[s], SamplingParams(), None)
                 for s, (session, each, prompt, output) in enumerate(rows)]
        start = time.perf_counter()
        proposals = proposer.propose(batch, StepPlan(costs=costs), [])
        if step >= WALK_WARMUP:
            times.append((time.perf_counter() - start) * MS_PER_S)
        for s, proposal in enumerate(proposals):
            output = rows[s][3]
            taken = common_prefix_length(proposal.candidates, output[done[s]:])
            done[s] = min(done[s] + taken + 1, len(output) - 1)  # a finished output stays at its end
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def cpu_costs(prompts: dict[int, list[int]]) -> tuple[dict[int, float], dict[int, float]]:
    """The default target's pass curve on llama.cpp here ({k: ms}, one session) and each prompt's
    prefill (ms), timed the way `specdec bench` runs them."""
    from specdec.bench.forward import forward_time_curve
    from specdec.builder import build_target
    from specdec.models.runtime import Feed

    target, _ = build_target(EngineConfig(), progress=False)
    curve = {k: seconds * MS_PER_S for k, seconds in forward_time_curve(target, CPU_KS).items()}
    prefill = {}
    for index, prompt in prompts.items():
        session = target.new_session()
        start = time.perf_counter()
        target._forward([Feed(session, prompt, 1)])
        prefill[index] = (time.perf_counter() - start) * MS_PER_S
        target.rollback(session, 0)
    return curve, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path, help="a specdec bench folder with target-only greedy records")
    parser.add_argument("--prompts", default="editing")
    parser.add_argument("--limit", type=int, default=None)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", type=Path, nargs="+", help="bench.py result folders (merged)")
    where.add_argument("--cpu", action="store_true", help="the default target's llama.cpp passes, timed here")
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--walk-cost", type=int, nargs="+", metavar="SESSIONS",
                        help="time the walks of this many sessions a step instead (on the first curve's costs)")
    args = parser.parse_args()
    if args.walk_cost and args.cpu:
        parser.error("--walk-cost prices the walks on a GPU run's passes (--gpu)")

    rules = build_rules(EngineConfig(), progress=False)
    prompts = [rules.encode_prompt(p) for p in load_prompts(args.prompts, args.limit)]
    records = [json.loads(line) for line in (args.bench / "records.jsonl").read_text().splitlines() if line]
    outputs = {r["prompt"]: r["token_ids"] for r in records if r["spec"] == "target-only" and r["temperature"] == 0}
    if args.cpu:
        curve, prefill = cpu_costs({index: prompts[index] for index in outputs})
        only = [r for r in records if r["spec"] == "target-only" and r["temperature"] == 0]
        host_ms = sum(r["stats"]["wall_time_s"] - r["stats"]["target_time_s"] for r in only) * MS_PER_S / sum(
            r["stats"]["target_forward_passes"] for r in only)  # the bench's host time a pass, target-only
        curves, most = {"llama.cpp here": curve}, MAX_CANDIDATES  # the walk's rounds as served
    else:
        passes, loop, _, _ = load_results(*args.gpu)
        host_ms, prefill = host_per_pass(loop, "target-only", 1) or 0.0, None
        curves, most = {shape: pass_curve(passes[shape], 1, "captured") for shape in args.shapes}, GPU_CANDIDATES
    if args.walk_cost:
        name, curve = next(iter(curves.items()))
        texts = [(prompts[index], output) for index, output in sorted(outputs.items())]
        print(f"the suffix draft's walks a step, greedy, priced on {name}'s passes; {len(texts)} outputs of "
              f"{args.prompts} round robin; median (90th percentile) of {WALK_STEPS} steps")
        for sessions in args.walk_cost:
            median, p90 = walk_cost(texts, sessions, CostProfile(t_draft_ms=0.01, t_target_ms=curve),
                                    rules.vocab_size, most)
            print(f"{sessions} sessions: {median:.2f} ms a step ({p90:.2f}), {median / sessions:.3f} ms a session")
        return
    print(f"{len(outputs)} prompts of {args.prompts}, the target's greedy outputs from {args.bench}; "
          f"host {host_ms:.2f} ms a pass; one session")
    tokens = sum(len(o) for o in outputs.values())
    for name, curve in curves.items():
        costs = CostProfile(t_draft_ms=0.01, t_target_ms=curve)
        proposer = SuffixProposer(SuffixDraft(rules.vocab_size))  # estimates learn across the prompts, as served
        candidates = SuffixProposer(SuffixDraft(rules.vocab_size))
        spec = plain = bound = stopped = 0.0
        ratios, rounds, oracle_rounds, stopped_rounds = [], 0, 0, 0
        for index, output in sorted(outputs.items()):
            s, p, r = replay(proposer, prompts[index], output, costs, host_ms, curve, most)
            o, r_o = copy_oracle(prompts[index], output, curve, host_ms)
            w, r_w = walk_oracle(candidates, prompts[index], output, curve, host_ms, most)
            spec, plain, bound, rounds, oracle_rounds = spec + s, plain + p, bound + o, rounds + r, oracle_rounds + r_o
            stopped, stopped_rounds = stopped + w, stopped_rounds + r_w
            ratios.append(p / s)
        ratios.sort()
        print(f"{name}: pass(1) {curve[1]:.2f} ms, pass(16) {curve.get(16, float('nan')):.2f} ms; decoding only: "
              f"{tokens} tokens in {rounds} rounds ({tokens / rounds:.2f} a pass): {plain / spec:.2f}x target-only "
              f"(per prompt median {ratios[len(ratios) // 2]:.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f}); its candidates "
              f"stopped knowing the output {tokens / stopped_rounds:.2f} a pass, {plain / stopped:.2f}x; the copy "
              f"oracle {tokens / oracle_rounds:.2f} a pass, {plain / bound:.2f}x")
        if prefill is not None:
            first = sum(prefill.values())
            print(f"  with each prompt's prefill ({first / MS_PER_S:.1f} s in all, {first / (first + plain):.0%} of "
                  f"target-only's time): {(first + plain) / (first + spec):.2f}x target-only, its candidates "
                  f"stopped knowing the output {(first + plain) / (first + stopped):.2f}x, the copy oracle "
                  f"{(first + plain) / (first + bound):.2f}x")


if __name__ == "__main__":
    main()
