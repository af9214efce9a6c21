"""Host work per step: what the round loop costs besides the forward passes, by concurrency.

    python -m benchmarks.host_work [--concurrency 1 2 4 8 16 32 64] [--policy fixed:4] [--temperatures 0 1]
                                   [--self-draft | --feature-draft] [--vocab 151936] [--out docs/results/host-work/NAME.json]

Tiny random Qwen2 models (a 1-layer draft and a 2-layer target, hidden 16 and 32) with the default
pair's real vocabulary (151,936 tokens) and its tokenizer, so every per-row cost of the step
(softmax, sampling, verification, detokenization) is paid at full size while the passes themselves
cost almost nothing. C prompts of 64 synthetic tokens decode 64 new tokens each in one batch (every
session shares every step), in process (`SpecDecEngine.generate_many`). Host work per step = (wall -
the time inside every forward pass, each returning once its outputs are ready) / the target passes:
on a GPU, the part of a step the device does not do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.models import VOCAB, random_feature_draft, tiny_model

from specdec.bench.forward import TimedForward, synthetic_tokens
from specdec.bench.specs import parse_spec
from specdec.builder import EngineConfig, load_tokenizer, model_dir
from specdec.cost_profile import PROFILE_ENV
from specdec.errors import InvalidRequestError, one_line
from specdec.engine import SpecDecEngine
from specdec.head import AcceptanceHead, HeadConfig
from specdec.loop import BatchConfig
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.params import GenerationParams
from specdec.sampling import SamplingParams

PROMPT_TOKENS, NEW_TOKENS = 64, 64


def measure(engine: SpecDecEngine, timers, concurrency: int, params: GenerationParams, repeats: int) -> dict:
    runs = []
    for r in range(repeats):
        prompts = [synthetic_tokens(PROMPT_TOKENS, engine.target.vocab_size, offset=97 * i + r) for i in range(concurrency)]
        for timer in timers:
            timer.reset()
        start = time.perf_counter()
        results = engine.generate_many(prompts, params)
        wall = time.perf_counter() - start
        steps = timers[-1].calls
        forward = sum(t.seconds for t in timers)
        runs.append({"wall_s": wall, "steps": steps, "forward_s": forward,
                     "host_ms_per_step": 1e3 * (wall - forward) / max(steps, 1),
                     "tokens": sum(x.stats.generated_tokens for x in results)})
    best = min(runs, key=lambda run: run["host_ms_per_step"])
    return {**best, "host_ms_per_step_median": statistics.median(run["host_ms_per_step"] for run in runs),
            "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--policy", default="fixed:4", help="a bench spec: fixed:4, target-only, ...")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the least host work is reported)")
    parser.add_argument("--self-draft", action="store_true",
                        help="the target's own weights draft (greedy accepts every candidate: a budgeted policy "
                             "drafts wherever its cost profile, e.g. SPECDEC_COST_PROFILE, says drafting pays)")
    parser.add_argument("--vocab", type=int, default=VOCAB,
                        help="the models' vocabulary (a small one leaves the step's Python: what a GPU host "
                             "still pays when the per-row work runs as device kernels)")
    parser.add_argument("--feature-draft", action="store_true",
                        help="a random feature draft on the target's states (models/feature_draft.py) in place of "
                             "the model draft: the path's own host work (the states handed over every step)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    if min(args.concurrency + [args.repeats, args.vocab]) < 1:
        parser.error("--concurrency, --repeats and --vocab take numbers of at least 1")
    try:
        policy = parse_spec(args.policy).policy_config()
        if args.out:  # before the minutes of measuring, not after
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.touch()
    except (InvalidRequestError, OSError) as exc:
        parser.error(one_line(exc))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = load_tokenizer(model_dir(EngineConfig(), "target"))
    target_model = tiny_model(32, 2, seed=2, vocab=args.vocab)
    if args.feature_draft:
        from specdec.models.feature_runtime import FeatureDraftRuntime

        draft = FeatureDraftRuntime(random_feature_draft(target_model.config, torch.device("cpu"), torch.float32))
    else:
        draft = DraftRuntime(target_model if args.self_draft else tiny_model(16, 1, seed=1, vocab=args.vocab))
    target = TargetRuntime(target_model)
    torch.manual_seed(0)  # a random acceptance head for the policies that read one: its stops mean nothing, its costs do
    head = AcceptanceHead(HeadConfig(hidden_size=draft.hidden_size, depth=1, draft_identity="host-work")).eval()
    engine = SpecDecEngine(draft, target, tokenizer, head=head,
                           batch=BatchConfig(max_sessions_per_step=max(args.concurrency)))
    # the draft's passes (a feature draft's run through `_outputs`), then the target's: timers[-1] counts the steps
    timers = (TimedForward(draft, "_outputs") if args.feature_draft else TimedForward(draft)), TimedForward(target)
    rows = {}
    print(f"host ms per step ({args.policy}, {NEW_TOKENS} new tokens, least of {args.repeats} runs)")
    print("| concurrency | " + " | ".join(f"T = {t:g}" for t in args.temperatures) + " |")
    print("|---|" + "---|" * len(args.temperatures))
    for temperature in args.temperatures:  # every batch size once, untimed
        params = GenerationParams(max_new_tokens=8, chat_template=False, policy=policy,
                                  sampling=SamplingParams(temperature=temperature, seed=0))
        for c in args.concurrency:
            engine.generate_many([synthetic_tokens(PROMPT_TOKENS, args.vocab, offset=5 + i) for i in range(c)], params)
    for c in args.concurrency:
        cells = []
        for temperature in args.temperatures:
            params = GenerationParams(max_new_tokens=NEW_TOKENS, chat_template=False, policy=policy,
                                      sampling=SamplingParams(temperature=temperature, seed=0))
            row = measure(engine, timers, c, params, args.repeats)
            rows[f"T={temperature:g}@{c}"] = row
            cells.append(f"{row['host_ms_per_step']:.1f}")
        print(f"| {c} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"policy": args.policy, "self_draft": args.self_draft,
                                        "feature_draft": args.feature_draft,
                                        "cost_profile": os.environ.get(PROFILE_ENV), "prompt_tokens": PROMPT_TOKENS,
                                        "new_tokens": NEW_TOKENS, "vocab": args.vocab, "torch_threads": torch.get_num_threads(),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
