"""Forward time of each role per weight format, with a warm KV cache.

    python -m benchmarks.forward_times --role draft --formats fp32 onednn int8 --ks 1 2 4 8 16
    python -m benchmarks.forward_times --role target --formats fp32 onednn --ks 1 2 4 8 16
    python -m benchmarks.forward_times --role draft --formats int8 --vocabs full ascii --ks 1 2 4 8
    python -m benchmarks.forward_times --role target --formats onednn --ks 1 9 --sessions 1 2 4 8 16
    python -m benchmarks.forward_times --role target --formats llamacpp --ks 1 2 4 8 16 --sessions 1 4
    python -m benchmarks.forward_times --role draft --formats llamacpp llamacpp:q4_0 llamacpp:iq4_nl --ks 1
    python -m benchmarks.forward_times --role draft --formats llamacpp --ks 160 --outputs 1 --silent-pass-min 8 100000
    python -m benchmarks.forward_times --role feature-draft --source DIR --formats fp32 onednn int8 --sessions 1 8

`llamacpp` is the llama.cpp runtime on the GGUF file (a format of its own: the weights as shipped);
`llamacpp:TYPE` the GGUF requantized to TYPE (--draft-quant). --silent-pass-min sets the llama.cpp
draft's SILENT_PASS_MIN_TOKENS (a value above the pass size: every token an output, as before it).
Prints a markdown table of median milliseconds for one pass over k tokens after a ~200-token prompt
(the timing itself is specdec/bench/forward.py, which `specdec bench` uses for its t(k) curves).
With --sessions, one ragged pass in which every one of B sessions feeds its k tokens (a batched
draft step is k = 1; a batched verification k = K + 1).

`feature-draft` times a trained feature draft's step (models/feature_draft.py; --source its
directory, the target `default` unless --target): one position per session after a cached prompt,
its layer and its trimmed vocabulary's distribution; --ks is ignored (a step feeds one position).
"""

from __future__ import annotations

import argparse

import torch

from specdec.bench.forward import time_pass
from specdec.builder import draft_vocabulary, load_model
from specdec.models import llamacpp
from specdec.models.llamacpp import LlamaCppOptions, LlamaCppRuntime
from specdec.models.runtime import CausalLMRuntime
from specdec.models.sources import requantize_gguf, resolve_gguf, resolve_model

LLAMACPP = "llamacpp"
FEATURE_DRAFT = "feature-draft"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["draft", "target", FEATURE_DRAFT], required=True)
    parser.add_argument("--source", default="default")
    parser.add_argument("--target", default="default", help="the feature draft's target")
    parser.add_argument("--formats", nargs="+", default=["fp32", "onednn"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--vocabs", nargs="+", default=["full"],
                        help="draft output vocabularies (--draft-vocab values; the draft only)")
    parser.add_argument("--sessions", nargs="+", type=int, default=[1], help="sessions sharing each pass")
    parser.add_argument("--outputs", type=int, default=None, help="outputs read per session (default: all k)")
    parser.add_argument("--silent-pass-min", nargs="+", type=int, default=[llamacpp.SILENT_PASS_MIN_TOKENS],
                        help="llama.cpp: values of SILENT_PASS_MIN_TOKENS to time")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.role == FEATURE_DRAFT:
        return feature_draft_times(args)

    torch_formats = [f for f in args.formats if not f.startswith(LLAMACPP)]
    model_dir = resolve_model(args.source, role=args.role) if torch_formats else None
    print(f"{args.role} {args.source}, {torch.get_num_threads()} threads, median ms per pass")
    vocabs = args.vocabs if args.role == "draft" else ["full"]
    print("| format | vocabulary | sessions | silent pass from | " + " | ".join(f"k={k}" for k in args.ks) + " |")
    print("|---" * (len(args.ks) + 4) + "|")
    for fmt in args.formats:
        for vocab in vocabs if not fmt.startswith(LLAMACPP) else ["full"]:
            silent_mins = [None]
            if fmt.startswith(LLAMACPP):
                source = resolve_gguf(args.source, role=args.role)
                weight_type = fmt.partition(":")[2]
                if weight_type:
                    source = requantize_gguf(source, weight_type)
                runtime = LlamaCppRuntime(source.gguf, options=LlamaCppOptions(), hidden=args.role == "draft")
                size, silent_mins = "full", args.silent_pass_min
            else:
                keep = draft_vocabulary(vocab, model_dir)
                runtime = CausalLMRuntime(load_model(model_dir, args.role, fmt, progress=False, keep_tokens=keep))
                size = f"{len(set(keep))} tokens" if keep is not None else "full"
            for silent_min in silent_mins:
                if silent_min is not None:
                    llamacpp.SILENT_PASS_MIN_TOKENS = silent_min
                for sessions in args.sessions:
                    row = [f"{time_pass(runtime, k, args.repeats, sessions=sessions, outputs=args.outputs) * 1000:.1f}"
                           for k in args.ks]
                    print(f"| {fmt} | {vocab} ({size}) | {sessions} | {silent_min or '-'} | " + " | ".join(row) + " |",
                          flush=True)
            del runtime


def feature_draft_times(args) -> None:
    from pathlib import Path

    from specdec.models.feature_files import load_feature_draft
    from specdec.models.formats import apply_weight_format
    from specdec.models.sources import model_identity

    target_dir = resolve_model(args.target, role="target")
    print(f"feature draft {args.source} on {args.target}, {torch.get_num_threads()} threads, median ms per step")
    print("| format | sessions | step ms |")
    print("|---|---|---|")
    for fmt in args.formats:
        model = load_feature_draft(Path(args.source).expanduser(), target_dir, model_identity(target_dir))
        model = apply_weight_format(model, "draft", fmt)
        for sessions in args.sessions:
            print(f"| {fmt} | {sessions} | {time_feature_step(model, args.repeats, sessions=sessions) * 1000:.2f} |",
                  flush=True)


@torch.inference_mode()
def time_feature_step(model, repeats: int, prompt_tokens: int = 200, sessions: int = 1) -> float:
    """Median seconds of one draft step (one position per session after its cached prompt), its
    distribution over the trimmed vocabulary included; the first step, a warm-up, is not counted."""
    import statistics
    import time

    from specdec.bench.forward import synthetic_tokens
    from specdec.models.feature_draft import DraftFeed

    hidden = model.embed.shape[1]
    vocab = model.config.vocab_size
    held = [model.new_session() for _ in range(sessions)]
    for i, session in enumerate(held):
        model.forward_feeds([DraftFeed(session, torch.randn(prompt_tokens, hidden),
                                       synthetic_tokens(prompt_tokens, vocab, offset=i))])
    times = []
    for r in range(repeats + 1):
        feeds = [DraftFeed(s, torch.randn(1, hidden), synthetic_tokens(1, vocab, offset=31 * (r + 1) + i))
                 for i, s in enumerate(held)]
        start = time.perf_counter()
        states = model.forward_feeds(feeds)
        torch.softmax(model.logits(states).float(), dim=-1).argmax(-1)
        times.append(time.perf_counter() - start)
        for session in held:
            model.rollback(session, prompt_tokens)
    return statistics.median(times[1:])


if __name__ == "__main__":
    main()
