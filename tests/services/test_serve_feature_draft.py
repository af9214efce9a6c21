"""A feature draft served end to end on the tiny target: real Ray Serve deployments built from a
feature draft's directory (the builder's `feature` backend), the target's states riding with each
round over the replicas' transport, and replicas killed mid-stream. One Ray instance per module."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from clients.grpc_client import GrpcClient
from engine_backend import local_serve
from services.config import AppConfig, ReplicaConfig
from specdec.builder import EngineConfig, build_engine
from specdec.models.sources import model_identity
from specdec.params import build_params
from test_serve_app import kill_all, wait_replaced
from tiny import tiny_feature_draft

PROMPT = "Write a haiku about caches."
LONG = {"policy": "fixed", "k": 3, "max_new_tokens": 120}


@pytest.fixture(scope="module")
def feature_pair(tiny_pair, tmp_path_factory) -> tuple[str, str]:
    """(feature draft directory, target directory): a random draft on the tiny target, saved as
    `specdec train-draft` saves one (its config names the target's identity)."""
    target_dir = tiny_pair[1]
    draft = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(target_dir), seed=3)
    draft.config = draft.config.model_copy(update={"target_identity": model_identity(target_dir)})
    return str(draft.save(tmp_path_factory.mktemp("feature") / "draft")), str(target_dir)


@pytest.fixture(scope="module")
def feature_engine(feature_pair):
    draft_dir, target_dir = feature_pair
    return build_engine(EngineConfig(draft=draft_dir, target=target_dir, draft_format="fp32"), progress=False)  # fp32: the replicas' draws equal the engine's


@pytest.fixture(scope="module")
def served(feature_pair):
    draft_dir, target_dir = feature_pair
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(models=EngineConfig(draft=draft_dir, target=target_dir, draft_format="fp32"),
                       draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       coordinator=ReplicaConfig(num_cpus=0.0), ingress=ReplicaConfig(num_cpus=0.0))
    with local_serve(config) as addresses:
        yield addresses


def test_the_engine_builds_a_feature_draft_from_its_directory(feature_engine):
    """`--draft DIR` loads the draft on its target, whose passes hand out the states it reads: it
    drafts in most rounds (a session drafts only once the states reach its history's end), and the
    output is the target's."""
    assert feature_engine.draft.reads_features and feature_engine.target.returns_features
    result = feature_engine.generate(PROMPT, build_params(**LONG))
    plain = feature_engine.generate(PROMPT, build_params(policy="target-only", max_new_tokens=LONG["max_new_tokens"]))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.draft_tokens > result.stats.rounds


def test_served_feature_draft_survives_killed_replicas(feature_engine, served):
    """The draft, then the verifier, killed mid-stream: the rebuilt draft session has no states until
    a verification recomputes them; the stream equals the in-process engine's, nothing lost."""
    expected = feature_engine.generate(PROMPT, build_params(**LONG)).completions[0].token_ids
    assert len(expected) > 80
    points, victims = [15, 50], ["Draft", "Verifier"]
    ids, kills = [], []
    with GrpcClient(served["grpc"], timeout_s=300, retries=0) as client:
        for chunk in client.generate_stream(PROMPT, **LONG):
            ids.extend(chunk.token_ids)
            if len(kills) < len(points) and len(ids) >= points[len(kills)]:
                kills.append((victims[len(kills)], kill_all(victims[len(kills)])))
        response = client.generate(PROMPT, **LONG)
    assert ids == expected and list(response.completions[0].token_ids) == expected
    assert response.stats.draft_tokens > response.stats.rounds and response.stats.transport_bytes > 0
    for deployment, before in kills:
        wait_replaced(deployment, before)
