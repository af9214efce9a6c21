"""services/autoscaling.py: Draft and Verifier replicas scale on the round calls they serve, which
the `direct` transport's never pass through Serve (the rule, the servicer's count, and a real Serve
app whose Draft deployment scales up under load over the direct transport)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from ray import serve
from ray.serve.config import AutoscalingConfig

from specdec.builder import EngineConfig
from specdec.v1 import draft_pb2, generation_pb2, generation_pb2_grpc
from services.app import _deployment
from services.autoscaling import POLICY, ROUND_CALLS, round_calls_policy
from services.config import AppConfig, ReplicaConfig
from services.launch import APP_NAME
from services.replicas import Draft
from services.servicers import DraftServicer
from engine_backend import local_serve

PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


def context(replicas: int, serve_requests: float, recorded: list[float], target: float = 2.0):
    """The fields of Serve's AutoscalingContext the rule reads."""
    return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas,
                           total_num_requests=serve_requests,
                           aggregated_metrics={ROUND_CALLS: {f"replica-{i}": v for i, v in enumerate(recorded)}},
                           config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target))


def test_direct_round_calls_count_though_serve_saw_none():
    desired, _ = round_calls_policy(context(2, serve_requests=0.0, recorded=[3.0, 3.0]))
    assert desired == 3.0  # 6 calls / 2 per replica


def test_calls_through_serve_are_not_counted_twice():
    desired, _ = round_calls_policy(context(2, serve_requests=4.0, recorded=[2.0, 2.0]))
    assert desired == 2.0


def test_no_recorded_metric_falls_back_to_serves_count():
    ctx = context(1, serve_requests=5.0, recorded=[])
    ctx.aggregated_metrics = None
    assert round_calls_policy(ctx)[0] == 2.5


def test_round_services_get_the_policy_unless_the_config_names_one():
    scaled = ReplicaConfig(autoscaling={"min_replicas": 1, "max_replicas": 2})
    draft = _deployment(Draft, "Draft", scaled, round_service=True)
    assert draft._deployment_config.autoscaling_config.policy.policy_function == POLICY
    own = ReplicaConfig(autoscaling={"min_replicas": 1, "max_replicas": 2, "policy": {
        "policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}})
    kept = _deployment(Draft, "Draft", own, round_service=True)
    assert kept._deployment_config.autoscaling_config.policy.policy_function.endswith("replica_queue_length_autoscaling_policy")


def test_the_servicer_counts_calls_in_flight(tiny_engine):
    from specdec.workers import DraftWorker

    release, entered = threading.Event(), threading.Event()
    executor = ThreadPoolExecutor(max_workers=1)
    executor.submit(lambda: (entered.set(), release.wait(10)))  # the torch thread is busy
    servicer = DraftServicer(DraftWorker(tiny_engine.draft, tiny_engine.head), executor)
    entered.wait(10)
    call = threading.Thread(target=servicer.Propose, args=(draft_pb2.ProposeBatch(), None))
    call.start()
    deadline = time.monotonic() + 10
    while servicer.round_calls != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.round_calls == 1  # waiting for the torch thread counts
    release.set()
    call.join(10)
    assert servicer.round_calls == 0
    executor.shutdown()


@pytest.fixture(scope="module")
def scaling_app(tiny_pair):
    draft_dir, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(
        models=EngineConfig(draft=str(draft_dir), target=str(target_dir)), round_transport="direct",
        draft=ReplicaConfig(autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.2,
                                         "upscale_delay_s": 0.0, "look_back_period_s": 12.0}, **replica),
        verifier=ReplicaConfig(**replica),
        coordinator=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64),
        ingress=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64))
    with local_serve(config, {PUSH_INTERVAL_ENV: "0.5"}) as addresses:  # the replicas' metrics every 0.5 s, not 10
        yield addresses


def draft_replicas() -> int:
    deployment = serve.status().applications[APP_NAME].deployments["Draft"]
    return deployment.replica_states.get("RUNNING", 0)


def test_the_draft_records_its_direct_round_calls_and_scales_up_on_them(scaling_app):
    """Serve's own count sees only each session's address lookup over `direct`; the replica records
    the round calls it serves, and the deployment's policy (services/autoscaling.py, which a failing
    policy would keep at one replica) scales on them."""
    assert draft_replicas() == 1
    draft = serve.get_deployment_handle("Draft", APP_NAME)
    recorded = []
    stop = threading.Event()

    def client():
        with grpc.insecure_channel(scaling_app["grpc"]) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while not stop.is_set():
                stub.Generate(generation_pb2.GenerateRequest(text="def fibonacci(n):", policy="fixed", k=2,
                                                             max_new_tokens=64), timeout=60)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 90
        while (draft_replicas() < 2 or max(recorded, default=0.0) < 1) and time.monotonic() < deadline:
            recorded.append(draft.record_autoscaling_stats.remote().result()[ROUND_CALLS])
            time.sleep(0.1)
        assert draft_replicas() == 2
        assert max(recorded) >= 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
