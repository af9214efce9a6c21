"""A feature draft served end to end on the tiny target, beside a model draft: real Ray Serve
deployments built from a feature draft's directory (the builder's `feature` backend) and the tiny
pair's draft (`models.drafts`), requests of both drafts sharing the steps, and replicas killed
mid-stream; the feature draft in both placements: `colocated` (the default: in the verifier's
replicas, the target's states handed over in process) and `separate` (a Draft deployment of its
own, the states riding with its round calls); and beside the target with the round loop there too
(`loop_placement: verifier`). One Ray instance per placement."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from clients.grpc_client import GrpcClient
from clients.http_client import HttpClient
from engine_backend import local_serve
from services.config import AppConfig, ReplicaConfig
from specdec.builder import EngineConfig, build_engine
from specdec.models.feature_files import save_feature_draft
from specdec.models.sources import model_identity
from specdec.params import build_params
from test_serve_app import PATIENT, kill_all, replica_names, wait_replaced
from tiny import tiny_feature_draft

PROMPT = "Write a haiku about caches."
LONG = {"policy": "fixed", "k": 3, "max_new_tokens": 120, "draft": "feature"}


@pytest.fixture(scope="module")
def feature_pair(tiny_pair, tmp_path_factory) -> tuple[str, str]:
    """(feature draft directory, target directory): a random draft on the tiny target, saved as
    `specdec train-draft` saves one (its config names the target's identity)."""
    target_dir = tiny_pair[1]
    draft = tiny_feature_draft(AutoModelForCausalLM.from_pretrained(target_dir), seed=3)
    draft.config = draft.config.model_copy(update={"target_identity": model_identity(target_dir)})
    return str(save_feature_draft(draft, tmp_path_factory.mktemp("feature") / "draft")), str(target_dir)


@pytest.fixture(scope="module")
def models(tiny_pair, feature_pair) -> EngineConfig:
    """The tiny pair's draft (the default) and the feature draft ("feature") on the tiny target; fp32:
    the replicas' draws equal the engine's."""
    draft_dir, target_dir = feature_pair
    return EngineConfig(draft=str(tiny_pair[0]), drafts={"feature": draft_dir}, target=target_dir, draft_format="fp32")


@pytest.fixture(scope="module")
def feature_engine(models):
    return build_engine(models, progress=False)


@pytest.fixture(scope="module", params=[("colocated", "direct", "coordinator"), ("separate", "direct", "coordinator"),
                                        ("colocated", "serve-grpc", "coordinator"), ("colocated", "direct", "verifier")],
                ids=["colocated", "separate", "colocated-over-handles", "colocated-with-the-loop"])
def served(models, request):
    """The app in each placement; beside the target also with every round call a Serve handle
    call (`round_transport: serve-grpc`: the colocated draft's calls go to the Verifier replica),
    and with the round loop there too (`loop_placement: verifier`: the feature draft's steps cross
    no process, the model draft's Propose batches do)."""
    placement, transport, loop = request.param
    replica = dict(num_cpus=0.1, threads=1)
    config = AppConfig(models=models, feature_draft_placement=placement, round_transport=transport,
                       loop_placement=loop, draft=ReplicaConfig(**replica), verifier=ReplicaConfig(**replica),
                       coordinator=ReplicaConfig(num_cpus=0.0), ingress=ReplicaConfig(num_cpus=0.0))
    assert config.colocated_drafts() == (["feature"] if placement == "colocated" else [])
    with local_serve(config) as addresses:
        yield addresses | {"placement": placement, "loop": loop}


def test_the_engine_builds_a_feature_draft_from_its_directory(feature_engine):
    """`--draft DIR` loads the draft on its target, whose passes hand out the states it reads: it
    drafts in most rounds (a session drafts only once the states reach its history's end), and the
    output is the target's."""
    assert feature_engine.draft_workers["feature"].draft.reads_features and feature_engine.target.returns_features
    assert not feature_engine.draft.reads_features
    result = feature_engine.generate(PROMPT, build_params(**LONG))
    plain = feature_engine.generate(PROMPT, build_params(policy="target-only", max_new_tokens=LONG["max_new_tokens"]))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.draft_tokens > result.stats.rounds


def test_served_feature_draft_survives_killed_replicas(feature_engine, served):
    """The draft, then the verifier, killed mid-stream (beside the target: the verifier twice, the
    draft with it): the rebuilt draft session has no states until a verification recomputes them;
    the stream equals the in-process engine's, nothing lost."""
    expected = feature_engine.generate(PROMPT, build_params(**LONG)).completions[0].token_ids
    assert len(expected) > 80
    points = [15, 50]
    victims = ["Verifier", "Verifier"] if served["placement"] == "colocated" else ["Draft-feature", "Verifier"]
    ids, kills = [], []
    # With the loop in the Verifier replica, its loss is the coordinator's: the client's retry resumes the stream.
    beside = served["loop"] == "verifier"
    with GrpcClient(served["grpc"], timeout_s=300, retries=PATIENT if beside else 0) as client:
        for chunk in client.generate_stream(PROMPT, **LONG):
            ids.extend(chunk.token_ids)
            if len(kills) < len(points) and len(ids) >= points[len(kills)]:
                kills.append((victims[len(kills)], kill_all(victims[len(kills)])))
        response = client.generate(PROMPT, **LONG)
    assert ids == expected and list(response.completions[0].token_ids) == expected
    assert response.stats.draft_tokens > response.stats.rounds
    assert (response.stats.transport_bytes > 0) != beside  # beside the target with the loop, nothing crosses
    with HttpClient(served["http"], timeout_s=300, retries=PATIENT if beside else 0) as http:  # (500s beside)
        body = http.complete(PROMPT, max_tokens=LONG["max_new_tokens"], policy="fixed", k=3, draft="feature")
    assert body["choices"][0]["text"] == feature_engine.generate(
        PROMPT, build_params(**LONG, chat_template=False)).completions[0].text
    for deployment, before in kills:
        wait_replaced(deployment, before)
    assert bool(replica_names("Draft-feature")) == (served["placement"] == "separate")  # no Draft replicas beside
    assert bool(replica_names("Coordinator")) != beside


def test_served_requests_of_both_drafts_share_the_steps(feature_engine, served):
    """Requests of the model draft and of the feature draft at once, greedy and sampled: each is
    drafted where its draft runs, one Verify carries them, and each output equals the in-process
    engine's (greedy: the target's)."""
    import asyncio

    from clients.grpc_client import AsyncGrpcClient

    requests = [{"policy": "fixed", "k": 3, "max_new_tokens": 60, "draft": draft, "temperature": temperature,
                 "seed": 7} for draft in ("default", "feature") for temperature in (0.0, 1.0)]
    expected = [feature_engine.generate(PROMPT, build_params(**r)).completions[0].token_ids for r in requests]

    async def run():
        async with AsyncGrpcClient(served["grpc"], timeout_s=300, retries=0) as client:
            return await asyncio.gather(*(client.generate(PROMPT, **r) for r in requests))

    responses = asyncio.run(run())
    for r, response, ids in zip(requests, responses, expected):
        assert list(response.completions[0].token_ids) == ids, r
        assert response.stats.draft_tokens > 0, r
    with pytest.raises(Exception, match="unknown draft 'eagle'"):
        with GrpcClient(served["grpc"], timeout_s=60, retries=0) as client:
            client.generate(PROMPT, max_new_tokens=4, draft="eagle")
