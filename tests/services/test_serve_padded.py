"""A draft and target whose embeddings differ in padding rows, served by the real Serve app (draft,
verifier, coordinator and ingress deployments): the draft replica builds its draft without the
target and fits it to the width the coordinator's calls name (ProposeBatch `target_rows`); served
output equals the in-process engine's, which the builder fitted. One app (~30 s to start on 2 cores)."""

from __future__ import annotations

import grpc
import pytest

from services.config import AppConfig, ReplicaConfig
from specdec.builder import build_engine
from specdec.loop import BatchConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc
from engine_backend import local_serve
from test_round_services_padded import GREEDY_AND_SAMPLED, PROMPT, padded_models, pair


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return padded_models(tmp_path_factory)


def test_a_served_padded_pair_equals_the_engine(padded):
    models = pair(padded, "more").model_copy(update={"batch": BatchConfig(overlap="off")})
    engine = build_engine(models, progress=False)
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(models=models, draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       coordinator=ReplicaConfig(num_cpus=0.0), ingress=ReplicaConfig(num_cpus=0.0))
    with local_serve(config) as addresses, grpc.insecure_channel(addresses["grpc"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for params in GREEDY_AND_SAMPLED:
            response = stub.Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=PROMPT), max_new_tokens=params.max_new_tokens, policy="fixed",
                k=3, temperature=params.sampling.temperature, seed=params.sampling.seed or 0), timeout=120)
            local = engine.generate_ids(PROMPT, params)
            assert list(response.completions[0].token_ids) == local.completions[0].token_ids
            assert response.stats.draft_tokens > 0
