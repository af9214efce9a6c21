"""The two halves of a speculation round over a batch of sessions, shared by the in-process engine
and the services.

`propose` runs on the draft's side: every drafting step is one forward pass over the sessions still
drafting (Algorithm 2). A budgeted session (the default policy) is decided with the whole step by
its verification budget (specdec/budget.py: who drafts on, which candidates are verified); any other
session's policy decides its own stop. A session that stops leaves the next step. `verify` runs on the target's side: one pass over every session's unseen committed
tokens plus its candidates (a different K each), Algorithm 1 per session, then a rollback per
session. Each row names its session's full committed history: the runtimes sync their caches to it.
Randomness comes from `round_generator`, derived from (request seed, sample, round, role), so a
round draws the same numbers whichever process, replica or batch runs it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.budget import IN_STEP_LAG, StepBudget, drafting_pays, expected_tokens
from specdec.cost_profile import CostProfile, PassTiming
from specdec.metrics import MS_PER_S
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
    """A row while it drafts: its proposal so far, e_{i-1}, and for a budgeted policy the estimated
    acceptance a_j of its kept candidates (budget.py)."""

    def __init__(self, row: DraftRow):
        self.row, self.proposal = row, Proposal()
        self.prev_hidden: torch.Tensor | None = None  # e_{i-1}; None while i = 1
        self.hidden: torch.Tensor | None = None  # e_{i-1}, and at i = 1 the last committed token's state
        self.limit = min(row.limit, row.policy.round_limit())
        self.budgeted = row.policy.traits.budgeted
        self.acceptance: list[float] = []  # budgeted: a_1..a_i of the kept candidates

    @property
    def survive(self) -> float:
        """P_i: the estimated probability that every kept candidate is accepted."""
        return math.prod(self.acceptance)

    @property
    def left(self) -> int:
        return self.limit - len(self.proposal.candidates)

    def draw(self, logits: torch.Tensor) -> tuple[DraftStep, torch.Tensor]:
        """Sample y_i from the draft's logits: the step the policy (or the budget) judges, and q_i."""
        row = self.row
        if row.logits_filter is not None:
            logits = row.logits_filter(logits)
        q = probs_from_logits(logits, row.sampling)  # [V]
        y = choose_token(q, row.sampling, row.generator)
        return DraftStep(len(self.proposal.candidates) + 1, y, q, self.prev_hidden, row.num_generated, self.hidden,
                         row.sampling.greedy), q

    def append(self, step: DraftStep, q: torch.Tensor) -> None:
        self.proposal.candidates.append(step.token)
        if not self.row.sampling.greedy:  # greedy verification is exact match: q stays here
            self.proposal.draft_probs.append(q)

    def decide(self, step: DraftStep, q: torch.Tensor) -> bool:
        """A policy that decides on its own: True while the row drafts on."""
        decision = self.row.policy.decide(step)
        if decision is Decision.DROP_LAST:
            return False
        self.append(step, q)
        return decision is not Decision.STOP and self.left > 0


def propose(draft: DraftRole, rows: list[DraftRow], costs: CostProfile | None = None, other_sessions: int = 0,
            timings: list[PassTiming] | None = None) -> list[Proposal]:
    """Draft up to each row's limit after its history. A budgeted row's round is decided by the
    step's budget (budget.py) over `costs` (required when there is one), beside `other_sessions`
    sessions of the step that verify plainly elsewhere; any other row asks its policy after every
    token. Each drafting step's time (its host work included) is appended to `timings`."""
    drafting = [_Drafting(row) for row in rows]
    active = [d for d in drafting if d.row.policy.uses_draft and d.limit > 0]
    budget = None
    if any(d.budgeted for d in active):
        if costs is None:
            raise ValueError("budgeted policies need a cost profile")
        sessions = len(rows) + other_sessions
        if not drafting_pays(costs, sessions, max(d.limit for d in active if d.budgeted)):
            active = [d for d in active if not d.budgeted]
        budget = StepBudget(costs, expected=float(sessions), tokens=sessions)
    for d in active:
        d.row.policy.start_round()
    fed = draft.fed_tokens
    start = time.perf_counter()
    outputs = draft.start([d.row.session for d in active], [d.row.history for d in active]) if active else []
    while active:
        if budget is not None:  # a catch-up beyond a round's unseen tokens is the loop's investment
            budget.spent_ms += costs.draft_ms(min(draft.fed_tokens - fed, IN_STEP_LAG * len(active)))
        still, judged = [], []
        for d, out in zip(active, outputs):
            d.proposal.forward_passes += 1
            d.hidden = out.hidden  # the state q_i comes from (e_0 after `start`)
            step, q = d.draw(out.logits)
            if not d.budgeted:
                if d.decide(step, q):
                    still.append(d)
                if budget is not None and len(d.proposal.candidates) == step.index:
                    budget.tokens += 1
                continue
            estimate = d.row.policy.estimate(step)
            if estimate.previous is not None and d.acceptance:  # y_{i-1} judged one step late
                budget.expected -= expected_tokens(d.acceptance)
                d.acceptance[-1] = estimate.previous
                budget.expected += expected_tokens(d.acceptance)
            judged.append((d, step, q, estimate))
        if judged:
            kept = budget.keep([d.survive * e.blind for d, _, _, e in judged])
            judged = [(d, step, q, e) for (d, step, q, e), keep in zip(judged, kept) if keep]
            for d, step, q, e in judged:
                d.append(step, q)
                d.acceptance.append(e.known)
                budget.add(d.survive)
            on = budget.draft_on([d.survive for d, *_ in judged], [e.known for *_, e in judged],
                                 [d.left for d, *_ in judged], beside=len(still))
            still += [d for (d, *_), go in zip(judged, on) if go]
        if timings is not None:
            timings.append(PassTiming("draft", draft.fed_tokens - fed, (time.perf_counter() - start) * MS_PER_S))
        active = still
        if active:
            fed, start = draft.fed_tokens, time.perf_counter()
            outputs = draft.step([d.row.session for d in active], [d.proposal.candidates[-1] for d in active])
            for d, out in zip(active, outputs):
                d.prev_hidden = out.hidden  # e_i, read by the policy at step i + 1
    return [d.proposal for d in drafting]


def verify(target: TargetRole, rows: list[TargetRow], timings: list[PassTiming] | None = None) -> list[Verdict]:
    """One target pass over every row's unseen history plus its candidates, Algorithm 1 per row, and
    each cache rolled back to its history + the accepted candidates. The whole of it is timed into
    `timings` by the tokens the pass fed."""
    if not rows:
        return []
    fed, start = target.fed_tokens, time.perf_counter()
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
    if timings is not None:
        timings.append(PassTiming("verifier", target.fed_tokens - fed, (time.perf_counter() - start) * MS_PER_S))
    return verdicts
