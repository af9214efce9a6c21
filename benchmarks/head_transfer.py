"""Does the shipped head judge a requantized draft's candidates as well as the shipped draft's?

    python -m benchmarks.head_transfer --quants q4_0 iq4_nl \
        --out docs/results/fast-draft/head-transfer-amd.json [--record]

On the validation responses of the head's training data (data/default-pair), on the llama.cpp
runtime: the target's p from one teacher-forced pass, each draft's (the shipped GGUF, then each
requantized one) q and hidden states from one, every label set drawn afresh per draft
(specdec/training/transfer.py). Prints per draft and label temperature the head's AUROC, ECE and
the mean label (the draft's acceptance rate), and the verdict (AUROC within 0.005 of the shipped
draft's, ECE at most 0.03). --record writes each accepted draft into the head's
`validated_drafts` (head.json), so `--draft-quant TYPE` runs with the shipped head.

    python -m benchmarks.head_transfer --quants q4_0 iq4_nl --prompts humaneval --limit 40

does the same on a bench prompt set, with the target's greedy responses (target-only, made first):
the drafts' acceptance rates where the goals are measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from specdec.bench.prompt_sets import load_prompts
from specdec.bench.runner import cpu_name
from specdec.builder import EngineConfig, build_draft, build_engine
from specdec.head import CONFIG_FILE, HeadConfig, load_head
from specdec.heads import AUTO, resolve_head
from specdec.models.sources import SHIPPED
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.training.data import iter_split, load_dataset
from specdec.training.train import label_sampling
from specdec.training.transfer import compare_drafts, validated_draft, verdict


def engine_config(args, quant: str = SHIPPED) -> EngineConfig:
    return EngineConfig(runtime="llamacpp", head="none", threads=args.threads, draft_quant=quant)


def target_responses(engine, prompts: str, limit: int | None, manifest: dict) -> list[dict]:
    """Rows like the dataset's for a bench prompt set: the target's greedy response to each prompt
    (target-only), labelled at the dataset's temperatures (one set at 0, `draws` at each other)."""
    labels = manifest["settings"]["labels"]
    temperatures = [t for t in labels["temperatures"] for _ in range(1 if t == 0 else labels["draws"])]
    params = GenerationParams(max_new_tokens=manifest["settings"]["response"]["max_new_tokens"],
                              policy=PolicyConfig(name="target-only"))
    rows = []
    for i, text in enumerate(tqdm(load_prompts(prompts, limit), desc="target responses", unit="response")):
        prompt = engine.encode_prompt(text)
        response = engine.generate_ids(prompt, params).completions[0].token_ids
        rows.append({"prompt_id": f"{prompts}:{i}", "prompt_ids": prompt, "response_ids": response,
                     "label_temperatures": temperatures})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/default-pair", help="the head's training data (validation split)")
    parser.add_argument("--head", default=AUTO, help="the head (default: the one shipped for the default draft)")
    parser.add_argument("--quants", nargs="+", default=["q4_0"], help="requantized drafts to judge (--draft-quant)")
    parser.add_argument("--prompts", default=None,
                        help="a bench prompt set (humaneval, prose, ...) instead of the validation responses: the "
                             "target's greedy responses to its prompts")
    parser.add_argument("--limit", type=int, default=None, help="first N responses (or prompts) only")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--record", action="store_true", help="add each accepted draft to the head's validated_drafts")
    args = parser.parse_args()

    head_dir = Path(resolve_head(args.head, "default"))
    train = json.loads((head_dir / "training.json").read_text())["train"]
    manifest, rows = load_dataset(args.data)
    engine = build_engine(engine_config(args))
    if args.prompts:
        rows = target_responses(engine, args.prompts, args.limit, manifest)
    else:
        rows = [r for r in iter_split(rows, "validation") if r["response_ids"]][:args.limit]
    drafts = {SHIPPED: engine.draft, **{name: build_draft(engine_config(args, name))[0] for name in args.quants}}
    head = load_head(head_dir, draft_identity=drafts[SHIPPED].identity)
    start = time.perf_counter()
    results = compare_drafts(head, engine.target, drafts, tqdm(rows, desc="responses", unit="response"),
                             lambda row: [label_sampling(manifest, t) for t in row["label_temperatures"]],
                             train["mixing_ratio"], train["mixing_seed"], manifest["settings"]["seed"])
    reference = results[SHIPPED]["all"]
    print(f"{len(rows)} responses ({args.prompts or 'validation'}), {time.perf_counter() - start:.0f} s\n")
    print("| draft | labels | tokens | acceptance (mean label) | head AUROC | head ECE | accepted |")
    print("|---|---|---|---|---|---|---|")
    for name, metrics in results.items():
        ok = "-" if name == SHIPPED else ("yes" if verdict(reference, metrics["all"]) else "**no**")
        for part, m in metrics.items():
            print(f"| {name} | {part} | {m['count']} | {m['mean_label']:.4f} | {m['auroc']:.4f} | {m['ece']:.4f} | "
                  f"{ok if part == 'all' else ''} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"responses": len(rows), "prompts": args.prompts or "validation",
                                        "head": str(head_dir), "results": results,
                                        "identities": {n: d.identity for n, d in drafts.items()}}, indent=2) + "\n")
    if args.record and not args.prompts:  # only the head's validation tokens decide
        config = HeadConfig.model_validate(json.loads((head_dir / CONFIG_FILE).read_text()))
        kept = [v for v in config.validated_drafts if v.identity not in {d.identity for d in drafts.values()}]
        source = f"benchmarks/head_transfer.py, {time.strftime('%Y-%m-%d')}, {cpu_name()}"
        accepted = [validated_draft(drafts[n].identity, f"default --draft-quant {n}", reference, results[n]["all"],
                                    source) for n in args.quants if verdict(reference, results[n]["all"])]
        config.validated_drafts = kept + accepted
        (head_dir / CONFIG_FILE).write_text(config.model_dump_json(indent=2) + "\n")
        print(f"\nrecorded in {head_dir / CONFIG_FILE}: {[v.name for v in accepted] or 'none accepted'}")


if __name__ == "__main__":
    main()
