"""The feature draft's training step with batches of like length against shuffled batches.

    python -m benchmarks.draft_batching --config cluster/training/feature-draft.yaml --batches 4 --repeats 2

Takes the config's features dataset and draft settings, an untrained draft (the work of a step does not
depend on its weights), and `--batches` batches drawn at random (seeded) from epoch 0 in each order
(`epoch_order` with `group_by_length` on and off: in the grouped order a batch's length depends on where
it falls, so a fixed pick would not be typical); times `batch_loss` plus its backward pass (what a training
step runs besides the optimizer) over each order's batches, the two orders interleaved `--repeats` times.
Prints the positions a pass computes over the whole epoch in each order (each batch padded to its
longest sequence), the milliseconds a computed position of the timed batches (median and range over the
repeats) and, from both, the epoch's seconds in each order.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.training.config import load_config
from specdec.training.draft import (batch_loss, build_draft, check_draft_data, epoch_examples, epoch_order, load_examples,
                                    make_batch, trimmed_vocabulary)


def padded_positions(lengths: list[int], order: list[int], batch_size: int) -> int:
    """Positions a pass computes over `order`'s batches, each padded to its longest sequence."""
    return sum(max(lengths[i] for i in order[b:b + batch_size]) * len(order[b:b + batch_size])
               for b in range(0, len(order), batch_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    draft = config.require_draft()
    manifest, identity, target_dir = check_draft_data(config)
    _, examples = load_examples(config.data.dir, draft.max_tokens, states="lazy")
    train = epoch_examples(examples, draft)  # what an epoch of train-draft runs (own_repeats included)
    lengths = [len(e.tokens) for e in train]
    vocab_ids = trimmed_vocabulary(examples, draft.vocab_coverage, draft.vocab_size)
    settings = {"draft": draft.model_dump(), "layers": manifest["settings"]["layers"], "target_identity": identity,
                "target_name": config.models.target}
    model = build_draft(settings, target_dir, vocab_ids)
    orders = {name: epoch_order(lengths, draft.model_copy(update={"group_by_length": grouped}), 0)
              for name, grouped in (("grouped", True), ("shuffled", False))}
    size, layers = draft.batch_size, len(manifest["settings"]["layers"])
    print(f"{len(train)} train sequences, {sum(lengths)} positions, batches of {size}")
    batches, timed = {}, {name: [] for name in orders}
    for name, order in orders.items():
        computed = padded_positions(lengths, order, size)
        print(f"{name}: {computed} positions computed over the epoch ({computed / sum(lengths):.2f}x the sequences')")
        picked = torch.randperm(len(order) // size, generator=torch.Generator().manual_seed(0))[:args.batches]
        batches[name] = [make_batch([train[i] for i in order[b * size:(b + 1) * size]], draft.inputs, layers, "cpu")
                         for b in picked.tolist()]
    for _ in range(args.repeats):
        for name, chosen in batches.items():
            start = time.perf_counter()
            for batch in chosen:
                loss, _ = batch_loss(model, batch, draft)
                model.zero_grad()
                loss.backward()
            computed = sum(batch.tokens.numel() for batch in chosen)
            timed[name].append(1000 * (time.perf_counter() - start) / computed)
    for name, values in timed.items():
        epoch = statistics.median(values) * padded_positions(lengths, orders[name], size) / 1000
        print(f"{name}: {statistics.median(values):.3f} ms a computed position (range {min(values):.3f}-"
              f"{max(values):.3f}); the epoch ~{epoch:.0f} s")


if __name__ == "__main__":
    main()
