"""The two halves of a speculation round over a batch of sessions, shared by the in-process engine
and the services.

`propose` runs on the draft's side: every drafting step is one forward pass over the sessions still
drafting (Algorithm 2), or, where the draft chains greedy steps (a feature draft on CUDA), one step
of a chain drafted ahead (`_Ahead`). A budgeted session (the default policy) is decided with the
whole step by its verification budget (specdec/budget.py: who drafts on, which candidates are
verified); any other session's policy decides its own stop. A session that stops leaves the next
step. Who calls the draft at all was decided by the caller's step plan (specdec/planner.py).
`verify` runs on the target's side: one pass over every session's unseen committed tokens plus its candidates (a
different K each), Algorithm 1 per session, then a rollback per session. Each row names its
session's full committed history: the runtimes sync their caches to it. Randomness comes from
`protocol.round_generator`, derived from (request seed, sample, round, role), so a round draws the
same numbers whichever process, replica or batch runs it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.budget import IN_STEP_LAG, StepBudget, expected_tokens
from specdec.cost_profile import CostProfile, PassTiming
from specdec.metrics import MS_PER_S
from specdec.models.runtime import DraftOutputs, DraftRole, KVSession, Scores, TargetRole
from specdec.models.static import graphs_captured
from specdec.policies import Decision, DraftStep, StoppingPolicy
from specdec.policies.specdec_pp import head_acceptances
from specdec.protocol import Proposal, q_travels
from specdec.sampling import (SamplingParams, argmax, choose_tokens, probs_by_params, probs_in_place, rows_by,
                              transform_of)
from specdec.verification import (RoundBatch, Verdict, final_distributions, verify_greedy_batch,
                                  verify_sampled_batch)


@dataclass
class DraftRow:
    """One session's part of a batched propose."""

    session: KVSession
    history: list[int]  # the committed history to draft after
    policy: StoppingPolicy
    limit: int  # most candidates (token budget and context)
    num_generated: int  # tokens generated before this round
    sampling: SamplingParams
    generator: torch.Generator | None  # sampled rows only: a greedy round draws nothing
    # A round drafted ahead (ProposeItem.ahead): its first token guesses the bonus token of the round
    # being verified, drawn from `guess_generator` (sampled) and outside the policy's round: the
    # policy drafts its candidates after it as a round of its own, and the proposal is the guess
    # and then they (`limit` counts the guess).
    guess: bool = False
    guess_generator: torch.Generator | None = None
    # A fused draft's round (proposers.py `FusedProposer`): the candidates chosen before the draft's
    # passes (the suffix's, each with its estimate `judged`), which the draft feeds after the history
    # and continues. `held`: the step's plan holds this session's model draft: only its suffix drafts.
    prefix: list[DraftStep] = field(default_factory=list)
    held: bool = False


# sampling -> a function applied to the draft's logits [N, V] of rows with that sampling before they
# are sampled (None: none). The served draft truncates what it sends this way (services.convert.sparsify_logits).
LogitsFilterFactory = Callable[[SamplingParams], Callable[[torch.Tensor], torch.Tensor] | None]


@dataclass
class TargetRow:
    """One session's part of a batched verify."""

    session: KVSession
    history: list[int]  # the committed history before the candidates
    candidates: list[int]  # y_1..y_K, K >= 0
    draft_probs: list[torch.Tensor]  # q_1..q_K [V] each; empty when greedy
    sampling: SamplingParams
    generator: torch.Generator | None  # sampled rows only
    # A feature draft's session: return the target's states at the committed positions from this one
    # on (the cache is rolled back to it first, so a draft that lost them gets them again). None: none.
    features_from: int | None = None


def in_groups(rows: list, size: int | None, run: Callable[[list], list]) -> list:
    """`run` over consecutive groups of at most `size` rows (None: all at once), its answers in order.
    A pooled cache (models/pool.py: llama.cpp's sequences, the static cache's rows) holds `size`
    sessions: a call over more would run as several passes, each evicting the sessions of the ones
    before it, and the call's next pass (a drafting step; the next round's verification) would find
    the rows it needs held by sessions it may not evict. A group evicts only earlier groups' sessions,
    which re-prefill at their next call."""
    size = size or len(rows) or 1
    answers: list = []
    for start in range(0, len(rows), size):
        answers += run(rows[start:start + size])
    return answers


class Drafting:
    """A row while it drafts: its proposal so far, e_{i-1}, and for a budgeted policy the estimated
    acceptance a_j of its kept candidates (budget.py)."""

    def __init__(self, row: DraftRow):
        self.row, self.proposal = row, Proposal()
        self.prev_hidden: torch.Tensor | None = None  # e_{i-1}; None while i = 1
        self.hidden: torch.Tensor | None = None  # e_{i-1}, and at i = 1 the last committed token's state
        self.guessing = row.guess  # its next token is the guess (DraftRow.guess)
        self.guessed: DraftStep | None = None
        self.limit = min(row.limit - row.guess, row.policy.round_limit())
        self.budgeted = row.policy.traits.budgeted
        self.acceptance: list[float] = []  # budgeted: a_1..a_i of the kept candidates
        for step in row.prefix:  # already in the step's budget (its caller's)
            self.append(step)
            self.acceptance.append(step.judged)

    @property
    def last_token(self) -> int:
        """The token the next drafting step feeds."""
        return self.proposal.candidates[-1] if self.proposal.candidates else self.guessed.token

    def proposed(self) -> Proposal:
        """Its proposal: the guess first where it drafted one."""
        if self.guessed is None:
            return self.proposal
        probs = [self.guessed.probs] if q_travels(self.row.sampling) else []
        return Proposal([self.guessed.token] + self.proposal.candidates, probs + self.proposal.draft_probs,
                        self.proposal.forward_passes)

    @property
    def survive(self) -> float:
        """P_i: the estimated probability that every kept candidate is accepted."""
        return math.prod(self.acceptance)

    @property
    def left(self) -> int:
        return self.limit - len(self.proposal.candidates)

    def append(self, step: DraftStep) -> None:
        self.proposal.candidates.append(step.token)
        if q_travels(self.row.sampling):
            self.proposal.draft_probs.append(step.probs)

    def decided(self, step: DraftStep, decision: Decision) -> bool:
        """A policy that decides on its own: True while the row drafts on."""
        if decision is Decision.DROP_LAST:
            return False
        self.append(step)
        return decision is not Decision.STOP and self.left > 0


def draw(active: list[Drafting], outputs: DraftOutputs, logits_filter: LogitsFilterFactory | None = None,
         ahead: AheadStep | None = None) -> list[DraftStep]:
    """Sample y_i for every drafting row at once from the step's logits [A, V]: the steps their
    policies (or the budget) judge, q_i in each (None where nothing reads it: a greedy row whose
    policy does not). One softmax per distinct sampling, one argmax, one inverse-CDF draw per
    sampled row from its own generator (sampling.choose_tokens). A step of a chain comes with its
    tokens and the head's judgements read already (`ahead`): nothing is read back here."""
    logits = outputs.logits  # [A, V]
    params = [d.row.sampling for d in active]
    if logits_filter is not None:
        filtered = logits
        for rows in rows_by([transform_of(p) for p in params]).values():
            if (keep := logits_filter(params[rows[0]])) is not None:
                filtered = logits.clone() if filtered is logits else filtered
                index = torch.tensor(rows, device=logits.device)
                filtered[index] = keep(logits[index])
        logits = filtered
    reads = any(not p.greedy or d.row.policy.traits.reads_distribution for d, p in zip(active, params))
    probs = probs_by_params(logits, params) if reads else None  # [A, V]
    if ahead is None:
        generators = [d.row.guess_generator if d.guessing else d.row.generator for d in active]
        tokens, judged = choose_tokens(logits, probs, params, generators), [None] * len(active)
    else:
        tokens, judged = ahead.tokens, ahead.judged
    return [DraftStep(len(d.proposal.candidates) + 1, y, probs[b] if probs is not None else None, d.prev_hidden,
                      d.row.num_generated, d.hidden, d.row.sampling.greedy, a)
            for b, (d, y, a) in enumerate(zip(active, tokens, judged))]


def by_policy(active: list[Drafting], steps: list[DraftStep], ask: str) -> list:
    """Ask every row's policy about its step, one call per policy class (`StoppingPolicy.decide_many`
    or `estimate_many`: a head runs once for all its sessions)."""
    answers: list = [None] * len(active)
    for cls, rows in rows_by([type(d.row.policy) for d in active]).items():
        replies = getattr(cls, ask)([active[b].row.policy for b in rows], [steps[b] for b in rows])
        for b, reply in zip(rows, replies):
            answers[b] = reply
    return answers


@dataclass
class AheadStep:
    """One step of a chain as `propose` takes it: the rows still drafting, in their order."""

    outputs: DraftOutputs  # logits [A, V], hidden [A, H]
    tokens: list[int]  # y_i: the argmax of each row's logits
    judged: list[float | None]  # the head's judged acceptance (None: the row's policy has no head)


def read_ahead(outputs: list[DraftOutputs], active: list[Drafting]) -> tuple[list[list[int]], list[list[float | None]]]:
    """A chain's tokens [N][A] (each step's argmax: only greedy rows chain) and, for the rows whose
    policy has an acceptance head, the head's judgement of every step's candidate [N][A], computed
    for all the chain's steps in one head call per head and read back in one copy: the drafting
    phase's one host sync. A row at chain step k drafts candidate len(candidates) + 1 + k."""
    steps, rows = len(outputs), len(active)
    logits = torch.stack([o.logits for o in outputs])  # [N, A, V]
    tokens = argmax(logits.flatten(0, 1)).view(steps, rows)  # [N, A]
    judged = torch.full((steps, rows), math.nan, dtype=torch.float64, device=logits.device)  # [N, A]
    for head, group in rows_by([d.row.policy.head for d in active]).items():
        if head is None:
            continue
        index = torch.tensor(group, device=logits.device)
        first = torch.tensor([len(active[b].proposal.candidates) + 1 for b in group], device=logits.device)  # [R]
        positions = first + torch.arange(steps, device=logits.device)[:, None]  # [N, R]
        chosen = logits[:, index].flatten(0, 1)  # [N*R, V]
        probs = probs_by_params(chosen, [active[b].row.sampling for b in group] * steps)
        hidden = torch.stack([o.hidden[index] for o in outputs]).flatten(0, 1)  # [N*R, H]
        values = head_acceptances(head, hidden, probs, tokens[:, index].flatten(), positions.flatten(), True)
        judged[:, index] = values.view(steps, len(group)).double()
    read = torch.cat([tokens.double().flatten(), judged.flatten()]).tolist()  # exact: ids < 2^53
    cut = steps * rows
    token_rows = [[int(t) for t in read[k * rows:(k + 1) * rows]] for k in range(steps)]
    judged_rows = [[None if math.isnan(a) else a for a in read[cut + k * rows:cut + (k + 1) * rows]]
                   for k in range(steps)]
    return token_rows, judged_rows


class _Ahead:
    """Greedy drafting steps drafted ahead as one chain (`DraftRole.chain`: a draft that runs them on
    the device with no host work between) and handed to `propose` one step at a time, each step's
    rows those still drafting. Only greedy rows: their tokens are the chain's argmax, what `draw`
    takes; the head judges every step's candidate at once (`read_ahead`), so the policies and the
    budget decide each step on numbers already on the host. Each step is priced at the chain's time
    over its steps (drafted past a stop, the rest is waste the chain trades for its launches and
    syncs)."""

    def __init__(self, draft: DraftRole, active: list[Drafting], steps: int):
        start, self.since = time.perf_counter(), graphs_captured()  # its steps go untimed if the chain captured
        self.outputs = draft.chain([d.row.session for d in active], [d.last_token for d in active], steps)
        self.tokens, self.judged = read_ahead(self.outputs, active)
        self.ms = (time.perf_counter() - start) * MS_PER_S
        self.row = {id(d): b for b, d in enumerate(active)}
        self.taken = 0

    @classmethod
    def of(cls, draft: DraftRole, active: list[Drafting]) -> _Ahead | None:
        """A chain for these rows where the draft chains and every one is greedy; None: step by step."""
        if not draft.chain_steps or not all(d.row.sampling.greedy for d in active):
            return None
        return cls(draft, active, min(draft.chain_steps, max(d.left for d in active)))

    @property
    def done(self) -> bool:
        return self.taken == len(self.outputs)

    @property
    def share_ms(self) -> float:
        """What each of its steps pays of the chain's time."""
        return self.ms / len(self.outputs)

    def step(self, active: list[Drafting]) -> AheadStep:
        k, out = self.taken, self.outputs[self.taken]
        self.taken += 1
        rows = [self.row[id(d)] for d in active]
        tokens, judged = [self.tokens[k][b] for b in rows], [self.judged[k][b] for b in rows]
        if rows == list(range(len(self.row))):  # every row, in the chain's order: no gather
            return AheadStep(out, tokens, judged)
        index = torch.tensor(rows, device=out.logits.device)
        return AheadStep(DraftOutputs(out.logits[index], out.hidden[index]), tokens, judged)


def propose(draft: DraftRole, rows: list[DraftRow], costs: CostProfile | None = None, other_sessions: int = 0,
            timings: list[PassTiming] | None = None, logits_filter: LogitsFilterFactory | None = None,
            budget: StepBudget | None = None) -> list[Proposal]:
    """Draft up to each row's limit after its history: a first pass over every row's unseen tokens
    (`DraftRole.start`), then one step a token for the rows still drafting (`still_drafting`), each
    step one forward pass or one step of a chain drafted ahead (`_Ahead`). A budgeted row's round is
    decided by the step's budget (budget.py) over `costs`, beside `other_sessions` sessions of the
    step that verify plainly elsewhere (without costs a budgeted row drafts nothing: nothing priced
    the step); any other row asks its policy after every token. Each drafting step's time (its host
    work included) is appended to `timings`, but for a step that captured a graph (models/static.py
    `graphs_captured`). `budget`: the step's budget so far, where the caller spent part of it (a
    fused draft's suffix candidates, each row's `prefix`, are in it)."""
    drafting = [Drafting(row) for row in rows]
    active = [d for d in drafting if d.row.policy.uses_draft and d.left > 0 and (costs or not d.budgeted)]
    # (a guessing row with no candidate after its guess drafts nothing: a guess alone is no round)
    if budget is None and any(d.budgeted for d in active):
        sessions = len(rows) + other_sessions
        budget = StepBudget(costs, expected=float(sessions), tokens=sessions)
    for d in active:
        d.row.policy.start_round()
    guessing = any(d.guessing for d in active)  # rows drafted ahead guess first (DraftRow.guess)
    fed, ahead, chained = draft.fed_tokens, None, None
    start, since = time.perf_counter(), graphs_captured()
    outputs = draft.start([d.row.session for d in active],
                          [d.row.history + d.proposal.candidates if d.row.prefix else d.row.history for d in active]
                          ) if active else None
    while active:
        if budget is not None:  # a catch-up beyond a round's unseen tokens is the loop's investment
            budget.spent_ms += costs.draft_ms(min(draft.fed_tokens - fed, IN_STEP_LAG * len(active)))
        for b, d in enumerate(active):
            d.proposal.forward_passes += 1
            d.hidden = outputs.hidden[b]  # the state q_i comes from (e_0 after `start`)
        steps = draw(active, outputs, logits_filter, chained)
        if guessing:  # the first step only: a guess is no candidate, its round starts after it
            guessing, guessed, judged = False, [], []
            for d, step in zip(active, steps):
                if d.guessing:
                    d.guessing, d.guessed = False, step
                    guessed.append(d)
                else:
                    judged.append((d, step))
            active = guessed + still_drafting([d for d, _ in judged], [step for _, step in judged], budget)
        else:
            active = still_drafting(active, steps, budget)
        if timings is not None and graphs_captured() == since:  # a step that captured a graph prices nothing
            timings.append(PassTiming("draft", draft.fed_tokens - fed, (time.perf_counter() - start) * MS_PER_S))
        if active:
            fed, start, since = draft.fed_tokens, time.perf_counter(), graphs_captured()
            if ahead is None or ahead.done:
                ahead = _Ahead.of(draft, active)
            if ahead is not None:  # one step of the chain: what it read and its share of the chain's time
                chained = ahead.step(active)
                outputs = chained.outputs
                fed, start, since = (draft.fed_tokens - len(active), time.perf_counter() - ahead.share_ms / MS_PER_S,
                                     ahead.since)
            else:
                chained = None
                outputs = draft.step([d.row.session for d in active], [d.last_token for d in active])
            for b, d in enumerate(active):  # e_i, read by the policy at step i + 1 (none at i = 1, after a guess)
                d.prev_hidden = outputs.hidden[b] if d.proposal.candidates else None
    return [d.proposed() for d in drafting]


def still_drafting(active: list[Drafting], steps: list[DraftStep], budget: StepBudget | None) -> list[Drafting]:
    """After a drafting step, the rows that take the next: a row whose policy decides on its own
    keeps y_i and drafts on as its policy says; the budgeted rows' y_i are kept, and they draft on,
    as the step's budget says (`StepBudget.keep` and `draft_on`, from each policy's estimate)."""
    alone = [b for b, d in enumerate(active) if not d.budgeted]
    judged_rows = [b for b, d in enumerate(active) if d.budgeted]
    still = []
    decisions = by_policy([active[b] for b in alone], [steps[b] for b in alone], "decide_many")
    for b, decision in zip(alone, decisions):
        d, step = active[b], steps[b]
        if d.decided(step, decision):
            still.append(d)
        if budget is not None and len(d.proposal.candidates) == step.index:
            budget.tokens += 1
    if not judged_rows:
        return still
    judged = []
    estimates = by_policy([active[b] for b in judged_rows], [steps[b] for b in judged_rows], "estimate_many")
    for b, estimate in zip(judged_rows, estimates):
        d = active[b]
        if estimate.previous is not None and d.acceptance:  # y_{i-1} judged one step late
            budget.expected -= expected_tokens(d.acceptance)
            d.acceptance[-1] = estimate.previous
            budget.expected += expected_tokens(d.acceptance)
        judged.append((d, steps[b], estimate))
    kept = budget.keep([d.survive * e.blind for d, _, e in judged])
    judged = [(d, step, e) for (d, step, e), keep in zip(judged, kept) if keep]
    for d, step, e in judged:
        d.append(step)
        d.acceptance.append(e.known)
        budget.add(d.survive)
    on = budget.draft_on([d.survive for d, *_ in judged], [e.known for *_, e in judged],
                         [d.left for d, *_ in judged], beside=len(still))
    return still + [d for (d, *_), go in zip(judged, on) if go]


@torch.inference_mode()  # the target's distributions are written over its logits, inference tensors on torch
def verify(target: TargetRole, rows: list[TargetRow], timings: list[PassTiming] | None = None) -> list[Verdict]:
    """One target pass over every row's unseen history plus its candidates, Algorithm 1 for all
    rows at once (greedy rows by exact match, sampled ones by rejection sampling), and each cache
    rolled back to its history + the accepted candidates. The whole of it is timed into `timings`
    by the tokens the pass fed, unless it captured a graph (models/static.py `graphs_captured`)."""
    if not rows:
        return []
    fed, start, since = target.fed_tokens, time.perf_counter(), graphs_captured()
    for r in rows:
        if r.features_from is not None and r.features_from < len(r.session):
            target.rollback(r.session, r.features_from)
    scores = target.score([r.session for r in rows], [r.history for r in rows], [r.candidates for r in rows])
    accepted, tokens = [0] * len(rows), [0] * len(rows)
    for greedy, group in rows_by([r.sampling.greedy for r in rows]).items():
        outcome = (verify_greedy_rows if greedy else verify_sampled_rows)([rows[b] for b in group], scores, group)
        for b, n, token in zip(group, *outcome.tolist()):  # one copy to the host
            accepted[b], tokens[b] = n, token
    verdicts = []
    for b, (row, n, token) in enumerate(zip(rows, accepted, tokens)):
        target.rollback(row.session, len(row.history) + n)
        features = None
        if row.features_from is not None:  # what the pass fed from features_from to the last accepted candidate
            features = scores.features[b][row.features_from - scores.starts[b]:len(row.history) + n - scores.starts[b]]
        verdicts.append(Verdict(n, token, features))
    if timings is not None and graphs_captured() == since:  # a pass that captured a graph prices nothing
        timings.append(PassTiming("verifier", target.fed_tokens - fed, (time.perf_counter() - start) * MS_PER_S))
    return verdicts


def _target_rows(scores: Scores, group: list[int]) -> torch.Tensor:
    """[T_group, V] the target logits of the rows `group` of the pass, in order (a view when they are all of it)."""
    if len(group) == len(scores):
        return scores.logits
    return torch.cat([scores[b] for b in group])


def verify_greedy_rows(rows: list[TargetRow], scores: Scores, group: list[int]) -> torch.Tensor:
    """Exact match for greedy rows: [2, B] (num_accepted, next_token) per row, on the logits' device."""
    logits = _target_rows(scores, group)
    return torch.stack(verify_greedy_batch(RoundBatch.of([r.candidates for r in rows], logits.device), logits))


def verify_sampled_rows(rows: list[TargetRow], scores: Scores, group: list[int]) -> torch.Tensor:
    """Rejection sampling for sampled rows: the target's distributions written over its logits
    (`probs_in_place`), q_i(y_i) read off the draft's rows, the uniforms from each row's generator:
    r_1..r_K, then the one its last token is drawn with. [2, B] (num_accepted, next_token), on the
    logits' device."""
    logits = _target_rows(scores, group)
    device = logits.device
    batch = RoundBatch.of([r.candidates for r in rows], device)
    probs = probs_in_place(logits, [p for r in rows for p in [r.sampling] * (len(r.candidates) + 1)])
    k_max = batch.candidates.shape[1]
    positions = batch.positions  # [B, K_max + 1]
    target_token_probs = probs[positions[:, :-1], batch.candidates]  # [B, K_max]
    draft_token_probs = torch.ones(batch.candidates.shape, device=device)  # [B, K_max]: q_i(y_i), 1 past K_b
    if k_max:  # q arrives on the draft's device (in process) or the host (off the wire)
        draft_token_probs[batch.real] = torch.stack([q[y] for r in rows for q, y in zip(r.draft_probs, r.candidates)]).to(device)
    uniforms = torch.stack([torch.cat([torch.rand(len(r.candidates) + 1, generator=r.generator, dtype=torch.float64),
                                       torch.zeros(k_max - len(r.candidates), dtype=torch.float64)])
                            for r in rows]).to(device)  # [B, K_max + 1], drawn on the host from each row's generator

    def final(accepted: torch.Tensor) -> torch.Tensor:  # [B] -> [B, V]
        ends = positions.gather(1, accepted[:, None]).squeeze(1)  # [B]: each round's last target row
        target_rows = probs[ends]  # [B, V]
        rejected = accepted < batch.num_candidates
        draft_rows = [r.draft_probs[n] for r, n in zip(rows, accepted.tolist()) if n < len(r.candidates)]
        return final_distributions(target_rows, torch.stack(draft_rows).to(device) if draft_rows else None, rejected)

    return torch.stack(verify_sampled_batch(batch, draft_token_probs, target_token_probs, uniforms, final))
