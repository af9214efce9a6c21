"""The round calls as Serve handle calls (`round_transport: serve-grpc`) end to end on the tiny pair:
real Ray Serve, two verifier replicas, one of them killed while sessions share the steps. The
router's ring changes with the replacement, so sessions the survivor held are sent elsewhere: they
move there once, and nothing is left behind (services/transports.py, HandleTransport)."""

from __future__ import annotations

import time

import pytest
import ray
from ray import serve

from engine_backend import local_serve
from services.config import AppConfig, ReplicaConfig
from services.launch import APP_NAME
from specdec.builder import EngineConfig
from specdec.params import build_params
from test_serve_app import LONG, PROMPTS, replica_names, streams_with_a_kill


@pytest.fixture(scope="module")
def served(tiny_pair):
    draft_dir, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(models=EngineConfig(draft=str(draft_dir), target=str(target_dir)), round_transport="serve-grpc",
                       draft=ReplicaConfig(**replica), verifier=ReplicaConfig(num_replicas=2, **replica),
                       coordinator=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64),
                       ingress=ReplicaConfig(num_cpus=0.0, max_ongoing_requests=64))
    with local_serve(config) as addresses:
        yield addresses


def sessions_by_replica(deployment: str) -> dict[str, int]:
    """The sessions each replica of `deployment` holds, by its address (the router finds each one
    for some of 64 session ids)."""
    handle, held = serve.get_deployment_handle(deployment, APP_NAME), {}
    for key in map(str, range(64)):
        address = handle.options(session_id=key).address.remote().result()
        if address not in held:
            held[address] = handle.options(session_id=key).live_sessions.remote().result()
    return held


def test_a_replaced_verifier_leaves_no_session_behind(tiny_engine, served):
    """Eight greedy streams at once; one of the two verifier replicas is killed midway. Every output
    equals the engine's, and once all have ended no replica holds a session: before, the survivor's
    sessions routed to the replacement left their copies until their TTL."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    expected = {prompt: tiny_engine.generate(prompt, build_params(**LONG)).completions[0].token_ids
                for prompt in set(prompts)}
    killed: list[str] = []

    def kill_one() -> None:
        killed.append(replica_names("Verifier")[0])
        ray.kill(ray.get_actor(killed[0], namespace="serve"), no_restart=True)

    results = streams_with_a_kill(served["grpc"], prompts, 40, kill_one)
    for i, prompt in enumerate(prompts):
        assert results[i] == expected[prompt], i
    deadline = time.monotonic() + 180  # the replacement started, known to this process's router, and
    while True:                        # every session released (at each request's end, asynchronously)
        held = sessions_by_replica("Verifier")
        if len(held) == 2 and not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(held) == 2 and not any(held.values()), held
    assert not any(sessions_by_replica("Draft").values())
