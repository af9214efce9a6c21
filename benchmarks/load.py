"""Load on the served app: N concurrent streaming clients for T seconds on loopback.

    python -m benchmarks.load --tiny --clients 8 --seconds 60                   # load
    python -m benchmarks.load --tiny --clients 32 --seconds 30 --max-ongoing 4 --max-queued 4   # overload
    python -m benchmarks.load --tiny --clients 8 --seconds 600 --sample-s 15    # soak (memory over time)
    python -m benchmarks.load --grpc HOST:9000 --clients 8 --seconds 60         # a running server

Each client streams one greedy request after another (prompts in turn) through the project's
async clients, with retries off, so every refusal is counted. Printed: requests, tokens,
throughput, p50/p99 of latency (request to last chunk) and of the first chunk, errors by status,
and tokens lost: every greedy stream of a prompt must carry exactly the tokens of that prompt's
other streams (and, with --tiny, of the in-process engine); any difference counts its tokens as
lost. With --tiny the app runs here on tiny random models, and the resident memory of the Serve
processes is sampled every --sample-s seconds, then the live sessions of every deployment are
read once the load stops (0: every session and cache was freed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clients import ClientError
from clients.grpc_client import AsyncGrpcClient
from clients.http_client import AsyncHttpClient

PROMPTS = ["def fibonacci(n):", "Write a haiku about caches.", "SELECT name FROM users WHERE",
           "class Stack:\n    def push(self, item):", "import numpy as np\n", "// reverse a linked list"]
SERVE_PROCESSES = ("ServeReplica", "ProxyActor", "ServeController")


@dataclass
class LoadReport:
    protocol: str
    clients: int
    seconds: float
    requests: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # code -> its first message
    tokens_lost: int = 0
    mismatched_requests: int = 0
    latency_s: list[float] = field(default_factory=list, repr=False)
    first_chunk_s: list[float] = field(default_factory=list, repr=False)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB)
    live_sessions: dict[str, int] | None = None

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> dict:
        def pct(values: list[float], q: int) -> float | None:
            if not values:
                return None
            return values[0] if len(values) == 1 else statistics.quantiles(values, n=100, method="inclusive")[q - 1]

        record = {key: value for key, value in asdict(self).items() if key not in ("latency_s", "first_chunk_s")}
        return record | {
            "requests_per_s": self.requests_per_s, "tokens_per_s": self.tokens_per_s,
            "latency_p50_s": pct(self.latency_s, 50), "latency_p99_s": pct(self.latency_s, 99),
            "first_chunk_p50_s": pct(self.first_chunk_s, 50), "first_chunk_p99_s": pct(self.first_chunk_s, 99)}


def tokens_lost(got: list, expected: list) -> int:
    """Tokens missing, extra or different: 0 iff equal."""
    same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return max(len(got), len(expected)) - same


async def one_request(client, protocol: str, prompt: str, fields: dict) -> tuple[list, int, float | None]:
    """Streams one request; returns what it carried (token ids over gRPC, characters over HTTP:
    OpenAI's stream has text only), its token count and when its first chunk came."""
    start, first, out, tokens = time.perf_counter(), None, [], 0
    if protocol == "grpc":
        async for chunk in client.generate_stream(prompt, **fields):
            first = first or time.perf_counter() - start
            out.extend(chunk.token_ids)
        return out, len(out), first
    body = {"max_tokens": fields.get("max_new_tokens"), "policy": fields.get("policy"), "k": fields.get("k")}
    async for event in client.complete_stream(prompt, **body):
        first = first or time.perf_counter() - start
        out.extend(c.get("text") or "" for c in event["choices"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return list("".join(out)), tokens, first


async def run_load(address: str, protocol: str, clients: int, seconds: float, fields: dict,
                   prompts: list[str] = PROMPTS, expected: dict[str, list] | None = None,
                   api_key: str | None = None) -> LoadReport:
    """`clients` workers stream requests back to back until `seconds` have passed (a request under
    way then finishes). `expected`: prompt -> its output (token ids over gRPC, characters over
    HTTP, where "tokens lost" counts characters); without it, each prompt's first output is the
    reference."""
    report = LoadReport(protocol, clients, seconds)
    reference = dict(expected or {})
    errors: Counter = Counter()
    deadline = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        make = AsyncGrpcClient if protocol == "grpc" else AsyncHttpClient
        async with make(address, timeout_s=600, api_key=api_key, retries=0) as client:
            turn = index
            while time.perf_counter() < deadline:
                prompt = prompts[turn % len(prompts)]
                turn += 1
                start = time.perf_counter()
                try:
                    out, tokens, first = await one_request(client, protocol, prompt, fields)
                except ClientError as exc:
                    errors[exc.code] += 1
                    report.error_examples.setdefault(exc.code, exc.message)
                    await asyncio.sleep(0.05)  # a refused client does not spin
                    continue
                report.latency_s.append(time.perf_counter() - start)
                if first is not None:
                    report.first_chunk_s.append(first)
                report.requests += 1
                report.tokens += tokens
                lost = tokens_lost(out, reference.setdefault(prompt, out))
                report.tokens_lost += lost
                report.mismatched_requests += bool(lost)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    report.seconds = time.perf_counter() - start
    report.errors = dict(errors)
    return report


# ------------------------------------------------------------------------------------------------
# The Serve processes (same machine)

def serve_rss_mb() -> float:
    """Resident memory of the Serve processes (replicas, proxies, controller) of the Ray instance
    this process started (its descendants: other Ray instances on the machine are not counted), MB."""
    import psutil

    total = 0
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
            if title.startswith("ray::") and any(name in title for name in SERVE_PROCESSES):
                total += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


class RssSampler:
    def __init__(self, every_s: float):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((round(time.perf_counter() - self._start, 1), round(serve_rss_mb(), 1)))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((round(time.perf_counter() - self._start, 1), round(serve_rss_mb(), 1)))


def live_sessions(app_name: str) -> dict[str, int]:
    """Sessions each deployment's replica holds (one replica each), through Serve handles."""
    from ray import serve

    deployed = serve.status().applications[app_name].deployments  # no Coordinator with the loop beside the verifier
    return {name: serve.get_deployment_handle(name, app_name).options(session_id="probe").live_sessions.remote().result()
            for name in ("Coordinator", "Draft", "Verifier") if name in deployed}


def wait_until_idle(app_name: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Live sessions once they are all 0 (released at a request's end, asynchronously), or as they
    are after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        sessions = live_sessions(app_name)
        if not any(sessions.values()) or time.monotonic() > deadline:
            return sessions
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------

def tiny_app(args):
    """Starts the app on tiny models in a local Ray instance; returns (addresses, expected outputs)."""
    import ray

    from services.config import AppConfig, ReplicaConfig
    from services.launch import start
    from specdec.builder import EngineConfig, build_engine
    from specdec.params import build_params
    from tests.tiny import save_tiny_pair

    draft_dir, target_dir = save_tiny_pair(Path(tempfile.mkdtemp()))
    models = EngineConfig(draft=str(draft_dir), target=str(target_dir))
    engine = build_engine(models, progress=False)
    params = build_params(**fields_of(args), chat_template=False)
    expected = {"grpc": {}, "http": {}}
    for prompt in PROMPTS:
        completion = engine.generate(prompt, params).completions[0]
        expected["grpc"][prompt], expected["http"][prompt] = completion.token_ids, list(completion.text)
    replica = {"num_cpus": 0.1, "threads": args.threads}
    bounded = {"num_cpus": 0.0, "max_ongoing_requests": args.max_ongoing}
    config = AppConfig(models=models, draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       coordinator=ReplicaConfig(**bounded), ingress=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=256),
                       max_queued_requests=args.max_queued)
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return start(config, http_port=args.http_port, grpc_port=args.grpc_port), expected


def fields_of(args) -> dict:
    return {"policy": args.policy, "k": args.k, "max_new_tokens": args.max_new_tokens}


def print_report(report: LoadReport) -> None:
    s = report.summary()
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\n{report.protocol}, {report.clients} streaming clients, {report.seconds:.1f} s\n")
    print("| requests | tokens | req/s | tok/s | latency p50 s | p99 s | first chunk p50 s | p99 s | errors | tokens lost |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = ", ".join(f"{code} {count}" for code, count in sorted(report.errors.items())) or "0"
    print(f"| {report.requests} | {report.tokens} | {s['requests_per_s']:.2f} | {s['tokens_per_s']:.1f} | "
          f"{fmt(s['latency_p50_s'])} | {fmt(s['latency_p99_s'])} | {fmt(s['first_chunk_p50_s'])} | "
          f"{fmt(s['first_chunk_p99_s'])} | {errors} | {report.tokens_lost} |")
    if report.rss_mb:
        values = [mb for _, mb in report.rss_mb]
        print(f"\nServe processes' RSS (MB) every sample: {' '.join(f'{mb:.0f}' for mb in values)}"
              f"\nfirst {values[0]:.0f}, last {values[-1]:.0f}, max {max(values):.0f}")
    for code, message in sorted(report.error_examples.items()):
        print(f"{code}: {message}")
    if report.live_sessions is not None:
        print(f"live sessions after the load: {report.live_sessions}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--tiny", action="store_true", help="run the app here on tiny random models")
    target.add_argument("--grpc", default=None, help="a running server's gRPC HOST:PORT")
    target.add_argument("--http", default=None, help="a running server's HTTP URL")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="with --tiny")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--policy", default="fixed")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--api-key", default=None, help="the server's key (default: $SPECDEC_API_KEY)")
    parser.add_argument("--max-ongoing", type=int, default=64, help="--tiny: coordinator max_ongoing_requests")
    parser.add_argument("--max-queued", type=int, default=256, help="--tiny: max_queued_requests")
    parser.add_argument("--threads", type=int, default=1, help="--tiny: torch threads per replica")
    parser.add_argument("--sample-s", type=float, default=5.0, help="--tiny: seconds between RSS samples")
    parser.add_argument("--http-port", type=int, default=18000)
    parser.add_argument("--grpc-port", type=int, default=19000)
    parser.add_argument("--out", default=None, help="write the report as JSON")
    args = parser.parse_args()

    fields = fields_of(args)
    if not args.tiny:
        protocol, address = ("grpc", args.grpc) if args.grpc else ("http", args.http)
        report = asyncio.run(run_load(address, protocol, args.clients, args.seconds, fields, api_key=args.api_key))
    else:
        import ray
        from ray import serve

        from services.launch import APP_NAME

        addresses, expected = tiny_app(args)
        try:
            fields = fields | {"chat_template": False} if args.protocol == "grpc" else fields
            with RssSampler(args.sample_s) as rss:
                report = asyncio.run(run_load(addresses[args.protocol], args.protocol, args.clients, args.seconds,
                                              fields, expected=expected[args.protocol], api_key=args.api_key))
            report.rss_mb = rss.samples
            report.live_sessions = wait_until_idle(APP_NAME)
        finally:
            serve.shutdown()
            ray.shutdown()
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report.summary(), indent=2) + "\n")
    return 0 if report.tokens_lost == 0 and report.requests else 1


if __name__ == "__main__":
    sys.exit(main())
