"""`heuristic` counts a round as all accepted by the candidates the round held, as HF's
`num_matches == len(scores[0]) - 1` does, not by the K the schedule holds when the outcome arrives:
a round drafted ahead (PEARL's post-verify) was drafted before the previous round's outcome moved K."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import torch

from specdec.calls import LocalTransport
from specdec.loop import BatchConfig, RoundLoop
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.params import GenerationParams
from specdec.policies import Heuristic, PolicyConfig
from specdec.sequences import DraftTraits, RequestRules, RoundObserver
from specdec.workers import DraftWorker, VerifierWorker
from tiny import tiny_model


def test_a_round_shorter_than_k_all_accepted_grows_k():
    policy = Heuristic(k=4, max_candidates=64)
    policy.end_round(4, 4)  # 4 -> 6
    policy.end_round(4, 4)  # a round drafted ahead at K = 4, before the one above was verified: 6 -> 8
    assert policy.round_limit() == 8
    policy.end_round(3, 2)  # one rejected: 8 -> 7
    assert policy.round_limit() == 7


def test_a_round_without_candidates_leaves_k():
    """A round that verified nothing (a suffix walk that matched nothing, a draft still catching up)
    says nothing about the draft."""
    policy = Heuristic(k=5, max_candidates=64)
    policy.end_round(0, 0)
    assert policy.round_limit() == 5


class Rounds(RoundObserver):
    """A metrics sink that keeps each committed round's (K, n), in order (the rest: the protocol's no-ops)."""

    def __init__(self):
        self.rounds: list[tuple[int, int]] = []

    def on_round(self, num_candidates, num_accepted, policy, held):
        self.rounds.append((num_candidates, num_accepted))


def test_rounds_drafted_ahead_that_are_all_accepted_never_shrink_k():
    """The draft is the target, so every candidate is accepted: the schedule only grows. The workers
    run on a thread of their own, as on a replica, so a round is drafted ahead while the previous
    one verifies (in process without an executor the calls run one after the other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_model(64, hidden_size=16, layers=1, seed=3, init_range=0.5)
        draft = copy.deepcopy(target)
        with ThreadPoolExecutor(1) as executor:
            transport = LocalTransport(DraftWorker(DraftRuntime(draft)), VerifierWorker(TargetRuntime(target)), executor)
            rules = RequestRules(None, (), 256, 64, {"default": DraftTraits()})
            observer = Rounds()
            loop = RoundLoop(transport, rules, BatchConfig(overlap="on"), observer=observer)
            params = GenerationParams(max_new_tokens=60, policy=PolicyConfig(name="heuristic", k=2))
            result = asyncio.run(loop.generate([1, 2, 3], params))
    finally:
        torch.set_num_threads(threads)
    assert result.stats.rounds_ahead_used > 0
    assert all(n == k for k, n in observer.rounds), observer.rounds
    ks = [k for k, _ in observer.rounds[:-1]]  # (the last round is cut by the token budget)
    assert ks == sorted(ks), observer.rounds
