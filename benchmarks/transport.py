"""What serving the round loop over gRPC adds to a step, call by call and hop by hop.

    python -m benchmarks.transport [--concurrency 1 8] [--sampled-concurrency 1] [--runs 10] [--new-tokens 160]
                                   [--vocab 151936] [--replica-env NAME=VALUE ...] [--feature-draft [--colocated]]
                                   [--beside] [--out docs/results/transport/NAME.json]

The same loop runs in process (`LocalTransport`) and over our gRPC round services on loopback
(`GrpcTransport` to a draft and a verifier server, each in a process of its own as a replica is:
a gRPC server whose handler hands the batch to the replica's one torch thread and waits for it,
services/replicas.py, then what `DirectTransport` calls once Serve has named a session's replica).
Tiny random Qwen2 weights with the default pair's vocabulary (151,936 tokens) make the passes cheap
and every per-row cost real; the target drafts for itself (fixed K = 4), so every candidate is
accepted and both runs make the same steps: step i of one run is paired with step i of the other.

With `--beside` the served loop runs beside the verifier (AppConfig.loop_placement "verifier",
services/transports.py `BesideTransport`): the target in this process on a torch thread of its own,
as in a Verifier replica, and only the draft's replica in a process of its own; every torch call of
this process then runs on that thread, the in-process loop's too (one OpenMP team), and each of its
calls pays that thread's hop (reported).

With `--feature-draft` a random feature draft drafts on the target's states instead (it accepts
next to nothing, so a step commits one token: what its wire costs, not a speed-up), on a replica of
its own (its states ride with the round calls) or, `--colocated`, beside the target in one replica
(services/replicas.py: only tokens cross).

Runs alternate (in process, served; then served, in process), each decoding `--new-tokens` after a
64-token prompt; a step is timed from one verification's answer to the next (the prefill step is
left out). Reported per temperature and concurrency: ms per step in each mode, the added ms per step
(median of the paired differences, with the 10th-90th percentile), and each served call taken apart
by timestamps on the machine's one monotonic clock:

    client convert   the transport building the protobuf batch and reading the reply (convert.py)
    request hop      from the client's send to the server's handler: serializing, the wire, gRPC's
                     server thread, parsing
    handler          the servicer besides the worker: converting items and answers, the torch thread's hop
    worker           the draft's or verifier's own work (what the in-process call does)
    response hop     from the handler's return to the client holding the reply
    bare call        an empty Release on the same channel: the stack's floor per call

The workers' own time is longer served than in process on a CPU whose cores the three processes
share (an OpenMP team spins a while after its pass, on the cores the next process's pass needs):
"besides the workers' own time" is the added ms per step less that difference, what the wire and
its conversions cost. `--replica-env GOMP_SPINCOUNT=1000` shortens the replicas' spin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.models import VOCAB, padded, random_feature_draft, tiny_model
from specdec.bench.forward import synthetic_tokens
from specdec.calls import LocalTransport
from specdec.engine import SpecDecEngine
from specdec.loop import BatchConfig, RoundLoop
from specdec.metrics import MS_PER_S
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.models.static import StaticOptions
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import SamplingParams

PROMPT_TOKENS, K = 64, 4
SHARE_PASSES = "SPECDEC_BENCH_SHARE_PASSES"  # "0": a verifier replica answers each Verify call alone
BARE_CALLS = 200


@dataclass(frozen=True)
class Pair:
    """How a process makes the pair: `build(*args)` gives the target's weights, which also draft
    (the target drafts for itself), or with `feature` a random feature draft on the target's states
    (benchmarks/models.py `random_feature_draft`, seeded: each process makes the same). Picklable: each
    replica's process makes its own copy."""

    build: Callable[..., torch.nn.Module]  # a module-level function
    args: tuple
    kv: str = "slots"
    static: StaticOptions = StaticOptions()
    feature: bool = False
    pad: int = 0  # the target: the model with this many layers that add nothing (models.py `padded`)

    def runtimes(self) -> tuple[DraftRuntime, TargetRuntime]:
        torch.manual_seed(0)
        model = self.build(*self.args)
        target = TargetRuntime(padded(model, self.pad) if self.pad else model, kv=self.kv, static=self.static)
        if not self.feature:
            return DraftRuntime(model, kv=self.kv, static=self.static), target
        from specdec.models.feature_runtime import FeatureDraftRuntime

        draft = FeatureDraftRuntime(random_feature_draft(model.config, model.device, model.dtype),
                                    kv=self.kv, static=self.static)
        target.read_features(draft.target_layers)
        return draft, target


def tiny_pair(vocab: int, feature: bool = False) -> Pair:
    """The CPU benchmark's pair: host_work.py's tiny target (hidden 32, 2 layers)."""
    return Pair(tiny_model, (32, 2, 2, vocab), feature=feature)


# ------------------------------------------------------------------------------------------------
# The replicas' side

def serve_role(roles: tuple[str, ...], pair: Pair, threads: int, pipe) -> None:
    """A replica's process: its workers (the draft, the verifier, or both linked: a feature draft
    beside its target) behind our servicers on a gRPC server of its own, the models on one torch
    thread (services/replicas.py). Each handler call is recorded (role, start, end, the worker's
    ms) and sent on request ("records"); "stop" or the parent's end stops it."""
    from services.server import start_server
    from services.servicers import DraftServicer, VerifierServicer
    from specdec.workers import DraftWorker, FeatureLink, VerifierWorker

    torch.set_num_threads(threads)
    draft, target = pair.runtimes()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
    workers = {"draft": DraftWorker(draft), "verifier": VerifierWorker(target)}
    if len(roles) == 2:
        workers["verifier"].link = FeatureLink([workers["draft"]])
    records: list[tuple[str, float, float, float]] = []
    servicers = {}
    for role in roles:
        make, method, work = (DraftServicer, "Propose", "propose") if role == "draft" else \
            (VerifierServicer, "Verify", "verify")
        servicers[role] = servicer = make(workers[role], executor)
        timed(role, workers[role], work, servicer, method, records)
    if "verifier" in servicers:  # benchmarks/shared_passes.py's baseline: each Verify call alone
        servicers["verifier"].batcher.share = os.environ.get(SHARE_PASSES, "1") != "0"
    server, address = start_server(**servicers)
    pipe.send(address)
    with contextlib.suppress(EOFError):
        while (asked := pipe.recv()) in ("records", "batcher"):
            if asked == "records":
                pipe.send(records[:])
                records.clear()
            else:  # the verifier's Verify calls and the passes they took so far
                batcher = servicers["verifier"].batcher
                pipe.send({"calls": batcher.calls, "passes": batcher.passes})
    server.stop(None)


def timed(role: str, worker, work: str, servicer, method: str, records: list) -> None:
    """Record each call of the servicer's `method`: (role, handler start, end, the worker's ms)."""
    worker_ms: list[float] = []
    worker_call, handler = getattr(worker, work), getattr(servicer, method)

    def timed_work(*args, **kwargs):
        start = time.perf_counter()
        try:
            return worker_call(*args, **kwargs)
        finally:
            worker_ms.append((time.perf_counter() - start) * MS_PER_S)

    def timed_handler(request, context):
        start = time.perf_counter()
        reply = handler(request, context)
        records.append((role, start, time.perf_counter(), worker_ms.pop() if worker_ms else 0.0))
        return reply

    setattr(worker, work, timed_work)
    setattr(servicer, method, timed_handler)  # before the server binds the handlers


# ------------------------------------------------------------------------------------------------
# The coordinator's side: the calls timed where the loop makes them

@dataclass
class Call:
    role: str
    start: float
    end: float
    send: tuple[float, float] | None = None  # served: the RPC itself (`_send`)
    num_bytes: int = 0
    worker_s: float | None = None  # a call the loop makes in its process: the worker's own time


@dataclass
class Clock:
    """Wraps a round transport: every Propose and Verify (with items) timed."""

    transport: object
    calls: list[Call] = field(default_factory=list)

    async def propose(self, items, *args, **kwargs):
        return await self._timed("draft", self.transport.propose(items, *args, **kwargs))

    async def verify(self, items, *args, **kwargs):
        if not items:  # a probe of the planner's, no round
            return await self.transport.verify(items, *args, **kwargs)
        return await self._timed("verifier", self.transport.verify(items, *args, **kwargs))

    async def release(self, *args, **kwargs):
        return await self.transport.release(*args, **kwargs)

    async def _timed(self, role: str, call):
        start = time.perf_counter()
        reply = await call
        sends = getattr(remote(self.transport), "sends", None)
        send = sends.pop() if sends else None
        worker_s = reply.calls[0].compute_s if send is None and reply.calls else None
        self.calls.append(Call(role, start, time.perf_counter(), send and send[:2], send[2] if send else 0, worker_s))
        return reply


def remote(transport):
    """The gRPC transport of a served loop (`BesideTransport`'s calls across, or the whole of it)."""
    return getattr(transport, "remote", transport)


def grpc_transport(draft_address: str, verifier_address: str):
    """`GrpcTransport` whose RPCs are timed (start, end, request and reply bytes)."""
    from services.transports import GrpcTransport

    class TimedGrpc(GrpcTransport):
        sends: list[tuple[float, float, int]] = []

        async def _send(self, served_by, owner, method, request, routing_key):
            start = time.perf_counter()
            reply = await super()._send(served_by, owner, method, request, routing_key)
            if method != "Release":
                self.sends.append((start, time.perf_counter(), request.ByteSize() + reply.ByteSize()))
            return reply

    return TimedGrpc(draft_address, verifier_address)


def step_ms(calls: list[Call]) -> list[float]:
    """Each step's ms, from one verification's answer to the next (the first, the prefill's, left out)."""
    ends = [c.end for c in calls if c.role == "verifier"]
    return [(b - a) * MS_PER_S for a, b in zip(ends, ends[1:])]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9),
            "n": len(values)}


def breakdown(calls: list[Call], records: list[tuple[str, float, float, float]], role: str) -> dict:
    """Each served call of `role` taken apart by its server record (the one whose handler ran
    inside the call's RPC); a call made in the loop's process (`--beside`'s Verify) into the
    worker and the torch thread's hop."""
    local = [c for c in calls if c.role == role and c.worker_s is not None]
    if local:
        return {"call": statistics.median((c.end - c.start) * MS_PER_S for c in local),
                "worker": statistics.median(c.worker_s * MS_PER_S for c in local),
                "thread_hop": statistics.median((c.end - c.start - c.worker_s) * MS_PER_S for c in local)}
    parts: dict[str, list[float]] = {"call": [], "client_convert": [], "request_hop": [], "handler": [],
                                     "worker": [], "response_hop": [], "bytes": []}
    pending = sorted(r[1:] for r in records if r[0] == role)
    for call in (c for c in calls if c.role == role and c.send):
        send_start, send_end = call.send
        match = next((r for r in pending if send_start <= r[0] <= send_end), None)
        if match is None:
            continue
        pending.remove(match)
        start, end, worker = match
        for key, value in (("call", call.end - call.start), ("client_convert", (call.end - call.start) - (send_end - send_start)),
                           ("request_hop", start - send_start), ("handler", end - start - worker / MS_PER_S),
                           ("worker", worker / MS_PER_S), ("response_hop", send_end - end)):
            parts[key].append(value * MS_PER_S)
        parts["bytes"].append(call.num_bytes)
    return {key: statistics.median(values) for key, values in parts.items() if values}


# ------------------------------------------------------------------------------------------------
# The runs

async def bare_call_ms(transport) -> dict:
    """An empty Release on the draft server's channel: grpc.aio to a thread-pool server and back."""
    from services.transports import service
    from specdec.v1 import common_pb2

    draft = service("draft")
    times = []
    for _ in range(BARE_CALLS):
        start = time.perf_counter()
        await transport._send(draft, transport._fixed[draft], "Release", common_pb2.SessionRefs(), "probe")
        times.append((time.perf_counter() - start) * MS_PER_S)
    return spread(times[BARE_CALLS // 10:])  # the first calls set the channel up


@contextlib.contextmanager
def replicas(pair: Pair, threads: int, env: dict[str, str] | None = None, colocated: bool = False,
             draft_only: bool = False, start_timeout_s: float = 300.0) -> Iterator[tuple[dict, list]]:
    """A draft and a verifier replica, each in a process of its own (`colocated`: one process
    serving both, linked; `draft_only`: the draft's alone), started with `env` added to this one's
    environment: ({role: address}, the processes' pipes)."""
    context = multiprocessing.get_context("spawn")
    pipes, addresses, processes = [], {}, []
    try:
        layout = [("draft", "verifier")] if colocated else [("draft",)] if draft_only else [("draft",), ("verifier",)]
        for roles in layout:
            pipe, child = context.Pipe()
            process = context.Process(target=serve_role, args=(roles, pair, threads, child), daemon=True)
            with patched_environ(env or {}):  # a spawned process starts with the environment of the moment
                process.start()
            processes.append(process)
            child.close()  # the child's end lives in the child alone: its death reads as end-of-file here
            if not pipe.poll(start_timeout_s):
                raise RuntimeError(f"the {'/'.join(roles)} replica did not start in {start_timeout_s:g} s")
            address = pipe.recv()
            pipes.append(pipe)
            addresses |= {role: address for role in roles}
        yield addresses, pipes
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send("stop")
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


@contextlib.contextmanager
def patched_environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def compare(pair: Pair, cells: list[tuple[float, int]], runs: int, new_tokens: int, vocab: int,
            on_row: Callable[[str, dict], None] = lambda key, row: None, replica_env: dict[str, str] | None = None,
            colocated: bool = False, beside: bool = False) -> dict:
    """The loop in process against served (module docstring), per cell (temperature, concurrency):
    {"bare_call_ms": ..., "T=t@c": row}; `on_row` sees each row as it is measured. `beside`: the
    served loop runs beside the verifier (services/transports.py `BesideTransport`): the target in
    this process on a torch thread of its own, as in a Verifier replica, the draft on its replica."""
    batch = BatchConfig(max_sessions_per_step=max(c for _, c in cells))
    if not beside:
        engine, transport = SpecDecEngine(*pair.runtimes(), batch=batch), None
    else:
        from services.transports import BesideTransport
        from specdec.workers import VerifierWorker

        # Every torch call of this process on one thread, the models' making included, as in a
        # Verifier replica (services/replicas.py): with a second OpenMP team in the process libgomp
        # stops spinning between passes (more OpenMP threads than cores), which slows the in-process
        # loop and, on shared cores, speeds the served one; neither is what a replica does
        # (docs/performance.md, "Served"). The in-process loop's calls then pay a thread hop each,
        # which the row reports.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

        def make() -> tuple[SpecDecEngine, LocalTransport]:
            torch.set_num_threads(threads)
            engine = SpecDecEngine(*pair.runtimes(), batch=batch)
            engine.loop.calls.transport.executor = executor
            return engine, LocalTransport({}, VerifierWorker(pair.runtimes()[1]), executor)

        threads = torch.get_num_threads()
        engine, transport = executor.submit(make).result()
    with replicas(pair, torch.get_num_threads(), replica_env, colocated, beside) as (addresses, pipes):
        remote = grpc_transport(addresses["draft"], addresses.get("verifier"))
        transport = BesideTransport(transport, remote) if beside else remote
        # Nothing drafted ahead: the served steps pair with the in-process ones (LocalTransport: serial).
        served = RoundLoop(Clock(transport), engine.rules, engine.loop.batch.model_copy(update={"overlap": "off"}))
        return asyncio.run(measure(engine, served, pipes, cells, runs, new_tokens, vocab, on_row))


async def measure(engine: SpecDecEngine, served: RoundLoop, pipes: list, cells: list[tuple[float, int]], runs: int,
                  new_tokens: int, vocab: int, on_row: Callable[[str, dict], None]) -> dict:
    local_clock, served_clock = Clock(engine.loop.calls.transport), served.calls.transport
    engine.loop.calls.transport = local_clock
    modes = {"in_process": (engine.loop, local_clock), "served": (served, served_clock)}

    def records() -> list:
        out = []
        for pipe in pipes:
            pipe.send("records")
            out += pipe.recv()
        return out

    results = {"bare_call_ms": await bare_call_ms(remote(served_clock.transport))}
    try:
        for temperature, c in cells:
            params = GenerationParams(max_new_tokens=new_tokens, chat_template=False, policy=PolicyConfig(name="fixed", k=K),
                                      sampling=SamplingParams(temperature=temperature, seed=0))
            steps = {mode: [] for mode in modes}
            calls = {mode: [] for mode in modes}
            diffs, server_records = [], []
            for run in range(runs + 1):  # the first warms up both: graphs, channels, first-use allocations
                prompts = [synthetic_tokens(PROMPT_TOKENS, vocab, offset=97 * i + run) for i in range(c)]
                run_steps = {}
                for mode in (modes if run % 2 == 0 else reversed(modes)):  # alternate who goes first
                    loop, clock = modes[mode]
                    clock.calls.clear()
                    records()  # drop what earlier runs left
                    await asyncio.gather(*(loop.generate(p, params) for p in prompts))
                    run_steps[mode] = step_ms(clock.calls)
                    calls[mode] += clock.calls if run > 0 else []
                    server_records += records() if run > 0 else []
                if run == 0:
                    continue
                for mode in modes:
                    steps[mode] += run_steps[mode]
                if len(run_steps["in_process"]) == len(run_steps["served"]):
                    diffs += [b - a for a, b in zip(run_steps["in_process"], run_steps["served"])]
            key = f"T={temperature:g}@{c}"
            results[key] = row = summary(steps, diffs, calls, server_records)
            on_row(key, row)
    finally:
        await served_clock.transport.close()
    return results


def summary(steps: dict, diffs: list[float], calls: dict, server_records: list) -> dict:
    row = {mode: spread(values) for mode, values in steps.items()}
    row["added"] = spread(diffs) if diffs else {"error": "the modes made different steps"}
    row["calls"] = {role: breakdown(calls["served"], server_records, role) for role in ("draft", "verifier")}
    row["in_process_calls_ms"] = {role: statistics.median(  # the worker's own time
        (c.end - c.start if c.worker_s is None else c.worker_s) * MS_PER_S for c in calls["in_process"] if c.role == role)
        for role in ("draft", "verifier")}
    hops = [(c.end - c.start - c.worker_s) * MS_PER_S for c in calls["in_process"] if c.worker_s is not None]
    row["in_process_thread_hop_ms"] = statistics.median(hops) if hops else 0.0
    if "median" in row["added"]:  # the workers' own time served, slower where the processes share cores, apart
        row["added_besides_workers_ms"] = row["added"]["median"] - sum(
            row["calls"][role].get("worker", 0.0) - row["in_process_calls_ms"][role] for role in row["calls"])
    return row


def print_row(key: str, row: dict, flush: bool = False) -> None:
    added = row["added"]
    cell = (f"{added['median']:.2f} ms [{added['p10']:.2f}, {added['p90']:.2f}] over {added['n']} steps"
            if "median" in added else added["error"])
    besides = row.get("added_besides_workers_ms")
    hop = row.get("in_process_thread_hop_ms", 0.0)
    print(f"{key:8s} in process {row['in_process']['median']:.2f} ms/step, served {row['served']['median']:.2f}: "
          f"added {cell}" + (f"; besides the workers' own time {besides:.2f} ms" if besides is not None else "")
          + (f"; each in-process call's thread hop {hop:.3f} ms" if hop > 0.05 else ""), flush=flush)
    for role, parts in row["calls"].items():
        print(f"    {role:8s} " + "  ".join(f"{name} {value:.0f}" if name == "bytes" else f"{name} {value:.3f}"
                                          for name, value in parts.items())
              + f"  (in process {row['in_process_calls_ms'][role]:.3f} ms)", flush=flush)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="greedy (T = 0) cells")
    parser.add_argument("--sampled-concurrency", type=int, nargs="*", default=[1],
                        help="sampled (T = 1) cells: each candidate's q crosses the wire twice, ~4 MB a session's step")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per mode and cell (after one warm-up)")
    parser.add_argument("--new-tokens", type=int, default=160, help="per run: K + 1 = 5 a step, so 32 steps")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--replica-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment for the replicas' processes only (e.g. GOMP_SPINCOUNT=1000)")
    parser.add_argument("--feature-draft", action="store_true",
                        help="a random feature draft on the target's states in place of the self-draft (it "
                             "accepts next to nothing: the wire's cost, not a speed-up)")
    parser.add_argument("--colocated", action="store_true",
                        help="with --feature-draft: one replica serves the draft beside the target, the states "
                             "handed over in its process (services/replicas.py), instead of one replica each")
    parser.add_argument("--beside", action="store_true",
                        help="the served loop beside the verifier (AppConfig.loop_placement verifier): the target "
                             "in this process on a torch thread of its own, only the draft's calls cross")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    print(f"ms per step, in process against our gRPC round services on loopback (fixed K = {K}, "
          f"{'a feature draft' + (' beside the target' if args.colocated else '') if args.feature_draft else 'self-draft'}"
          f"{', the loop beside the verifier' if args.beside else ''}, "
          f"{args.new_tokens} new tokens, {args.runs} runs each, torch threads {torch.get_num_threads()}); "
          "served calls' parts in ms (medians)")
    cells = [(0.0, c) for c in args.concurrency] + [(1.0, c) for c in args.sampled_concurrency]
    replica_env = dict(pair.split("=", 1) for pair in args.replica_env)
    if args.colocated and not args.feature_draft:
        parser.error("--colocated places a feature draft: add --feature-draft")
    if args.beside and args.colocated:
        parser.error("--beside calls a draft beside the target in process: nothing would cross")
    results = compare(tiny_pair(args.vocab, args.feature_draft), cells, args.runs, args.new_tokens, args.vocab,
                      on_row=lambda key, row: print_row(key, row, flush=True), replica_env=replica_env,
                      colocated=args.colocated, beside=args.beside)
    bare = results["bare_call_ms"]
    print(f"bare call (empty Release): {bare['median']:.3f} ms [{bare['p10']:.3f}, {bare['p90']:.3f}]")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"k": K, "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens,
                                        "vocab": args.vocab, "runs": args.runs, "torch_threads": torch.get_num_threads(),
                                        "replica_env": replica_env, "feature_draft": args.feature_draft,
                                        "colocated": args.colocated, "beside": args.beside,
                                        "rows": results}, indent=1))


if __name__ == "__main__":
    main()
