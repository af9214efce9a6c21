"""The one place that maps between the protobuf contracts (specdec/v1) and the core types
(specdec/protocol.py, specdec/params.py).

Draft distributions on the wire (common.proto `Distribution`): the draft sends q_i packed as
float32 bytes, every nonzero entry with its token id or, where that is smaller, all of them
(`pack_distribution`), so the verifier rebuilds q_i bit for bit and served output equals the
in-process engine's. To bound the bytes per round the draft may instead
sparsify q_i BEFORE it samples (`sparsify_logits`): speculative sampling is lossless for any
proposal the candidate was really drawn from, so truncation can cost acceptance, never
correctness.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from google.protobuf import json_format
from pydantic import ValidationError

from services.auth import cache_scope
from specdec.cost_profile import CostProfile, PassTiming
from specdec.errors import InvalidRequestError, one_line, validation_message
from specdec.metrics import RequestStats
from specdec.models.feature_files import pack_states, unpack_states
from specdec.params import GenerationParams, build_params
from specdec.policies import PolicyConfig
from specdec.protocol import (HistoryDelta, Proposal, ProposeItem, Refused, RoundSeed, SessionMissing, StepPlan,
                              VerifyItem, q_travels)
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.sequences import RequestRules
from specdec.v1 import common_pb2, draft_pb2, generation_pb2, verifier_pb2
from specdec.verification import Verdict

# Draft probabilities at or below this are dropped by `sparsify_logits` (0 = keep all: exact).
# 1e-6 keeps the argmax of any vocabulary under 10^6 tokens (max q >= 1/V) and, on Qwen-sized
# vocabularies, trims the long tail that carries almost no mass but most of the bytes.
SPARSE_MIN_PROB = 1e-6

logger = logging.getLogger(__name__)


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


def seed_to_proto(seed: RoundSeed) -> common_pb2.RoundSeed:
    return common_pb2.RoundSeed(request_seed=seed.request_seed, sample_index=seed.sample_index,
                                round_index=seed.round_index)


def seed_from_proto(msg: common_pb2.RoundSeed) -> RoundSeed:
    return RoundSeed(msg.request_seed, msg.sample_index, msg.round_index)


def delta_to_proto(delta: HistoryDelta) -> common_pb2.HistoryDelta:
    return common_pb2.HistoryDelta(history_length=delta.length, tail=delta.tail, full=delta.full, drop=delta.drop)


def delta_from_proto(msg: common_pb2.HistoryDelta) -> HistoryDelta:
    return HistoryDelta(msg.history_length, list(msg.tail), msg.full, msg.drop)


# ------------------------------------------------------------------------------------------------
# Round items and answers (specdec/protocol.py)

def features_to_proto(states: torch.Tensor, start: int = 0) -> common_pb2.Features:
    """The target's states [m, reads, H] as one packed bfloat16 field."""
    tokens, reads, hidden = states.shape
    return common_pb2.Features(start=start, tokens=tokens, reads=reads, hidden=hidden, data=pack_states(states))


def features_from_proto(msg: common_pb2.Features) -> torch.Tensor:
    """-> [tokens, reads, H] bfloat16; raises InvalidRequestError when the bytes do not fit the shape."""
    expected = msg.tokens * msg.reads * msg.hidden * 2
    if not msg.tokens:
        raise InvalidRequestError("features must hold at least one token's states")
    if not msg.reads or not msg.hidden or len(msg.data) != expected:
        raise InvalidRequestError(f"features of {msg.tokens} x {msg.reads} x {msg.hidden} need {expected} bytes, "
                                  f"got {len(msg.data)}")
    return unpack_states(msg.data, msg.tokens, msg.hidden)


def propose_item_to_proto(item: ProposeItem) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        session_id=item.session_id, history=delta_to_proto(item.history), policy=policy_to_proto(item.policy),
        sampling=sampling_to_proto(item.sampling), max_candidates=item.max_candidates,
        num_generated=item.num_generated, seed=seed_to_proto(item.seed), probe=item.probe, ahead=item.ahead, held=item.held,
        cache_scope=item.cache_scope or "",
        rounds=[draft_pb2.RoundOutcome(num_candidates=k, num_accepted=n) for k, n in item.rounds],
        features=None if item.features is None else features_to_proto(item.features, item.features_start))


def propose_item_from_proto(msg: draft_pb2.ProposeRequest) -> ProposeItem:
    """Raises InvalidRequestError with a one-line reason."""
    return ProposeItem(
        session_id=msg.session_id, history=delta_from_proto(msg.history), policy=policy_from_proto(msg.policy),
        sampling=sampling_from_proto(msg.sampling), max_candidates=msg.max_candidates,
        num_generated=msg.num_generated, rounds=[(r.num_candidates, r.num_accepted) for r in msg.rounds],
        seed=seed_from_proto(msg.seed), probe=msg.probe, ahead=msg.ahead, held=msg.held,
        cache_scope=msg.cache_scope or None,
        features=features_from_proto(msg.features) if msg.HasField("features") else None,
        features_start=msg.features.start)


def plan_to_proto(plan: StepPlan, items: list) -> draft_pb2.ProposeBatch:
    costs = plan.costs
    target_rows, target_tokens = plan.target_vocab or (0, 0)
    return draft_pb2.ProposeBatch(items=items, other_sessions=plan.other_sessions, acceptance=plan.acceptance,
                                  target_rows=target_rows, target_tokens=target_tokens,
                                  costs=None if costs is None else
                                  common_pb2.CostProfile(t_draft_ms=costs.t_draft_ms, t_target_ms=costs.t_target_ms,
                                                         t_draft_rows_ms=costs.t_draft_rows_ms, source=costs.source))


def plan_from_proto(msg: draft_pb2.ProposeBatch) -> StepPlan:
    """Raises InvalidRequestError with a one-line reason (a malformed profile fails the whole call)."""
    if msg.other_sessions < 0:
        raise InvalidRequestError(f"other-sessions must be at least 0, got {msg.other_sessions}")
    acceptance = msg.acceptance if msg.HasField("acceptance") else None
    if acceptance is not None and not 0.0 <= acceptance <= 1.0:
        raise InvalidRequestError(f"acceptance must be in [0, 1], got {acceptance}")
    if msg.target_rows < 0 or msg.target_tokens < 0 or (msg.target_rows > 0) != (msg.target_tokens > 0):
        raise InvalidRequestError(f"target-rows and target-tokens are both positive or both unset, got "
                                  f"{msg.target_rows} and {msg.target_tokens}")
    target_vocab = (msg.target_rows, msg.target_tokens) if msg.target_rows else None
    if not msg.HasField("costs"):
        return StepPlan(other_sessions=msg.other_sessions, acceptance=acceptance, target_vocab=target_vocab)
    try:
        costs = CostProfile(t_draft_ms=msg.costs.t_draft_ms, t_target_ms=dict(msg.costs.t_target_ms),
                            t_draft_rows_ms=dict(msg.costs.t_draft_rows_ms), source=msg.costs.source)
    except ValidationError as exc:
        raise InvalidRequestError(f"bad cost profile: {validation_message(exc)}") from None
    return StepPlan(costs=costs, other_sessions=msg.other_sessions, acceptance=acceptance, target_vocab=target_vocab)


def timings_to_proto(timings: list[PassTiming]) -> list[common_pb2.PassTiming]:
    return [common_pb2.PassTiming(role=t.role, tokens=t.tokens, ms=t.ms, probe=t.probe) for t in timings]


def timings_from_proto(messages) -> list[PassTiming]:
    return [PassTiming(m.role, m.tokens, m.ms, m.probe) for m in messages]


def proposal_to_proto(answer) -> draft_pb2.Proposal:
    """A worker's answer for one item (a proposal carries q_i only when sampled)."""
    match answer:
        case SessionMissing():
            return draft_pb2.Proposal(session_missing=True)
        case Refused(reason=reason):
            return draft_pb2.Proposal(error=one_line(reason))
        case Proposal():
            return draft_pb2.Proposal(candidates=answer.candidates, forward_passes=answer.forward_passes,
                                      draft_probs=pack_distributions(answer.draft_probs))
    raise TypeError(f"not a proposal answer: {answer!r}")


def proposal_from_proto(msg: draft_pb2.Proposal):
    """-> Proposal | SessionMissing | Refused. The q_i stay in wire form: the coordinator only
    passes them on to the verifier (`verify_item_to_proto`)."""
    if msg.session_missing:
        return SessionMissing()
    if msg.error:
        return Refused(msg.error)
    return Proposal(list(msg.candidates), list(msg.draft_probs), msg.forward_passes)


def verify_item_to_proto(item: VerifyItem) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(
        session_id=item.session_id, history=delta_to_proto(item.history), candidates=item.candidates,
        draft_probs=[q if isinstance(q, common_pb2.Distribution) else pack_distribution(q) for q in item.draft_probs],
        sampling=sampling_to_proto(item.sampling), seed=seed_to_proto(item.seed), features_from=item.features_from)


def verify_item_from_proto(msg: verifier_pb2.VerifyRequest, vocab_size: int) -> VerifyItem:
    """Raises InvalidRequestError with a one-line reason."""
    sampling = sampling_from_proto(msg.sampling)
    return VerifyItem(
        session_id=msg.session_id, history=delta_from_proto(msg.history), candidates=list(msg.candidates),
        draft_probs=unpack_draft_probs(msg.draft_probs, msg.candidates, sampling, vocab_size),
        sampling=sampling, seed=seed_from_proto(msg.seed),
        features_from=msg.features_from if msg.HasField("features_from") else None)


def unpacked_for_verifier(item: VerifyItem, vocab_size: int) -> VerifyItem:
    """The item with its q_i as the Verifier service would read them (`verify_item_from_proto`),
    for a verifier in the caller's process (services/transports.py `BesideTransport`): the draft's
    replica sent them packed. Raises InvalidRequestError as that does."""
    if not any(isinstance(q, common_pb2.Distribution) for q in item.draft_probs):
        return item
    return replace(item, draft_probs=unpack_draft_probs(item.draft_probs, item.candidates, item.sampling, vocab_size))


def unpack_draft_probs(packed, candidates: Sequence[int], sampling: SamplingParams,
                       vocab_size: int) -> list[torch.Tensor]:
    """A round's q_i as the verifier reads them: none where they need not travel (greedy). A
    candidate its q gives no probability is refused: no draft drew it, and p / q is not defined."""
    if not q_travels(sampling):
        return []
    draft_probs = [unpack_distribution(q, vocab_size) for q in packed]
    for i, (q, y) in enumerate(zip(draft_probs, candidates), start=1):
        if 0 <= y < vocab_size and not float(q[y]) > 0:  # (a float: a tensor comparison costs 4x the host time)
            raise InvalidRequestError(f"candidate {i} has draft probability 0: no draft could have drawn it")
    return draft_probs


def verdict_to_proto(answer) -> verifier_pb2.Verdict:
    match answer:
        case SessionMissing():
            return verifier_pb2.Verdict(session_missing=True)
        case Refused(reason=reason):
            return verifier_pb2.Verdict(error=one_line(reason))
        case Verdict():  # the features' rows start at the item's features_from
            return verifier_pb2.Verdict(num_accepted=answer.num_accepted, next_token=answer.next_token,
                                        features=None if answer.features is None else features_to_proto(answer.features))
    raise TypeError(f"not a verdict answer: {answer!r}")


def verdict_from_proto(msg: verifier_pb2.Verdict):
    """-> Verdict | SessionMissing | Refused."""
    if msg.session_missing:
        return SessionMissing()
    if msg.error:
        return Refused(msg.error)
    return Verdict(msg.num_accepted, msg.next_token,
                   features_from_proto(msg.features) if msg.HasField("features") else None)


def convert_items(messages, convert) -> tuple[list, dict[int, Refused]]:
    """Convert each wire item; one that does not convert is Refused on its own. Returns (the items
    that converted, {index in `messages`: Refused})."""
    items, refused = [], {}
    for i, msg in enumerate(messages):
        try:
            items.append(convert(msg))
        except InvalidRequestError as exc:
            refused[i] = Refused(str(exc))
        except Exception as exc:  # noqa: BLE001 - a check missed: the item alone fails, not its call
            logger.exception("converting a round item failed")
            refused[i] = Refused(f"malformed item: {one_line(exc)}")
    return items, refused


def merge_answers(count: int, answers: list, refused: dict[int, Refused]) -> list:
    """Put `answers` (for the items that converted, in order) back beside the refusals."""
    converted = iter(answers)
    return [refused[i] if i in refused else next(converted) for i in range(count)]


# ------------------------------------------------------------------------------------------------
# Draft distributions

def pack_distribution(q: torch.Tensor) -> common_pb2.Distribution:
    """q [V] fp32 on the host -> its packed form, exactly (fp32 on both sides): the nonzero entries
    with their ids, or all V where fewer bytes."""
    ids = torch.nonzero(q, as_tuple=True)[0]  # [nnz]
    if 2 * len(ids) >= len(q):
        return common_pb2.Distribution(probs=q.float().contiguous().numpy().tobytes())
    return common_pb2.Distribution(token_ids=ids.int().numpy().tobytes(), probs=q[ids].float().numpy().tobytes())


def pack_distributions(rows: list[torch.Tensor]) -> list[common_pb2.Distribution]:
    """`pack_distribution` for a round's q_1..q_K, brought to the host in one copy (they stay on the
    draft's device until a transport must carry them)."""
    if rows and rows[0].device.type != "cpu":
        rows = torch.stack(rows).cpu()
    return [pack_distribution(q) for q in rows]


def unpack_distribution(msg: common_pb2.Distribution, vocab_size: int) -> torch.Tensor:
    """-> q [V] fp32; raises InvalidRequestError on a malformed distribution."""
    if not msg.probs:
        raise InvalidRequestError("a draft distribution needs its probs")
    if len(msg.probs) % 4 or len(msg.token_ids) % 4:
        raise InvalidRequestError("a draft distribution's bytes must hold whole float32 / int32 values")
    probs = torch.frombuffer(bytearray(msg.probs), dtype=torch.float32)  # [nnz] or [V]
    if msg.token_ids:
        ids = torch.frombuffer(bytearray(msg.token_ids), dtype=torch.int32).long()  # [nnz]
        if len(ids) != len(probs):
            raise InvalidRequestError("a draft distribution needs one prob per token id")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(torch.unique(ids)) != len(ids):
            raise InvalidRequestError(f"draft distribution token ids must be distinct and in [0, {vocab_size})")
    elif len(probs) != vocab_size:
        raise InvalidRequestError(f"a dense draft distribution needs {vocab_size} probs, got {len(probs)}")
    if bool((probs < 0).any()) or not math.isclose(float(probs.double().sum()), 1.0, abs_tol=1e-3):
        raise InvalidRequestError("draft distribution probs must be non-negative and sum to 1")
    if not msg.token_ids:
        return probs
    return torch.zeros(vocab_size, dtype=torch.float32).index_put_((ids,), probs)


def sparsifier(min_prob: float):
    """The draft worker's logits filter for `min_prob` (None when 0: q travels exactly)."""
    if min_prob <= 0:
        return None
    return lambda sampling: (lambda logits: sparsify_logits(logits, sampling, min_prob)) if q_travels(sampling) else None


def sparsify_logits(logits: torch.Tensor, sampling: SamplingParams, min_prob: float = SPARSE_MIN_PROB) -> torch.Tensor:
    """logits [..., V] -> logits whose processed distributions have no entry at or below `min_prob`.

    Applied to the draft's logits BEFORE `probs_from_logits`/sampling, so the candidate is drawn
    from the truncated, renormalised q and that q is what the draft sends (exactness, see
    common.proto). The argmax is always kept. Greedy requests send no q: they are left alone.
    """
    if not q_travels(sampling) or min_prob <= 0:
        return logits
    q = probs_from_logits(logits, sampling)  # [..., V]
    drop = (q <= min_prob).scatter(-1, torch.argmax(q, dim=-1, keepdim=True), False)
    return logits.masked_fill(drop, -math.inf)


# ------------------------------------------------------------------------------------------------
# The public request and response

def params_from_request(request: generation_pb2.GenerateRequest, default_policy: PolicyConfig,
                        api_key: str | None = None) -> GenerationParams:
    """The request's parameters; an unset policy, k or threshold falls back to the server's default
    policy (k and threshold only when the request names no other policy); a request for the cache
    of earlier responses reads the one of the server's key (`api_key`). Raises InvalidRequestError
    with a one-line reason."""
    def given(name: str):
        return getattr(request, name) if request.HasField(name) else None

    scope = None
    if given("suffix_cache"):
        if not api_key:
            raise InvalidRequestError("a cache of earlier responses is kept per API key: this server has none "
                                      "(api_key, SPECDEC_API_KEY)")
        scope = cache_scope(api_key)
    policy = given("policy") if request.HasField("policy") else default_policy.name  # ("" is refused)
    same_policy = policy == default_policy.name
    return build_params(
        policy=policy,
        k=given("k") if request.HasField("k") else (default_policy.k if same_policy else None),
        threshold=given("threshold") if request.HasField("threshold") else (
            default_policy.threshold if same_policy else None),
        temperature=request.temperature, top_p=given("top_p"), top_k=request.top_k, seed=given("seed"),
        max_new_tokens=given("max_new_tokens"), n=given("n"), stop=tuple(request.stop) or None,
        chat_template=given("chat_template"), draft=given("draft"), cache_scope=scope)


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
