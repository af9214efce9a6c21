"""A round draws the same random numbers whichever process or cache runs it."""

import torch

from specdec.engine import SpecDecEngine
from specdec.params import build_params
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.policies import PolicyConfig, make_policy
from specdec.protocol import round_generator
from specdec.rounds import DraftRow, TargetRow, propose, verify
from tiny import tiny_model

VOCAB, PROMPT = 48, [3, 9, 27, 4]


def test_round_generators_are_deterministic_and_independent():
    draw = lambda *key: torch.rand(4, generator=round_generator(*key)).tolist()  # noqa: E731
    assert draw(7, 0, 3, "draft") == draw(7, 0, 3, "draft")
    keys = [(7, 0, 3, "draft"), (7, 0, 3, "target"), (7, 1, 3, "draft"), (7, 0, 4, "draft"), (8, 0, 3, "draft")]
    assert len({tuple(draw(*key)) for key in keys}) == len(keys)


def test_rounds_survive_lost_caches():
    """Driving the rounds by hand with fresh KV sessions every round (a replica that lost the
    session re-prefills) reproduces the engine's seeded sampled output token for token."""
    target_model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=3, init_range=0.5)
    draft, target = DraftRuntime(tiny_model(VOCAB, 16, 1, seed=4, init_range=0.5)), TargetRuntime(target_model)
    params = build_params(policy="fixed", k=3, temperature=1.0, top_k=20, seed=42, max_new_tokens=24)
    expected = SpecDecEngine(draft, target).generate_ids(PROMPT, params).completions[0].token_ids

    history, policy, round_index = list(PROMPT), make_policy(PolicyConfig(name="fixed", k=3)), 0
    while len(history) - len(PROMPT) < params.max_new_tokens:
        budget = params.max_new_tokens - (len(history) - len(PROMPT)) - 1
        [proposal] = propose(draft, [DraftRow(draft.new_session(), history, policy, budget, len(history) - len(PROMPT),
                                              params.sampling, round_generator(42, 0, round_index, "draft"))])
        [verdict] = verify(target, [TargetRow(target.new_session(), history, proposal.candidates, proposal.draft_probs,
                                              params.sampling, round_generator(42, 0, round_index, "target"))])
        history += verdict.committed(proposal.candidates)
        round_index += 1
    assert history[len(PROMPT):][: len(expected)] == expected
