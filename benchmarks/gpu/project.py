"""Projected speedups on a GPU: the pass costs the GPU benchmark measured (bench.py, captured) with
the acceptance a draft measured on real text, by the paper's round cost model:

    speedup(K) = E(K) t_target(C, 1) / (K t_draft(C) + t_target(C, K + 1)),   E(K) = 1 + sum_{j<=K} S_j

S_j is the share of rounds whose first j candidates were all accepted: cumulative already (a round
that accepts position j accepted 1..j), so E(K) adds them as they are. C is the sessions sharing
every pass and t(C, k) the median captured pass of C sessions feeding k tokens each (linear in k
between measured points).

Drafts:
- `qwen2.5-0.5b`: S_j from a `specdec bench` run's records of the default pair (a fixed-K run of at
  least K, HumanEval), greedy and T = 1; t_draft its captured step.
- `feature` (models/feature_draft.py): S_j from `benchmarks/draft_acceptance.py`'s free-running
  rounds on held-out code (greedy). t_draft is its captured step where bench.py's `feature` section
  timed it (`measured`); else estimated: the target's captured pass at C sessions over its layer
  count (one decoder layer of the target's shape) plus its own weights past that layer (the
  trimmed output rows, the fuse and reduce projections) at the bandwidth the 7B pass reached.
  Every such row says `estimated`.

`overlap`: the same draft on a device (or process) of its own drafting each session's next round
while the target verifies this one (loop.py, BatchConfig.overlap): the ahead round drafts a guess of
the bonus token then K candidates, and is kept where all K are accepted and the guess is the
target's token (P = S_{K+1} greedy; at T = 1 the guess matches less often than a candidate is
accepted, so its rows are an upper bound), else drafted again after the verdict:

    overlap(K) = E(K) t_target(C, 1) / (max(t_target(C, K + 1), (K + 1) t_draft(C)) + (1 - S_{K+1}) K t_draft(C))

for one session (at C > 1 the next step drafts unless every session hit: the rows say so only at
C = 1). Its ceiling, every candidate accepted, is t_target(C, 1) / t_draft(C): a draft step is what
every token waits for once the target's pass is hidden behind it.

Policy: `best-fixed` is the fixed K that is best in hindsight for this acceptance and these costs
(the adaptive rule chooses K per round and can beat it). `+host` adds the host time per pass that
bench.py's loop section measured (the static cache's loop where the run has it, while decoding
where it tells decoding apart) to both sides; `served` adds to the speculative side the ms per step
the transport section measured the gRPC round services adding (against plain decoding in process).

`default` (specdec++cost; `--replay DRAFT=CACHE,HEAD`): the round loop replayed over the draft's
head validation tokens (benchmarks/replay_rules.py: each round's candidates and their acceptance
along the target's own responses, the head's estimate of each, greedy and T = 1) with the GPU's
costs as the rule's profile; beside it `replay-fixed`, the best fixed K on the same tokens. At C
sessions (`--replay-concurrency`) C responses decode in lock-step and one budget spends each step
over all of them (specdec/budget.py `replay_step`, as rounds.propose does), priced as the loop
learns the costs: a drafting step by the sessions it advances (the measured batch sizes), a pass by
the tokens it feeds (this batch's passes of k tokens each). CACHE is the feature cache
`specdec train-head` wrote (its `features/*.pt`), HEAD the head.

    python -m benchmarks.gpu.project docs/results/gpu/2026-11-28-h200
    python -m benchmarks.gpu.project DIR --json          # one JSON object per row
    python -m benchmarks.gpu.project DIR1 DIR2           # one day's runs merged: DIR2's loop and transport
    python -m benchmarks.gpu.project DIR --replay feature=~/.cache/specdec/replay/<key>-validation.pt,specdec/drafts/default-feature/head \
        --replay-concurrency 1 4 16 64

A target shape no GPU run has timed (bench.py times the 32B one last, `LATE_SHAPES`) is estimated
from the 7B shape's passes scaled by the weights' bytes (a pass of the family at these sizes reads
its weights once and does FLOPs in proportion to them), and every such row says `target_cost:
estimated`; a measured pass replaces the estimate.

Caveats: the acceptance is against the 1.5B target (the 7B rows reuse it: a 7B target of the family
agrees with a 0.5B draft less often), and the costs are random-weight passes with a 200-token context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu.shapes import SHAPES
from benchmarks.models import FEATURE_VOCAB

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "results" / "bench-humaneval" / "records.jsonl"
FEATURE_ACCEPTANCE = ROOT / "docs" / "results" / "feature-draft" / "fused-8" / "acceptance.json"  # the shipped draft
DRAFT = "qwen2.5-0.5b"
FEATURE = "feature"
TARGETS = ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b")
BANDWIDTH_SHAPE = "qwen2.5-7b"  # the pass whose weights' bytes over its time give the bandwidth
BYTES = 2  # bf16


def survival(records: Path, spec: str, temperature: float) -> list[float]:
    """[S_1, S_2, ...]: rounds accepting positions 1..j over rounds that drafted position j."""
    drafted, accepted = [], []
    for line in records.open():
        record = json.loads(line)
        if record["spec"] != spec or record["temperature"] != temperature:
            continue
        stats = record["stats"]
        for j, count in enumerate(stats["drafted_per_position"]):
            if j == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[j] += count
            accepted[j] += stats["accepted_per_position"][j] if j < len(stats["accepted_per_position"]) else 0
    return [a / d for a, d in zip(accepted, drafted) if d]


def feature_survival(path: Path, kind: str = "code") -> list[float]:
    """[S_1, S_2, ...] of the feature draft's free-running rounds (draft_acceptance.py's `reach`)."""
    return json.loads(path.read_text())["drafts"]["feature"][kind]["reach"]


def expected_tokens(survive: list[float]) -> float:
    """E(K) = 1 + sum_j S_j for cumulative survival rates S_1..S_K."""
    return 1.0 + sum(survive)


def batch_sizes(passes: dict) -> list[int]:
    """The session counts bench.py's passes section measured (its keys: `B=4,k=2`)."""
    return sorted({int(key.split(",")[0].split("=")[1]) for key in passes[DRAFT]})


def pass_curve(passes: dict, batch: int, mode: str) -> dict[int, float]:
    """{k: ms} for one batch size from bench.py's passes rows."""
    curve = {}
    for key, row in passes.items():
        b, k = (int(part.split("=")[1]) for part in key.split(","))
        if b == batch and f"{mode}_ms" in row:
            curve[k] = row[f"{mode}_ms"]
    return curve


def interpolate(curve: dict[int, float], k: int) -> float | None:
    if k in curve:
        return curve[k]
    below, above = [x for x in curve if x < k], [x for x in curve if x > k]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo)


def speedup(survive: list[float], k: int, t_draft: float, target: dict[int, float], host_plain: float = 0.0,
            host_round: float = 0.0) -> float | None:
    """E(k) plain steps (each plus `host_plain` ms) over one round (plus `host_round` ms)."""
    verify = interpolate(target, k + 1)
    if verify is None or k > len(survive):
        return None
    return expected_tokens(survive[:k]) * (target[1] + host_plain) / (k * t_draft + verify + host_round)


def overlapped_speedup(survive: list[float], k: int, t_draft: float, target: dict[int, float]) -> float | None:
    """E(k) plain steps over one round with the next drafted while it verifies (module docstring)."""
    verify = interpolate(target, k + 1)
    if verify is None or k + 1 > len(survive):
        return None
    phase = max(verify, (k + 1) * t_draft) + (1.0 - survive[k]) * k * t_draft
    return expected_tokens(survive[:k]) * target[1] / phase


def weight_bytes(name: str) -> int:
    """A shape's weights in bf16: embeddings (and an untied output layer), attention and MLP per layer."""
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = SHAPES[name]
    kv = hidden // heads * kv_heads
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate
    return BYTES * (vocab * hidden * (1 if tied else 2) + layers * layer)


def feature_step_ms(name: str, target_ms: float, bandwidth: float) -> float:
    """The feature draft's step for target shape `name`, estimated: one of the target's layers (its
    captured pass over its layer count) plus the draft's own weights (output rows, fuse and reduce:
    (V_trim + 5 H) H) read at `bandwidth` bytes per ms."""
    hidden, _, layers, *_ = SHAPES[name]
    return target_ms / layers + BYTES * (FEATURE_VOCAB + 5 * hidden) * hidden / bandwidth


def nearest(rows: dict, concurrency: int):
    """The row measured at the concurrency nearest `concurrency` (rows by concurrency; None: none)."""
    return rows[min(rows, key=lambda c: abs(c - concurrency))] if rows else None


def host_per_pass(loop: dict, policy: str, concurrency: int) -> float | None:
    """Host ms per verification pass the loop measured at the nearest concurrency: while decoding
    where the run tells it apart from the prefill (`decode_host_ms_per_target_pass`), else over the run."""
    rows = {row["concurrency"]: row for key, row in loop.items()
            if isinstance(row, dict) and key.startswith(policy + "@") and "host_ms_per_target_pass" in row}
    row = nearest(rows, concurrency)
    return None if row is None else row.get("decode_host_ms_per_target_pass", row["host_ms_per_target_pass"])


def transport_per_step(transport: dict, concurrency: int) -> float | None:
    """The ms per greedy step bench.py's transport section measured the gRPC round services adding,
    at the nearest concurrency (None: not measured). Rows "T=0@C" hold the median of paired steps
    (benchmarks/transport.py); runs before it wrote "C=C" rows of one run's difference."""
    rows = {}
    for key, row in transport.items():
        if key.startswith("T=0@") and "median" in row.get("added", {}):
            rows[int(key.split("@")[1])] = row["added"]["median"]
        elif key.startswith("C=") and "grpc_ms_per_step" in row:
            rows[int(key.split("=")[1])] = row["grpc_ms_per_step"]
    return nearest(rows, concurrency)


LOOPS = ("qwen2.5-1.5b/static", "qwen2.5-1.5b")  # the loop whose host work prices a step: the captured one first


def load_results(*folders: Path) -> tuple[dict, dict, dict, dict]:
    """(passes by shape, loop rows, feature-draft steps by target shape, transport rows) from every
    bench.py JSON in `folders`, folder by folder, each in name order: a later run fills the rows an
    earlier one lacks (a second run may hold only the 32B passes), and its loop and transport rows
    replace the earlier ones. The loop is the static cache's (what a GPU runs) where the run has it."""
    passes, loop, feature, transport = {}, {}, {}, {}
    for path in (path for folder in folders for path in sorted(folder.glob("*.json"))):
        sections = json.loads(path.read_text()).get("sections", {})
        for section, into in (("passes", passes), ("feature", feature)):
            for name, rows in sections.get(section, {}).items():
                if not isinstance(rows, dict):
                    continue
                mine = into.setdefault(name, {})
                for key, row in rows.items():
                    if "captured_ms" not in mine.get(key, {}):
                        mine[key] = row
        loops = sections.get("loop", {})
        loop = next((loops[name] for name in LOOPS if isinstance(loops.get(name), dict) and "error" not in loops[name]),
                    loop)
        transport = next(iter(sections.get("transport", {}).values()), transport)
    return passes, loop, feature, transport


def with_estimated_targets(passes: dict) -> dict:
    """`passes` plus, for each of TARGETS no run timed, the BANDWIDTH_SHAPE's rows scaled by the
    weights' bytes, each row marked `estimated` (module docstring)."""
    if BANDWIDTH_SHAPE not in passes:
        return passes
    filled = dict(passes)
    for name in TARGETS:
        if name in passes:
            continue
        scale = weight_bytes(name) / weight_bytes(BANDWIDTH_SHAPE)
        filled[name] = {key: {**{m: ms * scale for m, ms in row.items() if m.endswith("_ms")}, "estimated": True}
                        for key, row in passes[BANDWIDTH_SHAPE].items()}
    return filled


def target_cost(passes: dict, name: str) -> str:
    """"estimated" for a target shape with_estimated_targets filled in, else "measured"."""
    return "estimated" if any(row.get("estimated") for row in passes.get(name, {}).values()) else "measured"


def bandwidth_of(passes: dict, mode: str) -> float | None:
    """Bytes per ms the 7B shape's one-token pass reached (its weights over its time)."""
    if BANDWIDTH_SHAPE in passes and 1 in pass_curve(passes[BANDWIDTH_SHAPE], 1, mode):
        return weight_bytes(BANDWIDTH_SHAPE) / pass_curve(passes[BANDWIDTH_SHAPE], 1, mode)[1]
    return None


def draft_step(draft_name: str, name: str, batch: int, passes: dict, feature: dict, target: dict[int, float],
               bandwidth: float | None, mode: str) -> tuple[float, str] | None:
    """(a drafting step's ms at `batch` sessions beside target shape `name`, "measured" or "estimated")."""
    if draft_name == FEATURE:
        measured = feature.get(name, {}).get(f"B={batch}", {}).get("captured_ms")
        if measured is not None:
            return measured, "measured"
        return None if bandwidth is None else (feature_step_ms(name, target[1], bandwidth), "estimated")
    draft = pass_curve(passes[draft_name], batch, mode).get(1)
    return None if draft is None else (draft, "measured")


def project(passes: dict, loop: dict, feature: dict, acceptance: dict, mode: str, transport: dict = {}) -> list[dict]:
    """One row per (draft, target, temperature, concurrency): the best fixed K and its speedup, with
    the loop's host work on both sides (`speedup_with_host`) and, served, the round transport's ms
    per step on the speculative side (`speedup_served`: against plain decoding in process).
    `acceptance`: {(draft, temperature): [S_1, ...]}; `feature`: bench.py's feature-draft steps."""
    bandwidth = bandwidth_of(passes, mode)
    batches = batch_sizes(passes)
    rows = []
    for (draft_name, temperature), survive in acceptance.items():
        for name in TARGETS:
            for batch in batches:
                target = pass_curve(passes.get(name, {}), batch, mode)
                if 1 not in target:
                    continue
                step = draft_step(draft_name, name, batch, passes, feature, target, bandwidth, mode)
                if step is None:
                    continue
                draft, costs = step
                by_k = {k: speedup(survive, k, draft, target) for k in range(1, len(survive) + 1)}
                by_k = {k: s for k, s in by_k.items() if s is not None}
                best = max(by_k, key=by_k.get)
                ahead = {k: overlapped_speedup(survive, k, draft, target) for k in range(1, len(survive))}
                ahead = {k: s for k, s in ahead.items() if s is not None}
                # a feature draft reads the target's states of the candidates: it cannot draft ahead of them
                best_ahead = max(ahead, key=ahead.get) if ahead and batch == 1 and draft_name != FEATURE else None
                host_plain, host_spec = host_per_pass(loop, "target-only", batch), host_per_pass(loop, "fixed", batch)
                with_host = served = None
                if host_plain is not None and host_spec is not None:
                    with_host = speedup(survive, best, draft, target, host_plain, host_spec)
                    wire = transport_per_step(transport, batch)
                    if wire is not None:
                        served = speedup(survive, best, draft, target, host_plain, host_spec + wire)
                rows.append({"draft": draft_name, "target": name, "temperature": temperature, "concurrency": batch,
                             "policy": "best-fixed", "k": best, "speedup": round(by_k[best], 3),
                             "speedup_with_host": None if with_host is None else round(with_host, 3),
                             "speedup_served": None if served is None else round(served, 3),
                             "speedup_overlap": None if best_ahead is None else round(ahead[best_ahead], 3),
                             "k_overlap": best_ahead,
                             "draft_ms": round(draft, 3), "target_ms": round(target[1], 3),
                             "draft_cost": costs, "target_cost": target_cost(passes, name), "by_k": {k: round(by_k[k], 3) for k in (1, 3, 7) if k in by_k}})
    return rows


def step_costs(draft_name: str, name: str, batch: int, passes: dict, feature: dict, bandwidth: float | None,
               mode: str):
    """A step's costs at `batch` sessions as the loop learns them: a drafting step by the sessions it
    advances (the measured batch sizes up to `batch`), a pass by the tokens it feeds (this batch's
    passes of k tokens each: batch * k tokens)."""
    from specdec.cost_profile import CostProfile

    rows = {}
    for b in batch_sizes(passes):
        curve = pass_curve(passes.get(name, {}), b, mode)
        step = draft_step(draft_name, name, b, passes, feature, curve, bandwidth, mode) if 1 in curve else None
        if b <= batch and step is not None:
            rows[b] = step[0]
    target = pass_curve(passes.get(name, {}), batch, mode)
    return CostProfile(t_draft_ms=rows[min(rows)], t_draft_rows_ms=rows, t_target_ms={batch * k: ms for k, ms in target.items()},
                       source=f"{mode} passes, {name}, {batch} sessions")


def replay_rows(passes: dict, feature: dict, replays: dict[str, tuple[Path, Path]], mode: str,
                concurrency: tuple[int, ...] = (1,), loop: dict = {}) -> list[dict]:
    """The default policy per (draft, target, temperature, concurrency), and the best fixed K, both
    replayed over the draft's head validation tokens with the GPU's costs (module docstring); with
    the loop's host work where the run measured it (`speedup_with_host`: target-only's a plain step,
    fixed K's a drafting one, the nearest concurrency)."""
    import torch

    from benchmarks.replay_rules import replay, rules, tables_of
    from specdec.head import load_head

    bandwidth, rows = bandwidth_of(passes, mode), []
    for draft_name, (cache_path, head_path) in replays.items():
        cache, head = torch.load(cache_path, weights_only=True), load_head(head_path)
        tables = {t: tables_of(head, cache["validation"], t, cache.get("label_steps")) for t in (0.0, 1.0)}
        for name, batch in ((name, batch) for name in TARGETS for batch in concurrency):
            target = pass_curve(passes.get(name, {}), batch, mode)
            step = None if 1 not in target else draft_step(draft_name, name, batch, passes, feature, target, bandwidth, mode)
            if step is None:
                continue
            costs = step_costs(draft_name, name, batch, passes, feature, bandwidth, mode)
            policies = rules(head, costs)
            host_plain, host_spec = host_per_pass(loop, "target-only", batch), host_per_pass(loop, "fixed", batch)
            for temperature, responses in tables.items():
                plain = batch / target[1] * 1000.0  # tokens per second of plain decoding at this batch
                speed = {spec: replay(policies[spec], responses, costs, temperature > 0, batch)[0] / plain
                         for spec in policies if spec == "specdec++cost" or spec.startswith("fixed:")}
                fixed = max((s for s in speed if s.startswith("fixed:")), key=speed.get)
                hosted = {}
                if host_plain is not None and host_spec is not None:
                    plain_hosted = batch / (target[1] + host_plain) * 1000.0
                    hosted = {spec: replay(policies[spec], responses, costs, temperature > 0, batch, host_spec)[0]
                              / plain_hosted for spec in ("specdec++cost", fixed)}
                for policy, spec in (("default", "specdec++cost"), ("replay-fixed", fixed)):
                    rows.append({"draft": draft_name, "target": name, "temperature": temperature, "concurrency": batch,
                                 "policy": policy, "k": None if policy == "default" else int(spec.split(":")[1]),
                                 "speedup": round(speed[spec], 3),
                                 "speedup_with_host": round(hosted[spec], 3) if spec in hosted else None,
                                 "draft_ms": round(step[0], 3),
                                 "target_ms": round(target[1], 3), "draft_cost": step[1],
                                 "target_cost": target_cost(passes, name), "responses": len(responses)})
    return rows


def parse_replay(value: str) -> tuple[str, tuple[Path, Path]]:
    draft, _, paths = value.partition("=")
    cache, _, head = paths.partition(",")
    if draft not in (DRAFT, FEATURE) or not cache or not head:
        raise argparse.ArgumentTypeError(f"--replay wants {DRAFT}|{FEATURE}=CACHE,HEAD, not {value!r}")
    return draft, (Path(cache).expanduser(), Path(head).expanduser())


def ms(row: dict, role: str) -> str:
    """A row's draft or target ms for the table, `(est.)` where it is estimated."""
    return f"{row[role + '_ms']:.2f}" + (" (est.)" if row[role + "_cost"] == "estimated" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+",
                        help="folders of bench.py results (*.json), merged in order (a later run's loop and "
                             "transport replace an earlier one's)")
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--spec", default="fixed:14", help="the run whose rounds give the 0.5B draft's acceptance")
    parser.add_argument("--feature-acceptance", type=Path, default=FEATURE_ACCEPTANCE,
                        help="benchmarks/draft_acceptance.py's JSON (the feature draft's rounds)")
    parser.add_argument("--mode", default="captured", choices=("captured", "static", "runtime", "runtime_static"),
                        help="which pass costs (bench.py's passes section): the static cache's pass captured or "
                             "eager, the runtime on its slot cache, or on its static cache (default pair only)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    parser.add_argument("--replay", type=parse_replay, action="append", default=[],
                        help="DRAFT=CACHE,HEAD: project the default policy by replaying the head's "
                             "validation tokens (module docstring); repeat per draft")
    parser.add_argument("--replay-concurrency", type=int, nargs="+", default=[1],
                        help="sessions decoding in lock-step in the replay (each a row)")
    args = parser.parse_args()
    passes, loop, feature, transport = load_results(*args.results)
    passes = with_estimated_targets(passes)
    acceptance = {(DRAFT, t): survival(args.records, args.spec, t) for t in (0.0, 1.0)}
    if args.feature_acceptance.is_file():
        acceptance[(FEATURE, 0.0)] = feature_survival(args.feature_acceptance)
    rows = project(passes, loop, feature, acceptance, args.mode, transport)
    replayed = replay_rows(passes, feature, dict(args.replay), args.mode, tuple(args.replay_concurrency), loop)
    if args.json:
        for row in rows + replayed:
            print(json.dumps(row))
        return
    print(f"acceptance: 0.5B {args.records.relative_to(args.records.parents[2])} {args.spec}; feature "
          f"{args.feature_acceptance.relative_to(ROOT) if args.feature_acceptance.is_relative_to(ROOT) else args.feature_acceptance}"
          f" (free-running, code); costs: {args.mode} passes (feature draft: measured where bench.py timed it, "
          f"else estimated; a target shape no run timed: the {BANDWIDTH_SHAPE} passes scaled by weight bytes, est.)\n")
    print("| draft | target | T | C | draft ms | target ms k=1 | K=1 | K=3 | K=7 | best K | speedup | +host | served "
          "| overlap (K) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [f"{row['by_k'][k]:.2f}x" if k in row["by_k"] else "-" for k in (1, 3, 7)]
        host, served = (f"{row[key]:.2f}x" if row[key] is not None else "-" for key in ("speedup_with_host", "speedup_served"))
        overlap = f"{row['speedup_overlap']:.2f}x ({row['k_overlap']})" if row["speedup_overlap"] is not None else "-"
        print(f"| {row['draft']} | {row['target']} | {row['temperature']:g} | {row['concurrency']} | "
              f"{ms(row, 'draft')} | {ms(row, 'target')} | " + " | ".join(cells) +
              f" | {row['k']} | {row['speedup']:.2f}x | {host} | {served} | {overlap} |")
    for (draft, temperature), survive in acceptance.items():
        print(f"\nS_j {draft} T={temperature:g}:", ", ".join(f"{s:.3f}" for s in survive))
    if replayed:
        print(f"\nreplayed over the heads' validation tokens ({', '.join(f'{d}: {c.name}' for d, (c, _) in args.replay)})"
              ":\n\n| draft | target | T | C | draft ms | target ms | policy | speedup | +host |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for row in replayed:
            policy = row["policy"] + (f" (K={row['k']})" if row["k"] else "")
            host = f"{row['speedup_with_host']:.2f}x" if row["speedup_with_host"] is not None else "-"
            print(f"| {row['draft']} | {row['target']} | {row['temperature']:g} | {row['concurrency']} | "
                  f"{ms(row, 'draft')} | {ms(row, 'target')} | {policy} | {row['speedup']:.2f}x | {host} |")


if __name__ == "__main__":
    main()
