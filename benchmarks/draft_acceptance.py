"""Greedy acceptance per draft position on held-out prompts: the feature draft beside a model draft.

    python -m benchmarks.draft_acceptance --data ~/.cache/specdec/data/feature-draft \
        --feature-draft ~/.cache/specdec/training/feature-draft/fused-1 --model-draft default --k 8 --stride 4 \
        --costs docs/results/feature-draft/costs.json --json docs/results/feature-draft/acceptance.json

The held-out responses are the target's own greedy output (the features dataset's validation split),
so a drafted token is accepted under greedy verification exactly when it equals the response's
next token. Per kind (code: stdlib docstring prompts, prose):
- teacher-forced: at draft position k the earlier tokens are the true ones (the feature draft still
  runs on its own states past position 1: `FeatureDraft.unroll`); a model draft reads the true
  prefix, so its figure is the same at every k;
- free-running: from every `stride`-th response position a round drafts up to K tokens greedily,
  each fed back (the feature draft from the target's features at the round's start); the accepted
  length is the number of leading drafts equal to the response's tokens. From it: the acceptance
  at each position given the earlier ones accepted, and the mean accepted length at each fixed K
  (tokens a round commits: that plus the bonus token).
With --costs (JSON: {"feature": draft step ms, "model": draft step ms, "target": {"k": verify ms}},
from `python -m benchmarks.forward_times`), tokens committed per millisecond of draft plus verify
cost at each K: (E[accepted] + 1) / (K * step + verify(K + 1)).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.models.feature_draft import DraftFeed, stored_inputs
from specdec.models.feature_files import load_feature_draft
from specdec.models.sources import model_identity, resolve_model
from specdec.training.draft import Example, load_examples, make_batch

KINDS = ("code", "prose")


def starts_of(example: Example, stride: int) -> list[int]:
    """Round starts t (the target's features end at t, x_{t+1} is known): every stride-th position
    whose first draft x_{t+2} is a response token inside the sequence."""
    return list(range(max(example.prompt_length - 2, 0), len(example.tokens) - 2, stride))


@torch.inference_mode()
def feature_teacher_forced(model, example: Example, k: int) -> list[tuple[int, int]]:
    """[(matches, positions)] per draft position 1..k at response positions, in the model's own
    precision (training's `batch_loss` counts the same under bfloat16 autocast)."""
    batch = make_batch([example], model.config.inputs, len(model.config.layers), "cpu")
    outs = model.unroll(batch.states.float(), batch.tokens, k)
    truth = batch.next_ids[0, 1:]  # x_{p+2}, -1 past the end
    p = torch.arange(len(truth))
    out = []
    for j, state in enumerate(outs, start=1):
        drafted = model.vocab_ids[model.logits(state[0, :-1]).argmax(-1)]  # state at p drafts x_{p+2}
        mask = (p >= j - 1) & (p + 2 >= example.prompt_length) & (truth >= 0)
        out.append((int(((drafted == truth) & mask).sum()), int(mask.sum())))
    return out


@torch.inference_mode()
def feature_free_running(model, example: Example, k: int, stride: int) -> list[int]:
    """Accepted length of a round from each start (drafting stops at the first miss: greedy
    verification commits nothing after it)."""
    inputs = stored_inputs(example.states, model.config.inputs, len(model.config.layers))
    g_all = model.feature(inputs.float())  # [T, H]
    ids = example.tokens.tolist()
    session, held, lengths = model.new_session(), 0, []
    for t in starts_of(example, stride):
        # the target's features at positions held..t, each with the token after it
        state = model.forward_feeds([DraftFeed(session, g_all[held:t + 1], ids[held + 1:t + 2])])[-1]
        held = t + 1
        accepted, truth = 0, ids[t + 2:t + 2 + k]
        for j in range(len(truth)):
            token = int(model.vocab_ids[model.logits(state).argmax()])
            if token != truth[j]:
                break
            accepted += 1
            if j + 1 < len(truth):
                state = model.forward_feeds([DraftFeed(session, state[None], [token])])[-1]
        lengths.append(accepted)
        model.rollback(session, held)
    return lengths


@torch.inference_mode()
def model_teacher_forced(model, example: Example) -> tuple[int, int]:
    ids = example.tokens[None]
    logits = model(ids).logits[0, :-1]  # position p predicts x_{p+1}
    drafted, truth = logits.argmax(-1), example.tokens[1:]
    mask = torch.arange(len(truth)) + 1 >= example.prompt_length
    return int(((drafted == truth) & mask).sum()), int(mask.sum())


@torch.inference_mode()
def model_free_running(model, example: Example, k: int, stride: int) -> list[int]:
    from transformers import DynamicCache

    ids = example.tokens.tolist()
    cache, held, lengths = DynamicCache(), 0, []
    for t in starts_of(example, stride):
        # the round knows x_0..x_{t+1}: feed what the cache lacks, then draft greedily
        logits = model(torch.tensor([ids[held:t + 2]]), cache=cache, use_cache=True).logits[0, -1]
        held = t + 2
        accepted, truth = 0, ids[t + 2:t + 2 + k]
        for j in range(len(truth)):
            token = int(logits.argmax())
            if token != truth[j]:
                break
            accepted += 1
            if j + 1 < len(truth):
                logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
        lengths.append(accepted)
        if cache.get_seq_length() > held:
            cache.crop(held - cache.get_seq_length())  # a negative count removes that many positions
    return lengths


def summarise(lengths: list[int], teacher: list[tuple[int, int]], k: int) -> dict:
    n = max(len(lengths), 1)
    reach = [sum(1 for a in lengths if a >= j) / n for j in range(k + 1)]  # P(accepted >= j)
    return {"rounds": len(lengths),
            "teacher_forced": [hit / max(m, 1) for hit, m in teacher],
            "free_running": [reach[j] / reach[j - 1] if reach[j - 1] else 0.0 for j in range(1, k + 1)],
            "reach": reach[1:],
            "mean_accepted": [sum(min(a, K) for a in lengths) / n for K in range(1, k + 1)]}


def tokens_per_ms(summary: dict, step_ms: float, verify_ms: dict[str, float]) -> dict[int, float]:
    out = {}
    for K, accepted in enumerate(summary["mean_accepted"], start=1):
        if str(K + 1) in verify_ms:
            out[K] = (accepted + 1) / (K * step_ms + verify_ms[str(K + 1)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a features dataset (its validation split is read)")
    parser.add_argument("--feature-draft", default=None, help="a trained feature draft's directory")
    parser.add_argument("--feature-format", default="fp32", help="the feature draft's weight format (models/formats.py)")
    parser.add_argument("--model-draft", default=None, help="a model draft source (e.g. default)")
    parser.add_argument("--target", default="default")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="validation sequences per kind")
    parser.add_argument("--costs", default=None, help="JSON of step and verification times (see above)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    manifest, examples = load_examples(Path(args.data).expanduser(), max_tokens=4096, states="lazy")
    held_out = [e for e in examples if e.split == "validation"]
    if args.limit:
        held_out = [e for kind in KINDS for e in [x for x in held_out if x.kind == kind][:args.limit]]
    target_dir = resolve_model(args.target, role="target")
    drafts = {}
    if args.feature_draft:
        from specdec.models.formats import apply_weight_format

        drafts["feature"] = apply_weight_format(load_feature_draft(args.feature_draft, target_dir,
                                                                   model_identity(target_dir)), "draft", args.feature_format)
    if args.model_draft:
        from specdec.builder import load_model

        drafts["model"] = load_model(resolve_model(args.model_draft, role="draft"), "draft", "fp32", progress=False)
    costs = json.loads(Path(args.costs).read_text()) if args.costs else None
    report = {"data": args.data, "k": args.k, "stride": args.stride, "sequences": len(held_out), "drafts": {}}
    for name, model in drafts.items():
        report["drafts"][name] = {}
        for kind in KINDS:
            part = [e for e in held_out if e.kind == kind]
            lengths, teacher = [], [(0, 0)] * args.k
            for e in part:
                if name == "feature":
                    lengths += feature_free_running(model, e, args.k, args.stride)
                    rows = feature_teacher_forced(model, e, args.k)
                else:
                    lengths += model_free_running(model, e, args.k, args.stride)
                    rows = [model_teacher_forced(model, e)] * args.k
                teacher = [(a + c, b + d) for (a, b), (c, d) in zip(teacher, rows)]
            summary = summarise(lengths, teacher, args.k)
            if costs:
                summary["tokens_per_ms"] = tokens_per_ms(summary, costs[name], costs["target"])
            report["drafts"][name][kind] = summary
            print(f"{name} {kind} ({len(part)} sequences, {summary['rounds']} rounds)", flush=True)
            print("  position           " + " ".join(f"{j:>6}" for j in range(1, args.k + 1)))
            print("  teacher-forced     " + " ".join(f"{x:6.3f}" for x in summary["teacher_forced"]))
            print("  free-running       " + " ".join(f"{x:6.3f}" for x in summary["free_running"]))
            print("  mean accepted at K " + " ".join(f"{x:6.2f}" for x in summary["mean_accepted"]))
            if costs:
                print("  tokens/ms at K     " + " ".join(f"{summary['tokens_per_ms'].get(K, float('nan')):6.4f}"
                                                      for K in range(1, args.k + 1)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
