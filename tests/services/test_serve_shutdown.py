"""Stopping the served app with requests in flight (`specdec serve`'s Ctrl-C / SIGTERM deletes it):
the requests finish first, as docs/serving.md says. Serve drains the calls that pass through it;
the draft and verifier replicas' round calls (`round_transport: direct`) do not, and those replicas
stopped at once, so every generation in flight stalled (until the client's deadline) and the app's
deletion never ended while its coordinator waited for them."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from engine_backend import local_serve
from services.config import AppConfig, ReplicaConfig
from services.launch import APP_NAME, delete_app
from specdec.builder import EngineConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc

SAMPLES, TOKENS = 4, 150  # a few seconds a request on the tiny models


@pytest.fixture(scope="module")
def served(tiny_pair):
    draft_dir, target_dir = tiny_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(models=EngineConfig(draft=str(draft_dir), target=str(target_dir)),
                       draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       # (bounded, so that a failing run ends soon: the generations need a few seconds)
                       coordinator=ReplicaConfig(num_cpus=0.0, graceful_shutdown_timeout_s=60),
                       ingress=ReplicaConfig(num_cpus=0.0, graceful_shutdown_timeout_s=60))
    with local_serve(config) as addresses:
        yield addresses, config


def test_deleting_the_app_lets_the_generations_in_flight_finish(served):
    addresses, config = served
    results: dict[int, object] = {}
    started = threading.Barrier(3)

    def stream(i: int) -> None:
        request = generation_pb2.GenerateRequest(text=f"prompt {i}", policy="fixed", k=1, n=SAMPLES,
                                                 max_new_tokens=TOKENS)
        tokens, finished = 0, 0
        try:
            with grpc.insecure_channel(addresses["grpc"]) as channel:
                for n, chunk in enumerate(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=90)):
                    if n == 0:
                        started.wait(timeout=60)
                    tokens += len(chunk.token_ids)
                    finished += bool(chunk.finish_reason)
            results[i] = (tokens, finished)
        except grpc.RpcError as error:
            results[i] = (tokens, error.code(), error.details())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)  # both streaming
    assert delete_app(config)  # as Ctrl-C does (services/launch.py): the app goes once they are done
    for thread in threads:
        thread.join(timeout=30)
    assert results == {i: (SAMPLES * TOKENS, SAMPLES) for i in range(2)}


class FakeServe:
    """Serve's controller deleting an app whose coordinator lets a generation finish for 90 s; a
    blocking serve.delete gives up after 60 s, as Serve 2.60's does."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def delete(self, name: str, _blocking: bool = True) -> None:
        if _blocking:
            self.now += 60
            raise TimeoutError(f"Some of these applications weren't deleted after 60s: [{name!r}]")

    def status(self):
        return SimpleNamespace(applications={APP_NAME: object()} if self.now < 90 else {})


def test_specdec_serve_waits_for_its_replicas_graceful_shutdown_not_60_s(monkeypatch):
    """`specdec serve` stopping (Ctrl-C): a generation that needed longer than a minute to finish
    ended the command with serve.delete's TimeoutError, which skipped the shutdown of Serve and Ray after it."""
    import services.launch

    fake = FakeServe()
    monkeypatch.setattr(services.launch, "serve", fake)
    monkeypatch.setattr(services.launch, "time", fake)
    assert delete_app(AppConfig()) and fake.now >= 90  # (the coordinator's 900 s allow it)
    fake.now = 0.0
    assert not delete_app(AppConfig(coordinator=ReplicaConfig(graceful_shutdown_timeout_s=10),
                                    ingress=ReplicaConfig(graceful_shutdown_timeout_s=10),
                                    draft=ReplicaConfig(graceful_shutdown_timeout_s=10),
                                    verifier=ReplicaConfig(graceful_shutdown_timeout_s=10)))
    assert fake.now < 90  # gave up after the replicas' 10 s and the slack
