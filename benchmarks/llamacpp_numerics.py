"""Does llama.cpp score a token differently when more tokens share the pass? On the real target:

1. greedy target-only decoding on the llama.cpp runtime (one token a pass) gives each prompt's
   reference sequence;
2. the same sequence is re-scored in passes of 1 + k tokens (as a verification of k candidates
   does), and every position where the argmax differs from the reference token is counted, with the
   reference pass's top-1/top-2 logit gap there (a flip can only happen at a near-tie);
3. greedy speculative decoding (the default policy, fixed:4) is compared with the reference text.

    python -m benchmarks.llamacpp_numerics --limit 20 --out docs/results/llamacpp-numerics.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.bench.prompt_sets import load_prompts
from specdec.builder import EngineConfig, build_engine
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig


def rescore_flips(target, prompt: list[int], generated: list[int], k: int) -> tuple[list[int], list[float], float]:
    """Positions (into `generated`) whose argmax differs when the sequence is fed k tokens a pass, the
    one-token pass's top-2 gap at each, and the largest |logit difference| seen."""
    session = target.new_session()
    one = target.score([session], [prompt], [[]])[0]  # prefill; row 0 scores generated[0]
    rows_k = [one[0]]
    for start in range(0, len(generated) - 1, k):
        chunk = generated[start:start + k]
        logits = target.score([session], [prompt + generated[:start]], [chunk])[0]  # [len(chunk) + 1, V]
        rows_k.extend(logits[1:])
    single = target.new_session()
    rows_1 = [target.score([single], [prompt], [[]])[0][0]]
    for i in range(len(generated) - 1):
        rows_1.append(target.score([single], [prompt + generated[:i + 1]], [[]])[0][0])
    flips, gaps, worst = [], [], 0.0
    for i, (a, b) in enumerate(zip(rows_1, rows_k[: len(rows_1)])):
        worst = max(worst, float((a - b).abs().max()))
        if int(b.argmax()) != int(a.argmax()):
            top = torch.topk(a, 2).values
            flips.append(i)
            gaps.append(float(top[0] - top[1]))
    return flips, gaps, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 5, 9, 17])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    engine = build_engine(EngineConfig(runtime="llamacpp"))
    prompts = [engine.encode_prompt(p) for p in load_prompts(args.prompts)[: args.limit]]
    greedy = GenerationParams(max_new_tokens=args.max_new_tokens)
    records, positions = [], 0
    flips = {k: 0 for k in args.ks}
    for index, prompt in enumerate(prompts):
        reference = engine.generate_ids(prompt, greedy.model_copy(update={"policy": PolicyConfig(name="target-only")}))
        ref_ids = reference.completions[0].token_ids
        record = {"prompt": index, "tokens": len(ref_ids), "rescore": {}}
        positions += len(ref_ids)
        for k in args.ks:
            where, gaps, worst = rescore_flips(engine.target, prompt, ref_ids, k)
            flips[k] += len(where)
            record["rescore"][k] = {"flips": where, "gaps": gaps, "max_abs_logit_diff": worst}
        for name, policy in (("default", PolicyConfig()), ("fixed:4", PolicyConfig(name="fixed", k=4))):
            ids = engine.generate_ids(prompt, greedy.model_copy(update={"policy": policy})).completions[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
            record[name] = {"equal": ids == ref_ids, "first_difference": first}
        records.append(record)
        print(json.dumps(record), flush=True)
    summary = {
        "prompts": len(prompts), "positions": positions,
        "argmax_flips_per_k": {k: flips[k] for k in args.ks},
        "max_abs_logit_diff": max(r["rescore"][k]["max_abs_logit_diff"] for r in records for k in args.ks),
        "largest_gap_at_a_flip": max((g for r in records for k in args.ks for g in r["rescore"][k]["gaps"]), default=None),
        "outputs_equal": {name: sum(r[name]["equal"] for r in records) for name in ("default", "fixed:4")},
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "records": records, "date": time.strftime("%Y-%m-%d")},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
