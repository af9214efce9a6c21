"""The round protocol between the loop and the draft and verifier workers, whatever carries it (in
process, gRPC, Ray Serve). protos/specdec/v1 mirrors these messages field for field; the services
convert at their edges (services/convert.py).

The loop's token history is the truth; a worker's session (KV cache, policy, history) is a cache of
it. Every call carries, per session, only the committed tokens the worker has not seen
(`HistoryDelta`); a worker whose session cannot take the delta (evicted, restarted, another
replica) answers `SessionMissing`, and the loop sends the same round again with the whole history.
A worker never guesses missing tokens.

One batched call holds many sessions; each gets its own answer: its result, `SessionMissing`,
`Refused` (a user error for that session only) or, set by a transport, `Unreachable` (its replica
is gone: the loop retries it, elsewhere) or `Failed` (the call that carried it failed otherwise:
that session fails, the other replicas' sessions go on).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch

from specdec.cost_profile import CostProfile, PassTiming
from specdec.errors import InvalidRequestError
from specdec.policies import PolicyConfig
from specdec.sampling import SamplingParams
from specdec.verification import Verdict

Role = Literal["draft", "verifier"]


@dataclass(frozen=True)
class HistoryDelta:
    """The committed tokens a worker needs before it can serve a round.

    Worked example: the first call sends length 7, tail [p1..p7] (the prompt), full; a round then
    commits y1 y2 y'; the next call sends length 10, tail [y1 y2 y'], not full. A worker serves a
    call that is not full only if it holds exactly length - len(tail) tokens of the session.
    """

    length: int  # of the full history, tail included
    tail: list[int]  # the last len(tail) tokens: those committed since the previous call
    full: bool  # the tail is the whole history: create or replace the session
    # Tokens the worker holds past length - len(tail) that the history does not have: a round
    # drafted ahead (ProposeItem.ahead) on candidates that verification then rejected. Dropped first.
    drop: int = 0


def delta_for(sample, synced_length: int | None, drop: int = 0, ahead: Sequence[int] = ()) -> HistoryDelta:
    """What a worker that last saw the first `synced_length` tokens of a sample's history, and
    `drop` tokens past them the history does not have, needs (None: it saw nothing); `sample` a
    sequences.SampleState (its `length` and `since` build no history). `ahead`: tokens sent after
    the history as if committed (a round drafted ahead drafts after the candidates being verified)."""
    if synced_length is None:
        return HistoryDelta(sample.length + len(ahead), sample.history + list(ahead), full=True)
    return HistoryDelta(sample.length + len(ahead), sample.since(synced_length) + list(ahead), full=False, drop=drop)


def ids_in_range(ids: Sequence[int], vocab_size: int) -> bool:
    """Every id in [0, vocab_size) (min and max at C speed: every session's ids, every step)."""
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def history_from_delta(held: list[int] | None, delta: HistoryDelta, vocab_size: int) -> list[int] | None:
    """The full committed history after `delta`, or None when the worker must answer SessionMissing
    (it holds no session, or a history of the wrong length). Raises InvalidRequestError on a
    malformed delta.

    Worked example: held = [p1..p7]; delta = (10, [y1 y2 y'], not full) -> 7 == 10 - 3, so the
    history is [p1..p7 y1 y2 y']. With held = None -> None. With held = [p1..p7 c1 c2] (a round
    drafted ahead after candidates c1 c2; c1 was accepted, y' came instead of c2) and delta = (9, [y'],
    not full, drop 1) -> it holds 9 - 1 + 1 tokens: it keeps 8, and the history is [p1..p7 c1 y'].
    """
    if delta.length < 1:
        raise InvalidRequestError(f"history-length must be at least 1, got {delta.length}")
    if delta.drop < 0:
        raise InvalidRequestError(f"history drop must be at least 0, got {delta.drop}")
    if not ids_in_range(delta.tail, vocab_size):
        raise InvalidRequestError(f"history token ids must be in [0, {vocab_size})")
    if delta.full:
        if len(delta.tail) != delta.length:
            raise InvalidRequestError(f"a full history must send all {delta.length} tokens, got {len(delta.tail)}")
        return list(delta.tail)
    base = delta.length - len(delta.tail)
    if base < 0:  # (held[:base] would have cut from the end and served a history of another length)
        raise InvalidRequestError(f"a history of {delta.length} tokens cannot end with {len(delta.tail)} new ones")
    if held is None or len(held) != base + delta.drop:
        return None
    return held[:base] + list(delta.tail)


SEED_BITS = 63
REQUEST_SEEDS = 1 << 64  # a request's seed travels as a uint64 (RoundSeed.request_seed)


def request_seed(seed: int | None) -> int:
    """The seed a request's rounds draw from: its own taken modulo 2^64 (a negative one as the
    uint64 of the same bits, in process as served), or a fresh random one."""
    return seed % REQUEST_SEEDS if seed is not None else secrets.randbits(SEED_BITS)


def round_generator(request_seed: int, sample_index: int, round_index: int, role: str) -> torch.Generator:
    """An independent generator per (request seed, sample, round, role)."""
    key = f"{request_seed}:{sample_index}:{round_index}:{role}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> (64 - SEED_BITS)
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class RoundSeed:
    """Where a round's random numbers come from: each side seeds a fresh generator from it and its
    role, so a round draws the same numbers on any replica, in any batch and after a retry."""

    request_seed: int
    sample_index: int  # which of the request's n samples
    round_index: int  # of this sample; a round sent again keeps its index

    def generator(self, role: str, sampling: SamplingParams) -> torch.Generator | None:
        """The round's generator for `role`; None for a greedy round, which draws nothing."""
        if sampling.greedy:
            return None
        return round_generator(self.request_seed, self.sample_index, self.round_index, role)


def q_travels(sampling: SamplingParams) -> bool:
    """Whether a round's draft distributions q go to the verifier: only sampled verification reads
    them (greedy verification is an exact match against the target's argmax)."""
    return not sampling.greedy


@dataclass(frozen=True)
class StepPlan:
    """One step's plan (specdec/planner.py): who calls the draft, and what the draft side spends a
    budgeted session's round with. Only `costs`, `other_sessions`, `acceptance` and `target_vocab`
    travel with a Propose.

    `costs` None: nothing priced the step, and a budgeted session drafts nothing (no round drafts on
    costs measured elsewhere)."""

    drafting: frozenset[str] = frozenset()  # the session ids that call the draft this step
    probe: str | None = None  # the session whose item carries the off-probe (ProposeItem.probe)
    probe_tokens: int = 0  # > 0: the verifier times a scratch pass of this many tokens after the step
    costs: CostProfile | None = None  # the profile the step was priced with
    other_sessions: int = 0  # the step's sessions not in the Propose (each verifies one token beside them)
    # session id -> why a session whose policy drafts does not call the draft (metrics.HELD); a fused
    # draft's held sessions call it all the same, their suffix only (ProposeItem.held)
    held: dict[str, str] = field(default_factory=dict)
    # The planner's estimate of the draft's acceptance (planner.py `StepPlanner.acceptance`): a fused
    # draft prices the model's continuation of the suffix's candidates with it (proposers.py
    # `FusedProposer`). None: not planned with one.
    acceptance: float | None = None
    # (the target's rows, its tokenizer's ids), which the loop's calls name from its rules (calls.py
    # `RoundCalls`): a draft built without reading its target (a served draft replica's) fits itself to
    # it (workers.py `DraftWorker.fit`). None: not named, the draft as it is.
    target_vocab: tuple[int, int] | None = None


@dataclass
class Proposal:
    """A drafted round: its candidates and, when sampled, the draft distributions they were drawn from."""

    candidates: list[int] = field(default_factory=list)  # y_1..y_K
    draft_probs: list = field(default_factory=list)  # q_1..q_K, each [V] (or its wire form); sampled rounds only
    forward_passes: int = 0  # draft passes this session took part in


@dataclass
class ProposeItem:
    """One session's part of a batched Propose."""

    session_id: str
    history: HistoryDelta
    policy: PolicyConfig
    sampling: SamplingParams
    max_candidates: int  # the token budget and the context left, minus the round's correction/bonus token
    num_generated: int  # tokens generated before this round
    # (K, n) of the rounds since the previous call, oldest first; with history.full, every round so
    # far, so a worker that rebuilds the session replays them into a fresh policy.
    rounds: list[tuple[int, int]]
    seed: RoundSeed
    reference: list[int] | None = None  # the oracle's hindsight (in process only; never on the wire)
    # The loop keeps the draft off this step: draft nothing for it, but time one scratch pass of the
    # step's size (the draft's costs are otherwise not measured while it is off).
    probe: bool = False
    # A feature draft's input: the target's states [m, reads, H] at positions features_start.. (the
    # verifications' since the previous call; from 0 with a full history). None: none this call.
    features: torch.Tensor | None = None
    features_start: int = 0
    # Drafted ahead, while the previous round verifies (loop.py): the history ends in that round's
    # candidates, not yet verified, and the first token drafted guesses its bonus token (outside the
    # policy's round, which drafts after it; max_candidates counts it). The guess
    # draws its random numbers as role "draft-guess", the candidates after it those of the round
    # they become (`seed` is that round's): a round kept from ahead is the one drafted after the
    # verdict would be (same history, same numbers), so a seeded request's output does not depend
    # on whether its rounds were drafted ahead. Whether one is kept depends on the verdict and the
    # guess only, never on those numbers: a round drafted again after one was thrown away may reuse them.
    ahead: bool = False
    # The plan holds this session's model draft this step (StepPlan.held): a fused draft drafts its
    # suffix only (proposers.py `FusedProposer`); any other draft is not called for a held session.
    held: bool = False
    # The cache of earlier responses the session's suffix draft reads and adds its response to
    # (GenerationParams.cache_scope; models/suffix.py `SuffixDraft.remember`), sent with a full
    # history only: the session keeps it. None: none.
    cache_scope: str | None = None


@dataclass
class VerifyItem:
    """One session's part of a batched Verify."""

    session_id: str
    history: HistoryDelta
    candidates: list[int]  # y_1..y_K, K >= 0
    draft_probs: list[torch.Tensor]  # q_1..q_K [V] each when sampled; empty when greedy
    sampling: SamplingParams
    seed: RoundSeed
    # A feature draft's session: the verdict carries the target's states at the committed positions
    # from this one on (Verdict.features). None: the draft reads none.
    features_from: int | None = None


@dataclass(frozen=True)
class SessionMissing:
    """The worker does not hold the session's history: send the round again in full."""


@dataclass(frozen=True)
class Refused:
    """A user error in this session's request (one line); the rest of the batch is served."""

    reason: str


@dataclass(frozen=True)
class Unreachable:
    """The replica holding this session is gone: the loop retries the round, in full, elsewhere."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The call carrying this session failed for good (a bug or a final error on its replica)."""

    error: Exception


T = TypeVar("T")


@dataclass
class CallTiming:
    """One call to one replica, covering `indices` of the batch."""

    indices: list[int]
    compute_s: float  # the worker's own time (reported by it)
    wall_s: float  # the call's wall time at the caller; wall - compute is transport
    num_bytes: int = 0  # serialized request + reply (0 in process)


@dataclass
class BatchReply(Generic[T]):
    """What a transport returns for a batched call: an answer per item, in order, and its calls."""

    answers: list  # [B]: T | SessionMissing | Refused | Unreachable | Failed
    calls: list[CallTiming] = field(default_factory=list)
    passes: list[PassTiming] = field(default_factory=list)  # the replicas' timed passes (live costs)


ProposeReply = BatchReply[Proposal]
VerifyReply = BatchReply[Verdict]
