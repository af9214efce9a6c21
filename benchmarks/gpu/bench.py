"""The GPU benchmark: per-pass costs in the real shapes (eager and captured) and the round loop on
CUDA, written as JSON as it goes (a run cut short keeps what it measured).

    python -m benchmarks.gpu.bench --out docs/results/gpu/DATE      # on a CUDA machine; run.sh wraps it
    python -m benchmarks.gpu.bench --smoke --out /tmp/gpu-smoke     # tiny shapes, any device (a dry run)

(from the repository root). Sections, in order:
- passes: for each shape (shapes.py: the default pair's 0.5B and 1.5B, a 7B target, and a 32B one
  timed after every other section, with what the budget leaves), random bf16 weights, B sessions each holding a 200-token prompt and feeding k tokens:
  `runtime` is the torch runtime on its slot cache (models/runtime.py: one ragged pass, its logits
  left on the device); `static` one pass of the static cache (models/static.py `StaticKV.forward`
  and the LM head over every position, without the runtime's host work) run eagerly; `captured` the
  same pass replayed as the static cache's CUDA graph for its bucket (`StaticKV.captured_pass`);
  `runtime_static` the runtime on that static cache with graphs, its host work included (the
  default pair's shapes only); each a median in ms; `runtime_static_ops` the torch ops that pass
  runs outside its graph (launches and copies the host pays). `graph_vs_eager` is the largest logit difference
  between a replay and the eager pass on fresh ids, `static_vs_runtime` the same between the eager
  static pass and the slot runtime at B = 1 (bf16: expect ~1e-2 of the logits' scale). Off CUDA
  nothing is captured: `captured` is measured only in `--smoke`, padded to its bucket and run eagerly.
- feature: the feature draft's runtime (models/feature_runtime.py: one decoder layer of the target's
  shape, MLP half the target's, 32,768 output rows, random weights) on its static cache for each
  target shape, B sessions at a 200-token context: `eager_ms` one drafting step (`step`, one token
  each), `chain_ms` a chain of its 8 greedy steps (`chain`, models/feature_chain.py) replayed as the
  bucket's CUDA graph, `captured_ms` that over 8 (a step's share; both with the runtime's host work),
  `graph_vs_eager` the largest logit difference between the replayed chain and the eager one. What
  project.py reads in place of its estimate. Off CUDA (`--smoke`) the chain is padded and run eagerly.
- loop: the engine (one round loop, in process; with the static cache and captured graphs, then
  today's slot cache) with a self-draft (the target's own weights draft,
  so greedy accepts every candidate: the ceiling), random prompts, greedy, at concurrency 1-64 for
  target-only, fixed K and the default policy (a random head: its stops mean nothing, its costs
  do). tokens/s, and host time per verification pass: wall minus every forward pass's time; at
  the lowest and highest concurrency, where that time goes (`host_profile`: cProfile's top rows).
  Between the two, `feature`: a random feature draft with its chains captured, beside the target on
  the static cache (it accepts next to nothing: the path and its host work per pass, not a speed-up;
  `draft_ms_per_call` its catch-up pass `_outputs` and its `chain` apart).
- transport: the same loop (fixed K, self-draft, greedy and sampled) in process and over our gRPC
  round services on loopback, each replica in a process of its own (benchmarks/transport.py, whose
  CPU figures are this section's proxy): the added ms per step over paired steps, and each served
  call taken apart hop by hop; then the same with the loop beside the verifier (`/beside`: the
  target in the loop's process, only the draft's replica across; `loop_placement: verifier`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu.shapes import SHAPES, shape_config
from benchmarks.models import random_feature_draft, random_model
from benchmarks.transport import Pair, compare, print_row
from specdec.bench.forward import PROMPT_TOKENS, TimedForward, longest_feed, synthetic_tokens, time_pass
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.runtime import DraftRuntime, Feed, TargetRuntime
from specdec.models.static import GRAPH_TOKENS, StaticOptions, graphs_captured
from specdec.engine import SpecDecEngine
from specdec.loop import BatchConfig
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig

PASS_SHAPES = {"qwen2.5-0.5b": (1, 2, 4), "qwen2.5-1.5b": (1, 2, 4, 8, 16), "qwen2.5-7b": (1, 2, 4, 8, 16),
               "qwen2.5-32b": (1, 2, 4, 8, 16)}  # -> ks
LATE_SHAPES = ("qwen2.5-32b",)  # timed after every other section: a 65 GB model takes what the budget leaves
FEATURE_SHAPES = ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b")  # targets whose feature draft's step is timed
BATCHES = (1, 4, 16, 64)
CACHE_LENGTH = 256  # positions per row of the static cache: the prompt, k tokens, the captured bucket's length
LOOP_SHAPE = "qwen2.5-1.5b"
LOOP_CONCURRENCY = (1, 8, 32, 64)
LOOP_POLICIES = (("target-only", None), ("fixed", 4), ("specdec++cost", None))
LOOP_PROMPT_TOKENS, LOOP_NEW_TOKENS = 64, 128  # decoding measured over at least 128 new tokens
TRANSPORT_CONCURRENCY, TRANSPORT_NEW_TOKENS, TRANSPORT_RUNS = (1, 8), 128, 6
RUNTIME_STATIC_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
GRAPHS = StaticOptions(graphs=True)  # the loop's and the transport's static cache: the builder's default


class Report:
    """The results dict, rewritten to disk after every figure."""

    def __init__(self, path: Path, deadline: float):
        self.path, self.deadline = path, deadline
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}

    def put(self, section: str, key: str, value) -> None:
        self.data["sections"].setdefault(section, {})[key] = value
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def environment(device: torch.device) -> dict:
    import importlib.metadata

    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device)}
    for package in ("grpcio", "protobuf", "pydantic"):  # the transport's stubs need grpcio >= 1.85.1, protobuf 7
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[package] = importlib.metadata.version(package)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def pass_costs(report: Report, name: str, model, ks, batches, device, repeats: int, smoke: bool = False) -> None:
    """Fills report["passes"][name] with {"B=..,k=..": {runtime_ms, static_ms, captured_ms,
    runtime_static_ms, checks}} (the module docstring)."""
    vocab = model.config.vocab_size
    probes = {k: synthetic_tokens(k, vocab, offset=5) for k in ks}  # B = 1's ids for static_vs_runtime
    slots, references, results = TargetRuntime(model), {}, {}
    for batch in batches:
        for k in ks:
            if report.time_left() < 30:
                results[f"B={batch},k={k}"] = {"skipped": "time"}
                continue
            row = results[f"B={batch},k={k}"] = {}
            row["runtime_ms"] = 1e3 * time_pass(slots, k, repeats=repeats, sessions=batch)
            if batch == 1:
                session = slots.new_session()
                slots._forward([Feed(session, synthetic_tokens(PROMPT_TOKENS, vocab), 1)])
                references[k] = slots._forward([Feed(session, probes[k], k)]).logits
            report.put("passes", name, results)
    del slots
    # One runtime on the static cache (`kv="static"`, as the builder makes it, sized for these passes)
    # for the bare passes and the runtime's figures: the runtime's passes replay the bare ones' graphs.
    static = TargetRuntime(model, kv="static", static=StaticOptions(slots=max(batches), capacity=CACHE_LENGTH,
                                                                     graphs=True, pad_off_cuda=smoke))
    kv = static.kv

    def logits(outputs) -> torch.Tensor:  # a static pass's (hidden [B, k, H], states) -> [B, k, V]
        return model.lm_head(outputs[0]).float()

    for batch in batches:
        if report.time_left() < 30:
            break
        sessions = [static.new_session() for _ in range(batch)]
        static._forward([Feed(session, synthetic_tokens(PROMPT_TOKENS, vocab, offset=b), 1)
                         for b, session in enumerate(sessions)])
        for k in ks:
            row = results.get(f"B={batch},k={k}")
            if report.time_left() < 30 or row is None or "skipped" in row:
                continue
            # every pass feeds the k tokens after the prompt: the sessions' lengths stay, and so does the layout
            ids, layout = kv.layout([Feed(session, [0] * k, k) for session in sessions], device)
            ids.random_(0, vocab)
            row["static_ms"] = median_ms(lambda: logits(kv.forward(model, ids, layout)), device, repeats)
            if batch == 1:
                probe = torch.tensor([probes[k]], device=device)
                row["static_vs_runtime"] = max_difference(logits(kv.forward(model, probe, layout))[0], references[k])
            graphed = kv.graphs and not report.data.get("capture_failed")
            if graphed and kv.graph_bucket(batch, k, layout.length) is None:
                row["captured_error"] = "larger than every graph bucket (the runtime runs it eagerly)"
            elif graphed:
                try:
                    captured = kv.captured_pass(model, batch, k, layout.length)

                    def packed(tokens: torch.Tensor) -> torch.Tensor:  # [B, k] ids at the bucket's shape
                        feeds = [Feed(session, ids_b, k) for session, ids_b in zip(sessions, tokens.tolist())]
                        return kv.pack(feeds, captured.sessions, captured.tokens)

                    inputs = packed(ids)
                    row["captured_ms"] = median_ms(lambda: logits(captured.run(inputs)), device, 4 * repeats)
                    fresh = torch.randint(0, vocab, (batch, k), device=device)
                    replayed = logits(captured.run(packed(fresh)))[:batch, :k]
                    row["graph_vs_eager"] = max_difference(replayed, logits(kv.forward(model, fresh, layout)))
                except Exception as exc:  # recorded, not fatal: eager figures still count
                    row["captured_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    report.data["capture_failed"] = row["captured_error"]  # a failed capture can poison the stream
            report.put("passes", name, results)
        del sessions
    # The runtime itself on its static cache: the captured pass with the host work around it (the
    # pass's index tensors, the wait for the pass); the default pair's shapes only (the 7B's
    # projection reads the bare captured pass).
    if name in RUNTIME_STATIC_SHAPES:
        for batch in batches:
            for k in ks:
                row = results.get(f"B={batch},k={k}")
                if report.time_left() < 30 or row is None or "skipped" in row:
                    continue
                try:
                    row["runtime_static_ms"] = 1e3 * time_pass(static, k, repeats=repeats, sessions=batch)
                    row["runtime_static_ops"] = ops_outside_graph(static, k, batch)
                except Exception as exc:  # a first run on a GPU: recorded, the other figures stand
                    row["runtime_static_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    break
                report.put("passes", name, results)


def ops_outside_graph(runtime: TargetRuntime, k: int, sessions: int) -> int:
    """The torch ops one pass of `runtime` on its static cache runs outside its captured graph (each
    a launch or a copy the host pays; its LM head included): B sessions after a prompt each feed k
    tokens. Counted at torch's dispatcher, so the same on the CPU, where the bucket's pass runs eagerly
    in its place (those ops not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specdec.models.static import CapturedPass

    class Count(TorchDispatchMode):
        count, paused = 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not self.paused
            return func(*args, **(kwargs or {}))

    mode, graph = Count(), CapturedPass._forward

    def in_graph(captured):
        mode.paused = True
        try:
            return graph(captured)
        finally:
            mode.paused = False

    held = [runtime.new_session() for _ in range(sessions)]
    prompt = synthetic_tokens(min(PROMPT_TOKENS, runtime.max_context - k - 1), runtime.vocab_size)
    runtime._forward([Feed(session, prompt, 1) for session in held])
    runtime._forward([Feed(session, [1] * k, k) for session in held])  # the bucket captured, untimed
    for session in held:
        runtime.rollback(session, len(prompt))
    CapturedPass._forward = in_graph
    try:
        with mode:
            runtime._forward([Feed(session, [1] * k, k) for session in held])
    finally:
        CapturedPass._forward = graph
    return mode.count


def max_difference(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().cpu(), b.float().cpu()
    return {"max_abs": (a - b).abs().max().item(), "scale": b.abs().max().item(),
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def loop_throughput(report: Report, name: str, model, concurrency, policies, new_tokens: int,
                    kv: str = "slots") -> None:
    """`kv`: the runtimes' cache: `slots` (eager, per-session buffers) or `static` (one preallocated
    cache, drafting steps and verifications replayed as CUDA graphs: models/static.py); `feature`: a
    random feature draft in place of the self-draft (its greedy steps chained on its static cache,
    captured: models/feature_chain.py) beside the target on the static cache too, whose captured
    passes hand out its states (the builder's pairing on a GPU). It accepts next to nothing: its
    rows measure the path and its host work, not a speed-up.

    Per policy and concurrency C (C prompts of LOOP_PROMPT_TOKENS joining at once): a run of one new
    token (the prefill: every prompt in the step's passes) and a run of `new_tokens`; what the second
    adds over the first is decoding (`decode_*`: tokens/s, the target's passes, host ms a pass), the
    first alone the prefill (`prefill_tokens_per_s`). `loop_pass_ms` is the median decoding pass of
    the target as the loop calls it (its runtime's `_forward`, the step's host work around it left
    out), `runtime_pass_ms` the same runtime's pass over C fresh sessions feeding the loop's most
    common k (bench/forward.py `time_pass`), and `loop_vs_runtime` their ratio."""
    config = model.config
    if kv == "feature":
        from specdec.models.feature_runtime import FeatureDraftRuntime

        feature = random_feature_draft(config, model.device, model.dtype)
        draft, target = FeatureDraftRuntime(feature, kv="static", static=GRAPHS), TargetRuntime(model, kv="static",
                                                                                                static=GRAPHS)
    else:  # the self-draft: the target's own weights (one cache each: a static cache is per runtime)
        draft, target = DraftRuntime(model, kv=kv, static=GRAPHS), TargetRuntime(model, kv=kv, static=GRAPHS)
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=config.hidden_size, depth=1, draft_identity="gpu-bench")).eval()
    engine = SpecDecEngine(draft, target, head=head, batch=BatchConfig(max_sessions_per_step=max(concurrency)))
    # the draft's passes, then the target's (a feature draft's run through `_outputs` and `chain`)
    timers = ([TimedForward(draft, "_outputs"), TimedForward(draft, "chain")] if kv == "feature"
              else [TimedForward(draft)]) + [TimedForward(target, describe=longest_feed)]
    report.put("loop", "probe_profile", str(engine.cost_profile()))
    results = {}
    for policy, k in policies:
        params = GenerationParams(max_new_tokens=new_tokens, policy=PolicyConfig(name=policy, k=k), chat_template=False)
        for c in concurrency:
            if report.time_left() < 20:
                results[f"{policy}@{c}"] = {"skipped": "time"}
                continue
            # untimed, the same batch: its graphs (sessions, tokens, lengths) are captured here, not in the run
            warm = [synthetic_tokens(LOOP_PROMPT_TOKENS, config.vocab_size, offset=999 + i) for i in range(c)]
            engine.generate_many(warm, params.model_copy(update={"max_new_tokens": 8}))
            runs = {}
            for label, tokens in (("prefill", 1), ("full", new_tokens)):
                prompts = [synthetic_tokens(LOOP_PROMPT_TOKENS, config.vocab_size, offset=17 * i + tokens)
                           for i in range(c)]
                for timer in timers:
                    timer.reset()
                captured, start = graphs_captured(), time.perf_counter()
                outcomes = engine.generate_many(prompts, params.model_copy(update={"max_new_tokens": tokens}))
                wall = time.perf_counter() - start
                runs[label] = {"wall": wall, "captures": graphs_captured() - captured,
                               "tokens": sum(r.stats.generated_tokens for r in outcomes),
                               "forward": sum(t.seconds for t in timers), "passes": timers[-1].calls,
                               "decoding": [(s, fed) for s, fed in timers[-1].log if fed <= GRAPH_TOKENS[-1]],
                               "accepted": sum(r.stats.accepted_tokens for r in outcomes),
                               "drafted": sum(r.stats.draft_tokens for r in outcomes),
                               "draft_passes": sum(t.calls for t in timers[:-1]),
                               "draft_forward_s": sum(t.seconds for t in timers[:-1]),
                               # per method (a feature draft's catch-up pass and its chain apart)
                               "draft_ms_per_call": {t.inner.__name__: 1e3 * t.seconds / t.calls
                                                     for t in timers[:-1] if t.calls},
                               "target_forward_s": timers[-1].seconds}
            one, full = runs["prefill"], runs["full"]
            decode_s, decode_passes = full["wall"] - one["wall"], full["passes"] - one["passes"]
            row = results[f"{policy}@{c}"] = {
                "concurrency": c, "tokens": full["tokens"], "wall_s": full["wall"],
                "tokens_per_s": full["tokens"] / full["wall"],
                "prefill_tokens_per_s": c * LOOP_PROMPT_TOKENS / one["wall"],
                "decode_tokens_per_s": (full["tokens"] - one["tokens"]) / decode_s,
                "draft_passes": full["draft_passes"], "target_passes": full["passes"],
                "draft_forward_s": full["draft_forward_s"], "target_forward_s": full["target_forward_s"],
                "draft_ms_per_call": full["draft_ms_per_call"],
                "captures": full["captures"],  # graphs captured during the timed run: none once warm
                "host_ms_per_target_pass": 1e3 * (full["wall"] - full["forward"]) / max(1, full["passes"]),
                "decode_host_ms_per_target_pass": 1e3 * (decode_s - full["forward"] + one["forward"]) / max(
                    1, decode_passes),
                "acceptance": full["accepted"] / full["drafted"] if full["drafted"] else None}
            if full["decoding"]:
                fed = statistics.mode(f for _, f in full["decoding"])
                row["loop_pass_ms"] = 1e3 * statistics.median(s for s, _ in full["decoding"])
                row["loop_pass_k"] = fed
                row["runtime_pass_ms"] = 1e3 * time_pass(target, fed, repeats=5, prompt_tokens=LOOP_PROMPT_TOKENS,
                                                         sessions=c)
                row["loop_vs_runtime"] = row["loop_pass_ms"] / row["runtime_pass_ms"]
            if c in (min(concurrency), max(concurrency)) and report.time_left() > 40:
                row["host_profile"] = host_profile(engine, prompts, params, full["passes"])
            report.put("loop", f"{name}/{kv}" if kv != "slots" else name, results)
    engine.close()


def host_profile(engine: SpecDecEngine, prompts, params: GenerationParams, steps: int, rows: int = 25) -> list:
    """Where the host's time goes: the same run once more under cProfile, paused inside the forward
    passes; its `rows` functions of most time of their own, in ms per verification pass ([function,
    calls per pass, ms per pass]; the profiler's own cost inflates Python-heavy rows, so compare
    rows, not these with the run's)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()

    def unprofiled(forward):
        def call(feeds):
            profiler.disable()
            try:
                return forward(feeds)
            finally:
                profiler.enable()
        return call

    runtimes = (engine.draft, engine.target)
    forwards = [runtime._forward for runtime in runtimes]
    for runtime, forward in zip(runtimes, forwards):
        runtime._forward = unprofiled(forward)
    try:
        profiler.runcall(engine.generate_many, prompts, params)
    finally:
        for runtime, forward in zip(runtimes, forwards):
            runtime._forward = forward
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:rows]
    return [[f"{Path(file).name}:{line}({name})", round(calls / max(1, steps), 2), round(1e3 * own / max(1, steps), 4)]
            for (file, line, name), (_, calls, own, _, _) in top]


def transport_overhead(report: Report, shape: dict, device: torch.device, dtype: torch.dtype, concurrency,
                       new_tokens: int, runs: int, kv: str, beside: bool = False) -> None:
    """ms per step the gRPC round transport adds on this host, call by call (benchmarks/transport.py:
    the loop in process against our round services, each replica in a process of its own, greedy
    and sampled, steps paired; `beside`: the served loop beside the verifier, only the draft's
    replica across)."""
    pair = Pair(random_model, (shape, device, dtype), kv=kv, static=GRAPHS)
    results, name = {}, f"{LOOP_SHAPE}/{kv}" + ("/beside" if beside else "")

    def keep(key: str, row: dict) -> None:
        results[key] = row
        report.put("transport", name, results)

    cells = [(0.0, c) for c in concurrency] + [(1.0, min(concurrency))]  # sampled: ~4 MB a session's step
    keep("bare_call_ms", compare(pair, cells, runs, new_tokens, shape.vocab_size, keep, beside=beside)["bare_call_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting new figures after this long")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few repeats: checks the script runs")
    parser.add_argument("--sections", nargs="+", default=["passes", "feature", "loop", "transport"])
    parser.add_argument("--shapes", nargs="+", default=list(PASS_SHAPES), help="the passes section's shapes")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="the passes section's B")
    parser.add_argument("--loop-kv", nargs="+", default=["static", "feature", "slots"],
                        choices=["static", "feature", "slots"],
                        help="the loop section's caches (static: captured graphs on CUDA; feature: a random "
                             "feature draft, its chains captured, beside the target on the static cache too)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = Report(args.out / "results.json", time.monotonic() + args.budget_s)
    report.data["environment"] = environment(device)
    report.data["settings"] = {"batches": args.batches, "shapes": args.shapes, "pass_shapes": PASS_SHAPES, "prompt_tokens": PROMPT_TOKENS,
                               "cache_length": CACHE_LENGTH, "dtype": str(dtype), "loop_shape": LOOP_SHAPE,
                               "loop_concurrency": LOOP_CONCURRENCY, "loop_new_tokens": LOOP_NEW_TOKENS}
    report.save()
    print(json.dumps(report.data["environment"]), flush=True)
    shapes = {name: shape_config(name) for name in SHAPES}
    batches, repeats, concurrency, new_tokens = tuple(args.batches), 10, LOOP_CONCURRENCY, LOOP_NEW_TOKENS
    if args.smoke:
        for config in shapes.values():
            config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512))
        batches, repeats, concurrency, new_tokens = (1, 4), 2, (1, 8), 16
    torch.manual_seed(0)
    def passes(names) -> None:
        for name in names:
            if name not in args.shapes or report.time_left() < 30:
                continue
            start = time.perf_counter()
            model = random_model(shapes[name], device, dtype)
            try:
                pass_costs(report, name, model, PASS_SHAPES[name], batches, device, repeats, args.smoke)
            except Exception as exc:  # recorded: the other shapes and sections still run
                report.put("passes", f"{name}/error", f"{type(exc).__name__}: {exc}"[:500])
            print(f"passes {name}: {time.perf_counter() - start:.0f} s", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if "passes" in args.sections:
        passes([name for name in PASS_SHAPES if name not in LATE_SHAPES])
    if "feature" in args.sections:
        for name in FEATURE_SHAPES:
            if report.time_left() < 30:
                break
            try:
                feature_step_costs(report, name, shapes[name], batches, device, dtype, repeats, args.smoke)
            except Exception as exc:  # recorded: the other sections still run
                report.put("feature", f"{name}/error", f"{type(exc).__name__}: {exc}"[:500])
    if "loop" in args.sections and report.time_left() > 30:
        model = random_model(shapes[LOOP_SHAPE], device, dtype)
        for kv in args.loop_kv:
            if report.time_left() < 30:
                break
            start = time.perf_counter()
            try:
                loop_throughput(report, LOOP_SHAPE, model, concurrency, LOOP_POLICIES, new_tokens, kv)
            except Exception as exc:  # a first run of a path on a GPU: keep what the others measured
                report.put("loop", f"{LOOP_SHAPE}/{kv}", {"error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"loop {LOOP_SHAPE} ({kv}): {time.perf_counter() - start:.0f} s", flush=True)
    if "transport" in args.sections and report.time_left() > 30:
        for kv in (k for k in args.loop_kv if k != "feature"):  # the first cache that runs
            sizes = (((1, 2), new_tokens, 2) if args.smoke else
                     (TRANSPORT_CONCURRENCY, TRANSPORT_NEW_TOKENS, TRANSPORT_RUNS))
            try:
                transport_overhead(report, shapes[LOOP_SHAPE], device, dtype, *sizes, kv)
            except Exception as exc:
                report.put("transport", f"{LOOP_SHAPE}/{kv}", {"error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            if report.time_left() > 30:  # the loop beside the verifier (loop_placement: verifier)
                try:
                    transport_overhead(report, shapes[LOOP_SHAPE], device, dtype, *sizes, kv, beside=True)
                except Exception as exc:
                    report.put("transport", f"{LOOP_SHAPE}/{kv}/beside", {"error": f"{type(exc).__name__}: {exc}"[:500]})
            break
    if "passes" in args.sections:  # the largest shape last: what the budget leaves
        passes(LATE_SHAPES)
    report.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report.save()
    print_summary(report.data)


@torch.inference_mode()
def feature_step_costs(report: Report, name: str, config, batches, device, dtype, repeats: int,
                       smoke: bool = False) -> None:
    """Fills report["feature"][name] with {"B=..": {eager_ms, captured_ms, chain_ms, graph_vs_eager}}
    (the module docstring): B sessions after a PROMPT_TOKENS-token history on the static cache."""
    from specdec.models.feature_runtime import CHAIN_STEPS, FeatureDraftRuntime

    model = random_feature_draft(config, device, dtype)
    options = StaticOptions(slots=max(batches), capacity=CACHE_LENGTH)
    eager = FeatureDraftRuntime(model, kv="static", static=options)
    captured = FeatureDraftRuntime(model, kv="static", static=StaticOptions(
        slots=max(batches), capacity=CACHE_LENGTH, graphs=True, pad_off_cuda=smoke))
    history = synthetic_tokens(PROMPT_TOKENS, config.vocab_size)
    results = {}
    for batch in batches:
        if report.time_left() < 30:
            results[f"B={batch}"] = {"skipped": "time"}
            continue
        row = results[f"B={batch}"] = {}
        sessions = {}
        for runtime in (eager, captured):  # the same start: a scratch history (zero target states)
            sessions[runtime] = [runtime.new_session() for _ in range(batch)]
            first = runtime.start(sessions[runtime], [history] * batch).logits.argmax(-1).tolist()

        def from_start(runtime, run):
            def call():
                for session in sessions[runtime]:
                    runtime.rollback(session, PROMPT_TOKENS - 1)  # the pairs of the history: x_1..x_199
                return run(sessions[runtime])
            return call

        try:
            chained = from_start(captured, lambda s: captured.chain(s, first, CHAIN_STEPS))
            reference = from_start(eager, lambda s: eager.chain(s, first, CHAIN_STEPS))
            a, b = chained(), reference()  # the bucket's graph is captured in the first call (on CUDA)
            row["graph_vs_eager"] = max_difference(torch.stack([o.logits for o in a]), torch.stack([o.logits for o in b]))
            row["eager_ms"] = median_ms(from_start(eager, lambda s: eager.step(s, first)), device, repeats)
            row["chain_ms"] = median_ms(chained, device, repeats)
            row["captured_ms"] = row["chain_ms"] / CHAIN_STEPS
        except Exception as exc:  # recorded: what was measured stands
            row["captured_error"] = f"{type(exc).__name__}: {exc}"[:300]
        report.put("feature", name, results)


def print_summary(data: dict) -> None:
    for name, rows in data["sections"].get("passes", {}).items():
        print(f"\n{name}: ms per pass (runtime / static eager / captured / runtime on its static cache)")
        for key, row in rows.items():
            cells = [f"{row[c]:.2f}" if c in row else "-"
                     for c in ("runtime_ms", "static_ms", "captured_ms", "runtime_static_ms")]
            print(f"  {key:12s} " + " / ".join(cells) + (f"  {row['captured_error'][:80]}" if "captured_error" in row else ""))
    for name, rows in data["sections"].get("feature", {}).items():
        print(f"\nfeature draft for {name}: ms per step (one step eager / a step of the captured chain)")
        for key, row in (rows.items() if isinstance(rows, dict) else []):
            print(f"  {key:6s} " + " / ".join(f"{row[c]:.3f}" if c in row else "-" for c in ("eager_ms", "captured_ms")))
    for name, rows in data["sections"].get("loop", {}).items():
        if not isinstance(rows, dict):
            continue
        draft = "a random feature draft" if name.endswith("/feature") else "self-draft"
        print(f"\nloop {name} ({draft}, greedy): decoding tok/s, host ms a verification pass, the loop's pass "
              f"against its runtime's (ms, k), prefill tok/s")
        for key, row in rows.items():
            if "tokens_per_s" in row:
                ratio = (f"{row['loop_pass_ms']:.2f} / {row['runtime_pass_ms']:.2f} ms (k={row['loop_pass_k']}) "
                         f"{row['loop_vs_runtime']:.2f}x" if "loop_vs_runtime" in row else "-")
                print(f"  {key:20s} {row['decode_tokens_per_s']:8.1f} tok/s  host {row['decode_host_ms_per_target_pass']:.2f} ms"
                      f"  pass {ratio}  prefill {row['prefill_tokens_per_s']:.0f} tok/s"
                      f"  passes {row['draft_passes']}/{row['target_passes']}"
                      + "".join(f"  {method} {ms:.2f} ms" for method, ms in row.get("draft_ms_per_call", {}).items())
                      + (f"  {row['captures']} graphs captured" if row.get("captures") else ""))
                for function, calls, ms in row.get("host_profile", [])[:5]:
                    print(f"      {ms:7.3f} ms  {calls:6.2f} calls  {function}")
    for name, rows in data["sections"].get("transport", {}).items():
        print(f"\ntransport {name}: gRPC round services on loopback against in process, ms per step"
              + (" (the loop beside the verifier: only the Propose crosses)" if name.endswith("/beside") else ""))
        for key, row in rows.items():
            if "added" in row:
                print_row(key, row)
            else:
                print(f"  {key}: {row}")


if __name__ == "__main__":
    main()
