"""The two halves of a speculation round, shared by the in-process engine and the services.

`propose` runs on the draft's side (the policy decides there, token by token); `verify` runs on the
target's side. Each takes the full committed history: the runtimes sync their KV caches to it.
Randomness comes from `round_generator`, derived from (request seed, sample, round, role), so a
round draws the same numbers whichever process or replica runs it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from specdec.models.runtime import DraftRuntime, KVSession, TargetRuntime
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
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q_1..q_K, each [V]
    forward_passes: int = 0


def propose(draft: DraftRuntime, session: KVSession, history: list[int], policy: StoppingPolicy,
            limit: int, num_generated: int, sampling: SamplingParams, generator: torch.Generator) -> Proposal:
    """Draft up to `limit` candidates after `history`, asking `policy` after each (Algorithm 2)."""
    proposal = Proposal()
    limit = min(limit, policy.round_limit())
    if not policy.uses_draft or limit <= 0:
        return proposal
    policy.start_round()
    out, prev_hidden = draft.start(session, history), None
    proposal.forward_passes += 1
    while True:
        q = probs_from_logits(out.logits, sampling)  # [V]
        y = choose_token(q, sampling, generator)
        decision = policy.decide(DraftStep(len(proposal.candidates) + 1, y, q, prev_hidden, num_generated))
        if decision is Decision.DROP_LAST:
            break
        proposal.candidates.append(y)
        proposal.draft_probs.append(q)
        if decision is Decision.STOP or len(proposal.candidates) >= limit:
            break
        out = draft.step(session, y)
        prev_hidden = out.hidden  # e_i, read by the policy at step i + 1
        proposal.forward_passes += 1
    return proposal


def verify(target: TargetRuntime, session: KVSession, history: list[int], candidates: list[int],
           draft_probs: list[torch.Tensor], sampling: SamplingParams, generator: torch.Generator) -> Verdict:
    """One target pass over the unseen history plus the candidates, Algorithm 1, and the cache
    rolled back to history + the accepted candidates."""
    target_logits = target.score(session, history, candidates)  # [K+1, V]
    ids = torch.tensor(candidates, dtype=torch.long)
    if sampling.greedy:
        verdict = verify_greedy(ids, target_logits)
    else:
        target_probs = probs_from_logits(target_logits, sampling)  # [K+1, V]
        q = torch.stack(draft_probs) if draft_probs else target_probs[:0]
        verdict = verify_sampled(ids, q, target_probs, generator)
    target.rollback(session, len(history) + verdict.num_accepted)
    return verdict
