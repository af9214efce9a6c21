"""Transport overhead of one speculation round over gRPC on loopback (a benchmark, not a test).

Tiny random draft/target models, the draft and the verifier each on its own gRPC server on
127.0.0.1, the LocalCoordinator driving rounds. Per RPC it prints the transport time (client wall
time minus the compute time the servicer reports) and the bytes on the wire per round.

    python -m services.bench_transport [--rounds 200] [--vocab 259] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.draft_servicer import DraftServicer
from services.local_coordinator import LocalCoordinator, RoundRecord
from services.server import start_server
from services.verifier_servicer import VerifierServicer
from specdec.params import build_params
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.v1 import draft_pb2_grpc, verifier_pb2_grpc

TINY_VOCAB = 259  # the test suite's byte tokenizer: 256 bytes + 3 special tokens
QWEN_VOCAB = 151_936  # the default pair's vocabulary: what a dense q_i would cost


def tiny_model(vocab: int, hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(name: str, records: list[RoundRecord]) -> None:
    for role in ("draft", "verify"):
        calls = [getattr(r, role) for r in records if getattr(r, role) is not None]
        transport = [c.transport_ms for c in calls]
        print(f"  {name:<22} {role:<7} transport ms mean {statistics.fmean(transport):6.3f}  "
              f"p50 {percentile(transport, 0.5):6.3f}  p90 {percentile(transport, 0.9):6.3f}   "
              f"bytes/round sent {statistics.fmean(c.bytes_sent for c in calls):9.0f}  "
              f"received {statistics.fmean(c.bytes_received for c in calls):9.0f}")
    total = [r.draft.transport_ms + r.verify.transport_ms for r in records if r.draft]
    k = statistics.fmean(r.num_candidates for r in records)
    print(f"  {name:<22} round   transport ms mean {statistics.fmean(total):6.3f}  "
          f"p50 {percentile(total, 0.5):6.3f}   (K mean {k:.2f}, {len(records)} rounds)")


def run(coordinator: LocalCoordinator, rounds: int, **flags) -> list[RoundRecord]:
    records, prompt_index = [], 0
    while len(records) < rounds:
        prompt = [(7 * prompt_index + i) % 200 + 1 for i in range(16)]
        params = build_params(max_new_tokens=64, seed=prompt_index, **flags)
        records += coordinator.generate_ids(prompt, params).rounds
        prompt_index += 1
    return records[:rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=TINY_VOCAB)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--sparsify-below", type=float, default=1e-3,
                        help="min draft prob of the sparsified run (the exact run keeps every nonzero entry)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    draft = DraftRuntime(tiny_model(args.vocab, 16, 1, seed=1))
    target = TargetRuntime(tiny_model(args.vocab, 32, 2, seed=2))
    exact, sparse = DraftServicer(draft), DraftServicer(draft, sparsify_below=args.sparsify_below)
    servers = [start_server(draft=exact), start_server(draft=sparse), start_server(verifier=VerifierServicer(target))]
    channels = [grpc.insecure_channel(address) for _, address in servers]
    verifier = verifier_pb2_grpc.VerifierStub(channels[2])
    coordinators = [LocalCoordinator(draft_pb2_grpc.DraftStub(channel), verifier, max_context=1024)
                    for channel in channels[:2]]
    print(f"gRPC loopback, vocab {args.vocab}, policy fixed k={args.k}, {args.rounds} rounds each "
          f"(after 10 warm-up rounds)")
    cases = [("greedy", coordinators[0], dict(temperature=0.0)),
             ("sampled exact q", coordinators[0], dict(temperature=1.0)),
             (f"sampled q>{args.sparsify_below:g}", coordinators[1], dict(temperature=1.0))]
    try:
        for name, coordinator, flags in cases:
            run(coordinator, 10, policy="fixed", k=args.k, **flags)  # warm up channels and caches
            start = time.perf_counter()
            records = run(coordinator, args.rounds, policy="fixed", k=args.k, **flags)
            summarize(name, records)
            print(f"  {name:<22} wall    {time.perf_counter() - start:.2f} s")
    finally:
        for channel in channels:
            channel.close()
        for server, _ in servers:
            server.stop(None)


if __name__ == "__main__":
    main()
