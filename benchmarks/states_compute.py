"""The feature draft's data: the target's states pass in float32 (onednn) against a bfloat16 copy.

    python -m benchmarks.states_compute --data ~/.cache/specdec/data/feature-draft --shard 100 --rows 4 --repeats 3

Times `training.data.target_states` (what `specdec gen-data` runs per prompt, `data.features.compute`)
on the default target as the engine loads it on the CPU (onednn float32) and on a bfloat16 copy,
interleaved, over the prompt + response of a few rows of a features dataset; then compares the two
passes' states: cosine per kept layer, and the output state's next-token argmax and KL through the
target's LM head. Prints milliseconds a token (median and range) and one line per row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdec.builder import load_model
from specdec.models.sources import resolve_model
from specdec.training.data import read_manifest, read_shard, shard_paths, target_states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a features dataset (its rows' tokens are passed)")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = Path(args.data).expanduser()
    layers = read_manifest(data)["settings"]["layers"]
    table = read_shard(shard_paths(data)[args.shard], columns=["prompt_ids", "response_ids"]).to_pylist()
    rows = [r["prompt_ids"] + r["response_ids"] for r in table if r["response_ids"]][:args.rows]
    target_dir = resolve_model("default", role="target")
    models = {"onednn float32": load_model(target_dir, "target", "auto", progress=False),
              "bfloat16": AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()}
    ms, states = {name: [] for name in models}, {}
    for _ in range(args.repeats):
        for name, model in models.items():
            for i, ids in enumerate(rows):
                start = time.perf_counter()
                states[name, i] = target_states(model, ids, layers).float()
                ms[name].append((time.perf_counter() - start) * 1000 / len(ids))
    print(f"{len(rows)} rows of {[len(ids) for ids in rows]} tokens, {args.repeats} repeats, {args.threads} threads")
    for name, values in ms.items():
        print(f"{name}: {statistics.median(values):.2f} ms a token ({min(values):.2f}-{max(values):.2f})")
    head = models["bfloat16"].lm_head.weight.float()
    for i in range(len(rows)):
        exact, bf16 = states["onednn float32", i], states["bfloat16", i]
        cosine = F.cosine_similarity(exact, bf16, dim=-1).mean(0)
        p, q = (exact[:, -1] @ head.T).log_softmax(-1), (bf16[:, -1] @ head.T).log_softmax(-1)
        agree = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
        kl = F.kl_div(q, p, log_target=True, reduction="batchmean").item()
        print(f"row {i}: cosine per kept state {[round(c, 4) for c in cosine.tolist()]}, "
              f"argmax agrees {agree:.3f}, KL(float32 || bfloat16) {kl:.4f} nats a token")


if __name__ == "__main__":
    main()
