"""A served loop's live cap follows the replicas that hold its sessions (services/config.py LiveCap):
real Ray Serve, the draft and the verifier autoscaled from 1 to 2 replicas and started at 2. Before,
the cap counted them at their fewest whatever ran, so multi-gpu.yaml's 8 coordinators decoded 64
sessions in all on up to 8 verifiers of 64 rows each."""

from __future__ import annotations

import time

import grpc
import pytest
from ray import serve

from engine_backend import local_serve
from services.app import live_cap
from services.config import AppConfig, ReplicaConfig, SessionConfig
from services.launch import APP_NAME
from specdec.builder import EngineConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc

SCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2, "downscale_delay_s": 600}


@pytest.fixture(scope="module")
def scaled(tiny_pair):
    _, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1, autoscaling=SCALING)
    config = AppConfig(models=EngineConfig(draft="suffix", target=str(target_dir)),
                       sessions=SessionConfig(max_sessions=8),
                       draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       coordinator=ReplicaConfig(num_cpus=0.0), ingress=ReplicaConfig(num_cpus=0.0))
    with local_serve(config) as addresses:
        yield config, addresses


def test_a_loops_live_cap_rises_with_the_replicas_running(scaled):
    config, addresses = scaled
    cap = live_cap(config)
    at_fewest, at_two = cap.batch(config.models.batch), cap.batch(config.models.batch, running=2)
    assert at_two.max_live_sessions > at_fewest.max_live_sessions  # (else the test shows nothing)
    limits = serve.get_deployment_handle("Coordinator", APP_NAME).live_limits
    assert limits.remote().result() == (at_fewest.max_live_sessions, at_fewest.max_live_positions)
    with grpc.insecure_channel(addresses["grpc"]) as channel:  # the loop follows from its first request
        response = generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(text="def fibonacci(n):", max_new_tokens=8), timeout=60)
    assert len(response.completions[0].token_ids) == 8
    deadline = time.monotonic() + 30
    while limits.remote().result()[0] != at_two.max_live_sessions and time.monotonic() < deadline:
        time.sleep(0.5)
    assert limits.remote().result() == (at_two.max_live_sessions, at_two.max_live_positions)
