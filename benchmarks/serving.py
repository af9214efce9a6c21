"""Served vs in-process: tokens/s through Ray Serve (gRPC) against the in-process engine with the
same policy, and the transport each round spends (ms, bytes).

    python -m benchmarks.serving --limit 5 --max-new-tokens 128 --policy svip          # default pair
    python -m benchmarks.serving --tiny --limit 10 --max-new-tokens 200 --policy fixed --k 4
    python -m benchmarks.serving --draft FEATURE_DIR --limit 2 --max-new-tokens 48 --policy fixed --k 2

The two modes run one after the other, never together (they would share the cores). Requests are
sequential (one session at a time), as the in-process engine serves them. Greedy outputs are
checked equal. Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specdec.bench.runner import cpu_name
from specdec.builder import EngineConfig, build_engine
from specdec.params import build_params
from specdec.prompts import humaneval_prompts
from specdec.v1 import generation_pb2, generation_pb2_grpc


def in_process(models: EngineConfig, prompts: list[str], flags: dict, threads: int | None) -> dict:
    engine = build_engine(models.model_copy(update={"threads": threads}), progress=False)
    engine.generate(prompts[0], build_params(**{**flags, "max_new_tokens": 4}))  # warm-up
    outputs, tokens, seconds, rounds, draft_s, target_s = [], 0, 0.0, 0, 0.0, 0.0
    for prompt in prompts:
        result = engine.generate(prompt, build_params(**flags))
        outputs.append(result.completions[0].token_ids)
        tokens += result.stats.generated_tokens
        seconds += result.stats.wall_time_s
        rounds += result.stats.rounds
        draft_s += result.stats.draft_time_s
        target_s += result.stats.target_time_s
    return {"outputs": outputs, "tokens": tokens, "seconds": seconds, "rounds": rounds,
            "draft_ms_per_round": 1000 * draft_s / rounds, "target_ms_per_round": 1000 * target_s / rounds}


def served(models: EngineConfig, prompts: list[str], flags: dict, threads: int | None, transport: str,
           control: bool = False) -> dict:
    """Through the Serve app; with `control`, the in-process engine runs once more afterwards while
    the app sits idle, which prices Ray's own background work (timers, health checks, metrics) apart
    from the serving path's."""
    import ray
    from ray import serve

    from services.config import AppConfig, ReplicaConfig
    from services.launch import start

    config = AppConfig(models=models, round_transport=transport,
                       draft=ReplicaConfig(num_cpus=0.5, threads=threads),
                       verifier=ReplicaConfig(num_cpus=0.5, threads=threads))
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        addresses = start(config, http_port=18000, grpc_port=19000)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addresses["grpc"]))
        fields = {key: value for key, value in flags.items() if value is not None}

        def generate(prompt: str, **override) -> generation_pb2.GenerateResponse:
            return stub.Generate(generation_pb2.GenerateRequest(text=prompt, **{**fields, **override}), timeout=600)

        generate(prompts[0], max_new_tokens=4)  # warm-up
        outputs, tokens, seconds, rounds, transport_s, transport_bytes, draft_s, target_s = [], 0, 0.0, 0, 0.0, 0, 0.0, 0.0
        for prompt in prompts:
            start_s = time.perf_counter()
            response = generate(prompt)
            seconds += time.perf_counter() - start_s  # client-side: proxy, ingress and coordinator included
            outputs.append(list(response.completions[0].token_ids))
            tokens += response.stats.generated_tokens
            rounds += response.stats.rounds
            transport_s += response.stats.transport_time_s
            transport_bytes += response.stats.transport_bytes
            draft_s += response.stats.draft_time_s
            target_s += response.stats.target_time_s
        result = {"outputs": outputs, "tokens": tokens, "seconds": seconds, "rounds": rounds,
                  "draft_ms_per_round": 1000 * draft_s / rounds, "target_ms_per_round": 1000 * target_s / rounds,
                  "transport_ms_per_round": 1000 * transport_s / rounds, "bytes_per_round": transport_bytes / rounds}
        if control:
            result["control"] = in_process(models, prompts, flags, threads)
        return result
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random models (transport overhead)")
    parser.add_argument("--draft", default="default", help="the draft: a model source or a feature draft's directory")
    parser.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"])
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policy", default="svip")
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per model (default: all cores)")
    parser.add_argument("--transport", default="direct", choices=["direct", "serve-grpc", "actor"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--ray-idle-control", action="store_true",
                        help="also time the in-process engine while the Serve app idles (Ray's background cost)")
    args = parser.parse_args()

    if args.tiny:
        from tests.tiny import save_tiny_pair

        draft_dir, target_dir = save_tiny_pair(Path(tempfile.mkdtemp()))
        models = EngineConfig(draft=str(draft_dir), target=str(target_dir))
    else:
        models = EngineConfig(draft=args.draft, runtime=args.runtime)
    prompts = humaneval_prompts(args.limit)
    if args.tiny:  # the tiny models' context is 256 byte tokens
        prompts = [prompt[-48:] for prompt in prompts]
    flags = {"policy": args.policy, "k": args.k, "temperature": args.temperature, "seed": 0,
             "max_new_tokens": args.max_new_tokens}

    local = in_process(models, prompts, flags, args.threads)
    gc.collect()
    remote = served(models, prompts, flags, args.threads, args.transport, args.ray_idle_control)
    same = local["outputs"] == remote["outputs"]
    local_tps, remote_tps = local["tokens"] / local["seconds"], remote["tokens"] / remote["seconds"]
    print(f"\n{'tiny pair' if args.tiny else f'draft {args.draft} on the default target'}, policy {args.policy}"
          f"{'' if args.k is None else f' k={args.k}'}, {len(prompts)} HumanEval prompts x {args.max_new_tokens} "
          f"tokens, temperature {args.temperature}, transport {args.transport}, {cpu_name()}\n")
    print("| mode | tokens | rounds | tok/s | ratio | draft ms/round | target ms/round | transport ms/round | bytes/round |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| in-process | {local['tokens']} | {local['rounds']} | {local_tps:.2f} | 1.00 | "
          f"{local['draft_ms_per_round']:.1f} | {local['target_ms_per_round']:.1f} | - | - |")
    print(f"| served (gRPC) | {remote['tokens']} | {remote['rounds']} | {remote_tps:.2f} | {remote_tps / local_tps:.3f} | "
          f"{remote['draft_ms_per_round']:.1f} | {remote['target_ms_per_round']:.1f} | "
          f"{remote['transport_ms_per_round']:.2f} | {remote['bytes_per_round']:.0f} |")
    control = remote.get("control")
    if control:
        control_tps = control["tokens"] / control["seconds"]
        print(f"| in-process, Ray + Serve app idle | {control['tokens']} | {control['rounds']} | {control_tps:.2f} | "
              f"{control_tps / local_tps:.3f} | {control['draft_ms_per_round']:.1f} | "
              f"{control['target_ms_per_round']:.1f} | - | - |")
        print(f"\nserved / in-process with Ray idle: {remote_tps / control_tps:.3f} (the serving path's own cost)")
    print(f"\ngreedy outputs identical: {same}" if args.temperature == 0 else "")
    if args.out:
        record = {"args": vars(args), "in_process_tok_s": local_tps, "served_tok_s": remote_tps,
                  "ratio": remote_tps / local_tps, "rounds": remote["rounds"],
                  "transport_ms_per_round": remote["transport_ms_per_round"],
                  "bytes_per_round": remote["bytes_per_round"], "outputs_identical": same}
        if control:
            record["in_process_ray_idle_tok_s"] = control_tps
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if same or args.temperature else 1


if __name__ == "__main__":
    sys.exit(main())
