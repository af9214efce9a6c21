"""Property-based fuzzing (hypothesis): request parsing on both protocols never fails other than
with a one-line user error, and verification keeps its lossless-ness properties on random
probability vectors (also after the wire's sparse encoding)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.ingress import parse_request
from services.convert import pack_distribution, unpack_distribution
from services.coordinator import MAX_CANDIDATES_PER_ROUND, Coordinator
from services.openai_api import ApiError, ChatRequest, CompletionRequest, chat_to_proto, completion_to_proto, \
    validation_error
from specdec.errors import InvalidRequestError
from specdec.sampling import MAX_SAMPLES_PER_REQUEST
from specdec.v1 import generation_pb2
from specdec.verification import residual_distribution, verify_greedy, verify_sampled

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
VERIFY_FUZZ = settings(FUZZ, max_examples=200)
INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 1e-9, 1 - 1e-9, math.nan, math.inf, -math.inf])
FLOAT = st.one_of(EDGE_FLOATS, ANY_FLOAT)
POLICIES = ["svip", "fixed", "heuristic", "confidence", "target-only"]  # what a served request may name
POLICY = st.one_of(st.sampled_from([*POLICIES, "specdec++", "oracle", "", "FIXED"]), st.text(max_size=12))
TEXT = st.text(max_size=300)
GOOD_TEXT = st.text(min_size=1, max_size=80).filter(str.strip)
GOOD = {"policy": st.sampled_from(POLICIES), "k": st.integers(1, MAX_CANDIDATES_PER_ROUND),
        "threshold": st.floats(0.01, 0.99), "top_p": st.floats(0.01, 1.0), "temperature": st.floats(0.0, 2.0),
        "max_new_tokens": st.integers(1, 256), "n": st.integers(1, 8), "top_k": st.integers(0, 300),
        "seed": INT64, "chat_template": st.booleans()}
BAD = {"policy": POLICY, "k": st.one_of(st.integers(-3, 70), INT32), "threshold": FLOAT, "top_p": FLOAT,
       "temperature": FLOAT, "max_new_tokens": st.one_of(st.integers(-3, 300), INT32),
       "n": st.one_of(st.integers(-2, 70), INT32), "top_k": INT32, "seed": INT64, "chat_template": st.booleans()}


def value(draw, name: str):
    """Mostly a valid value (so that accepted requests are fuzzed too), sometimes anything."""
    return draw(BAD[name] if draw(st.integers(0, 4)) == 0 else GOOD[name])


@pytest.fixture(scope="module")
def coordinator(tiny_engine) -> Coordinator:
    return Coordinator(transport=None, rules=tiny_engine.rules)


def assert_one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message


def check_prepared(coordinator: Coordinator, request: generation_pb2.GenerateRequest) -> None:
    """prepare() accepts the request with every parameter in range, or refuses it in one line."""
    rules = coordinator.rules
    try:
        prompt_ids, params = coordinator.prepare(request)
    except InvalidRequestError as exc:
        assert_one_line(str(exc))
        event("refused by the coordinator")
        return
    event("accepted")
    assert 0 < len(prompt_ids) < rules.max_context and all(0 <= t < rules.vocab_size for t in prompt_ids)
    assert 1 <= params.max_new_tokens <= rules.max_context and 1 <= params.n <= MAX_SAMPLES_PER_REQUEST
    sampling = params.sampling
    assert math.isfinite(sampling.temperature) and sampling.temperature >= 0
    assert math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1 and sampling.top_k >= 0
    assert params.policy.k is None or 1 <= params.policy.k <= MAX_CANDIDATES_PER_ROUND
    assert params.policy.threshold is None or 0 < params.policy.threshold < 1
    assert params.policy.name not in ("oracle", "specdec++")  # served without a head: refused


# ------------------------------------------------------------------------------------------------
# gRPC requests

@st.composite
def grpc_requests(draw) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest()
    prompt = draw(st.sampled_from(["text", "token_ids", "messages", "none"]))
    bad = draw(st.integers(0, 4)) == 0
    if prompt == "text":
        request.text = draw(TEXT if bad else GOOD_TEXT)
    elif prompt == "token_ids":
        request.token_ids.SetInParent()
        ids = st.one_of(st.integers(-5, 300), INT32) if bad else st.integers(0, 258)
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=0 if bad else 1, max_size=300 if bad else 100)))
    elif prompt == "messages":
        request.messages.SetInParent()
        roles = st.sampled_from(["user", "system", "assistant", "tool", ""] if bad else ["user", "system", "assistant"])
        for role, content in draw(st.lists(st.tuples(roles, TEXT if bad else GOOD_TEXT), min_size=0 if bad else 1,
                                           max_size=3)):
            request.messages.messages.add(role=role, content=content)
    for name in ("chat_template", "policy", "k", "threshold", "top_p", "seed", "max_new_tokens", "n"):
        if draw(st.booleans()):
            setattr(request, name, value(draw, name))
    request.temperature = value(draw, "temperature")
    request.top_k = value(draw, "top_k")
    request.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    return request


@FUZZ
@given(request=grpc_requests())
def test_grpc_request_parsing(coordinator, request):
    check_prepared(coordinator, request)


@FUZZ
@given(payload=st.one_of(st.binary(max_size=400), grpc_requests().map(lambda r: r.SerializeToString()).flatmap(
    lambda b: st.tuples(st.just(b), st.integers(0, max(len(b), 1)), st.binary(max_size=8)).map(
        lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:]))))
def test_grpc_wire_bytes(coordinator, payload):
    """Any bytes on the wire: refused in one line (malformed, over the size limit) or parsed and
    then checked like any request."""
    try:
        request = parse_request(payload, max_bytes=256)
    except InvalidRequestError as exc:
        assert_one_line(str(exc))
        return
    check_prepared(coordinator, request)


# ------------------------------------------------------------------------------------------------
# HTTP bodies (OpenAI's fields and ours, any JSON values)

JSON_VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), FLOAT, st.text(max_size=20)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=6)
OPENAI_NAMES = {"max_tokens": "max_new_tokens"}
EXTRA_FIELDS = {"model": st.one_of(st.just("specdec"), JSON_VALUE), "stop": st.one_of(st.text(max_size=4), JSON_VALUE),
                "stream": st.booleans(), "echo": JSON_VALUE, "logprobs": JSON_VALUE, "best_of": JSON_VALUE,
                "logit_bias": JSON_VALUE, "stream_options": JSON_VALUE, "user": JSON_VALUE,
                "unknown_field": JSON_VALUE}


@st.composite
def http_bodies(draw) -> tuple[bool, object]:
    chat, body = draw(st.booleans()), {}
    for name in ("max_tokens", "temperature", "top_p", "n", "seed", "top_k", "policy", "k", "threshold"):
        if draw(st.booleans()):
            body[name] = draw(JSON_VALUE) if draw(st.integers(0, 19)) == 0 else value(draw, OPENAI_NAMES.get(name, name))
    for name, strategy in EXTRA_FIELDS.items():
        if draw(st.integers(0, 15)) == 0:
            body[name] = draw(strategy)
    if draw(st.integers(0, 9)):  # mostly a prompt; sometimes none
        if chat:
            message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": GOOD_TEXT})
            body["messages"] = draw(st.one_of(st.lists(message, min_size=1, max_size=3), JSON_VALUE))
        else:
            good = st.one_of(GOOD_TEXT, st.lists(st.integers(0, 258), min_size=1, max_size=100))
            bad = st.one_of(TEXT, st.lists(TEXT, max_size=2), JSON_VALUE)
            body["prompt"] = draw(bad if draw(st.integers(0, 4)) == 0 else good)
    return chat, body if draw(st.integers(0, 19)) else draw(JSON_VALUE)


@FUZZ
@given(case=http_bodies())
def test_http_body_parsing(coordinator, case):
    """The route's path: pydantic's model, our checks, then the coordinator's. Every refusal is an
    HTTP status with one line."""
    chat, body = case
    try:
        model = (ChatRequest if chat else CompletionRequest).model_validate(body)
        request = (chat_to_proto if chat else completion_to_proto)(model, "fuzz")
    except ValidationError as exc:
        from fastapi.exceptions import RequestValidationError

        error = validation_error(RequestValidationError(exc.errors()))
        assert error.status == 400
        assert_one_line(error.message)
        event("refused by the body's model")
        return
    except ApiError as exc:
        assert 400 <= exc.status < 500
        assert_one_line(exc.message)
        event("refused as unsupported")
        return
    check_prepared(coordinator, request)


# ------------------------------------------------------------------------------------------------
# Verification on random probability vectors

@st.composite
def distributions(draw, vocab: int, count: int) -> torch.Tensor:
    """[count, vocab] rows that sum to 1, with exact zeros and near-ties likely."""
    weight = st.one_of(st.just(0.0), st.just(1.0), st.floats(1e-6, 1.0), st.floats(0.0, 1e-4))
    rows = []
    for _ in range(count):
        row = draw(st.lists(weight, min_size=vocab, max_size=vocab))
        assume(sum(row) > 1e-3)
        rows.append(row)
    probs = torch.tensor(rows, dtype=torch.float32)
    return probs / probs.sum(dim=-1, keepdim=True)


@st.composite
def rounds(draw):
    """(candidates [K], q [K, V], p [K+1, V], seed) with each candidate drawn where q > 0."""
    vocab, k = draw(st.integers(2, 12)), draw(st.integers(1, 5))
    q, p = draw(distributions(vocab, k)), draw(distributions(vocab, k + 1))
    candidates = [draw(st.sampled_from(torch.nonzero(q[i]).flatten().tolist())) for i in range(k)]
    return torch.tensor(candidates), q, p, draw(st.integers(0, 2**32))


@VERIFY_FUZZ
@given(p=distributions(vocab=8, count=1), q=distributions(vocab=8, count=1))
def test_one_step_is_lossless(p, q):
    """Draw y ~ q, accept with min(1, p/q), else draw from the residual: exactly p."""
    p, q = p[0].double(), q[0].double()
    residual = residual_distribution(p, q)
    assert torch.all(residual >= 0) and math.isclose(float(residual.sum()), 1.0, abs_tol=1e-6)
    accepted = torch.minimum(p, q)  # q(x) * min(1, p(x)/q(x))
    output = accepted + (1 - accepted.sum()) * residual
    assert torch.allclose(output, p, atol=1e-6)


@VERIFY_FUZZ
@given(case=rounds())
def test_sampled_verdicts_only_commit_what_the_target_allows(case):
    candidates, q, p, seed = case
    verdict = verify_sampled(candidates, q, p, torch.Generator().manual_seed(seed))
    k, n = len(candidates), verdict.num_accepted
    assert 0 <= n <= k
    assert all(p[i, candidates[i]] > 0 for i in range(n))  # a token the target rules out is never accepted
    if n < k:
        assert residual_distribution(p[n], q[n])[verdict.next_token] > 0
    else:
        assert p[k, verdict.next_token] > 0
    same = verify_sampled(candidates, q, p, torch.Generator().manual_seed(seed))
    assert same == verdict  # the served rounds rely on this: same seed, same verdict


@VERIFY_FUZZ
@given(case=rounds())
def test_equal_distributions_accept_everything(case):
    candidates, q, _, seed = case
    p = torch.cat([q, q[-1:]])
    assert verify_sampled(candidates, q, p, torch.Generator().manual_seed(seed)).num_accepted == len(candidates)


@VERIFY_FUZZ
@given(case=rounds())
def test_greedy_verdict_is_the_longest_argmax_prefix(case):
    candidates, _, p, _ = case
    logits = torch.log(p + 1e-12)
    verdict = verify_greedy(candidates, logits)
    argmax = torch.argmax(logits, dim=-1).tolist()
    n = next((i for i, c in enumerate(candidates.tolist()) if c != argmax[i]), len(candidates))
    assert verdict.num_accepted == n and verdict.next_token == argmax[n]


@VERIFY_FUZZ
@given(q=distributions(vocab=32, count=1), case=rounds())
def test_wire_encoding_is_exact(q, case):
    """Draft distributions travel packed, sparse or dense: the verifier rebuilds them bit for bit,
    so served verification decides exactly as in process."""
    q = q[0]
    assert torch.equal(unpack_distribution(pack_distribution(q), len(q)), q)
    candidates, draft, p, seed = case
    rebuilt = torch.stack([unpack_distribution(pack_distribution(row), draft.shape[1]) for row in draft])
    assert verify_sampled(candidates, rebuilt, p, torch.Generator().manual_seed(seed)) == \
        verify_sampled(candidates, draft, p, torch.Generator().manual_seed(seed))
