"""The two halves of a speculation round over a batch of sessions, shared by the in-process engine
and the services.

`propose` runs on the draft's side: every drafting step is one forward pass over the sessions still
drafting, and each session's policy decides its own stop (Algorithm 2); a session that stops leaves
the next step. `verify` runs on the target's side: one pass over every session's unseen committed
tokens plus its candidates (a different K each), Algorithm 1 per session, then a rollback per
session. Each row names its session's full committed history: the runtimes sync their caches to it.
Randomness comes from `round_generator`, derived from (request seed, sample, round, role), so a
round draws the same numbers whichever process, replica or batch runs it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.models.runtime import DraftRole, KVSession, TargetRole
from specdec.policies import Decision, DraftStep, StoppingPolicy
from specdec.sampling import SamplingParams, choose_token, probs_from_logits
from specdec.verification import Verdict, verify_greedy, verify_sampled

SEED_BITS = 63


def round_generator(request_seed: int, sample_index: int, round_index: int, role: str) -> torch.Generator:
    """An independent generator per (request seed, sample, round, role)."""
    key = f"{request_seed}:{sample_index}:{round_index}:{role}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> (64 - SEED_BITS)
    return torch.Generator().manual_seed(seed)


@dataclass
class Proposal:
    candidates: list[int] = field(default_factory=list)  # y_1..y_K
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q_1..q_K, each [V]; sampled rounds only
    forward_passes: int = 0  # draft passes this session took part in


@dataclass
class DraftRow:
    """One session's part of a batched propose."""

    session: KVSession
    history: list[int]  # the committed history to draft after
    policy: StoppingPolicy
    limit: int  # most candidates (token budget and context)
    num_generated: int  # tokens generated before this round
    sampling: SamplingParams
    generator: torch.Generator
    # Applied to the draft's logits before sampling (services: sparsify what travels); None: as is.
    logits_filter: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class TargetRow:
    """One session's part of a batched verify."""

    session: KVSession
    history: list[int]  # the committed history before the candidates
    candidates: list[int]  # y_1..y_K, K >= 0
    draft_probs: list[torch.Tensor]  # q_1..q_K [V] each; empty when greedy
    sampling: SamplingParams
    generator: torch.Generator


class _Drafting:
    """A row while it drafts: its proposal so far and e_{i-1}."""

    def __init__(self, row: DraftRow):
        self.row, self.proposal = row, Proposal()
        self.prev_hidden: torch.Tensor | None = None  # e_{i-1}; None while i = 1
        self.hidden: torch.Tensor | None = None  # e_{i-1}, and at i = 1 the last committed token's state
        self.limit = min(row.limit, row.policy.round_limit())

    def take(self, logits: torch.Tensor) -> bool:
        """Sample y_i from the draft's logits and ask the policy; True while the row drafts on."""
        row, proposal = self.row, self.proposal
        if row.logits_filter is not None:
            logits = row.logits_filter(logits)
        q = probs_from_logits(logits, row.sampling)  # [V]
        y = choose_token(q, row.sampling, row.generator)
        decision = row.policy.decide(DraftStep(len(proposal.candidates) + 1, y, q, self.prev_hidden, row.num_generated,
                                               self.hidden, row.sampling.greedy))
        if decision is Decision.DROP_LAST:
            return False
        proposal.candidates.append(y)
        if not row.sampling.greedy:  # greedy verification is exact match: q stays here
            proposal.draft_probs.append(q)
        return decision is not Decision.STOP and len(proposal.candidates) < self.limit


def propose(draft: DraftRole, rows: list[DraftRow]) -> list[Proposal]:
    """Draft up to each row's limit after its history, asking its policy after every token."""
    drafting = [_Drafting(row) for row in rows]
    active = [d for d in drafting if d.row.policy.uses_draft and d.limit > 0]
    for d in active:
        d.row.policy.start_round()
    outputs = draft.start([d.row.session for d in active], [d.row.history for d in active]) if active else []
    while active:
        still = []
        for d, out in zip(active, outputs):
            d.proposal.forward_passes += 1
            d.hidden = out.hidden  # the state q_i comes from (e_0 after `start`)
            if d.take(out.logits):
                still.append(d)
        active = still
        if active:
            outputs = draft.step([d.row.session for d in active], [d.proposal.candidates[-1] for d in active])
            for d, out in zip(active, outputs):
                d.prev_hidden = out.hidden  # e_i, read by the policy at step i + 1
    return [d.proposal for d in drafting]


def verify(target: TargetRole, rows: list[TargetRow]) -> list[Verdict]:
    """One target pass over every row's unseen history plus its candidates, Algorithm 1 per row, and
    each cache rolled back to its history + the accepted candidates."""
    if not rows:
        return []
    all_logits = target.score([r.session for r in rows], [r.history for r in rows], [r.candidates for r in rows])
    verdicts = []
    for row, target_logits in zip(rows, all_logits):  # target_logits [K+1, V]
        ids = torch.tensor(row.candidates, dtype=torch.long)
        if row.sampling.greedy:
            verdict = verify_greedy(ids, target_logits)
        else:
            target_probs = probs_from_logits(target_logits, row.sampling)  # [K+1, V]
            q = torch.stack(row.draft_probs) if row.draft_probs else target_probs[:0]
            verdict = verify_sampled(ids, q, target_probs, row.generator)
        target.rollback(row.session, len(row.history) + verdict.num_accepted)
        verdicts.append(verdict)
    return verdicts
