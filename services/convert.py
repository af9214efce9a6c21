"""The one place that maps between the protobuf contracts (specdec/v1) and the core types, and
between user errors and gRPC status codes.

Draft distributions on the wire (SparseDistribution): the draft sends q_i as (token id, prob)
pairs. `dense_to_sparse` keeps every nonzero entry, so the verifier rebuilds q_i bit for bit and
served output equals the in-process engine's. To bound the bytes per round the draft may instead
sparsify q_i BEFORE it samples (`sparsify_logits`): speculative sampling is lossless for any
proposal the candidate was really drawn from, so truncation can cost acceptance, never
correctness.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import grpc
import torch
from google.protobuf import json_format
from pydantic import ValidationError

from specdec.errors import InvalidRequestError
from specdec.metrics import RequestStats
from specdec.params import GenerationParams, build_params, validation_message
from specdec.policies import PolicyConfig
from specdec.rounds import round_generator
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.sequences import RequestRules
from specdec.v1 import common_pb2, draft_pb2, generation_pb2

# Draft probabilities at or below this are dropped by `sparsify_logits` (0 = keep all: exact).
# 1e-6 keeps the argmax of any vocabulary under 10^6 tokens (max q >= 1/V) and, on Qwen-sized
# vocabularies, trims the long tail that carries almost no mass but most of the bytes.
SPARSE_MIN_PROB = 1e-6


# ------------------------------------------------------------------------------------------------
# Errors

@contextlib.contextmanager
def invalid_argument(context: grpc.ServicerContext) -> Iterator[None]:
    """Map a user error (InvalidRequestError) to INVALID_ARGUMENT with a one-line reason; anything
    else is a bug and stays INTERNAL."""
    try:
        yield
    except InvalidRequestError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, one_line(str(exc)))


class Overloaded(Exception):
    """The server cannot take more work now (Serve's backpressure): HTTP 429, gRPC RESOURCE_EXHAUSTED.
    Retriable after a pause."""


class Unavailable(Exception):
    """The replica running the request died (or none is up yet): HTTP 503, gRPC UNAVAILABLE.
    Retriable at once: a greedy or seeded request gives the same result again."""


def one_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid request"


# ------------------------------------------------------------------------------------------------
# Parameters

def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError with pydantic's first error as one line (`top-p: ...`)."""
    try:
        return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc)) from None


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The seed is not part of it: it travels as RoundSeed.request_seed."""
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def policy_from_proto(msg: draft_pb2.PolicyConfig) -> PolicyConfig:
    try:
        return PolicyConfig(name=msg.name or None,
                            k=msg.k if msg.HasField("k") else None,
                            threshold=msg.threshold if msg.HasField("threshold") else None)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc)) from None


def policy_to_proto(config: PolicyConfig) -> draft_pb2.PolicyConfig:
    msg = draft_pb2.PolicyConfig(name=config.name or "")
    if config.k is not None:
        msg.k = config.k
    if config.threshold is not None:
        msg.threshold = config.threshold
    return msg


def generator_from_seed(seed: common_pb2.RoundSeed, role: str) -> torch.Generator:
    return round_generator(seed.request_seed, seed.sample_index, seed.round_index, role)


# ------------------------------------------------------------------------------------------------
# History

def history_from_delta(held: list[int] | None, delta: common_pb2.HistoryDelta, vocab_size: int) -> list[int] | None:
    """The full committed history after `delta`, or None when the replica must answer
    session_missing (it holds no session, or a history of the wrong length).

    Worked example: held = [p1..p7]; delta = (history_length 10, tail [y1 y2 y'], full false)
    -> 7 == 10 - 3, so the history is [p1..p7 y1 y2 y']. With held = None -> None.
    """
    tail = list(delta.tail)
    if delta.history_length < 1:
        raise InvalidRequestError(f"history-length must be at least 1, got {delta.history_length}")
    if any(not 0 <= t < vocab_size for t in tail):
        raise InvalidRequestError(f"history token ids must be in [0, {vocab_size})")
    if delta.full:
        if len(tail) != delta.history_length:
            raise InvalidRequestError(
                f"a full history must send all {delta.history_length} tokens, got {len(tail)}")
        return tail
    if held is None or len(held) != delta.history_length - len(tail):
        return None
    return held + tail


def delta_for(history: Sequence[int], synced_length: int | None) -> common_pb2.HistoryDelta:
    """What a replica that last saw the first `synced_length` tokens needs (None: it saw nothing,
    send everything)."""
    if synced_length is None:
        return common_pb2.HistoryDelta(history_length=len(history), tail=history, full=True)
    return common_pb2.HistoryDelta(history_length=len(history), tail=history[synced_length:], full=False)


# ------------------------------------------------------------------------------------------------
# Draft distributions

def dense_to_sparse(q: torch.Tensor) -> common_pb2.SparseDistribution:
    """q [V] fp32 -> every nonzero entry, exactly (fp32 on both sides)."""
    ids = torch.nonzero(q, as_tuple=True)[0]  # [nnz]
    return common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=q[ids].float().tolist())


def sparse_to_dense(msg: common_pb2.SparseDistribution, vocab_size: int) -> torch.Tensor:
    """-> q [V] fp32; raises InvalidRequestError on a malformed distribution."""
    if len(msg.token_ids) != len(msg.probs) or not msg.token_ids:
        raise InvalidRequestError("a draft distribution needs one prob per token id, and at least one")
    ids = torch.tensor(list(msg.token_ids), dtype=torch.long)  # [nnz]
    probs = torch.tensor(list(msg.probs), dtype=torch.float32)  # [nnz]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(torch.unique(ids)) != len(ids):
        raise InvalidRequestError(f"draft distribution token ids must be distinct and in [0, {vocab_size})")
    if bool((probs < 0).any()) or not math.isclose(float(probs.double().sum()), 1.0, abs_tol=1e-3):
        raise InvalidRequestError("draft distribution probs must be non-negative and sum to 1")
    return torch.zeros(vocab_size, dtype=torch.float32).index_put_((ids,), probs)


def sparsify_logits(logits: torch.Tensor, sampling: SamplingParams, min_prob: float = SPARSE_MIN_PROB) -> torch.Tensor:
    """logits [V] -> logits whose processed distribution has no entry at or below `min_prob`.

    Applied to the draft's logits BEFORE `probs_from_logits`/sampling, so the candidate is drawn
    from the truncated, renormalised q and that q is what the draft sends (exactness, see
    common.proto). The argmax is always kept. Greedy requests send no q: they are left alone.
    """
    if sampling.greedy or min_prob <= 0:
        return logits
    q = probs_from_logits(logits, sampling)  # [V]
    drop = q <= min_prob
    drop[torch.argmax(q)] = False
    return logits.masked_fill(drop, -math.inf)


# ------------------------------------------------------------------------------------------------
# The public request and response

def params_from_request(request: generation_pb2.GenerateRequest, default_policy: PolicyConfig) -> GenerationParams:
    """The request's parameters; an unset policy, k or threshold falls back to the server's default
    policy (k and threshold only when the request names no other policy). Raises
    InvalidRequestError with a one-line reason."""
    def given(name: str):
        return getattr(request, name) if request.HasField(name) else None

    policy = given("policy") or default_policy.name
    same_policy = policy == default_policy.name
    return build_params(
        policy=policy,
        k=given("k") if request.HasField("k") else (default_policy.k if same_policy else None),
        threshold=given("threshold") if request.HasField("threshold") else (
            default_policy.threshold if same_policy else None),
        temperature=request.temperature, top_p=given("top_p"), top_k=request.top_k, seed=given("seed"),
        max_new_tokens=given("max_new_tokens"), n=given("n"), stop=tuple(request.stop) or None,
        chat_template=given("chat_template"))


def prompt_ids_from_request(request: generation_pb2.GenerateRequest, rules: RequestRules,
                            params: GenerationParams) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return rules.encode_prompt(request.text, params.chat_template)
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "messages":
        return rules.encode_messages([{"role": m.role, "content": m.content} for m in request.messages.messages])
    raise InvalidRequestError("prompt is empty: send text, token_ids or messages")


def stats_to_proto(stats: RequestStats) -> generation_pb2.Stats:
    return json_format.ParseDict(stats.to_dict(), generation_pb2.Stats())
