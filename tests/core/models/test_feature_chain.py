"""The feature draft on a static cache (models/feature_draft.py, models/static.py) and its greedy
steps as one chain (models/feature_chain.py): the same outputs as its slot cache and as steps one at
a time. `SPECDEC_TEST_DEVICE=cuda` runs them on a GPU, where the chains are captured as CUDA graphs
and replayed (benchmarks/gpu/run.sh); on the CPU a chain padded to its bucket runs eagerly."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import tiny_feature_draft, tiny_model

from specdec.models.feature_chain import chain_bucket
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.static import StaticOptions

DEVICE = torch.device(os.environ.get("SPECDEC_TEST_DEVICE", "cpu"))
VOCAB = 40
# three sessions: one a long catch-up (a pass of its own on the static cache), two short
HISTORIES = [list(range(3, 30)), [5, 9, 2, 7], [1, 4, 4, 8, 2, 6, 3]]


def runtime(kv: str = "slots", seed: int = 1, **options) -> FeatureDraftRuntime:
    target = tiny_model(VOCAB, hidden_size=16, layers=2, seed=3, init_range=0.5)
    draft = tiny_feature_draft(target, vocab_ids=list(range(0, VOCAB, 2)) + [1, 3], seed=seed).to(DEVICE)
    static = StaticOptions(slots=4, capacity=96, min_graph_length=32, **options)
    return FeatureDraftRuntime(draft, identity="tiny", kv=kv, static=static)


def started(draft: FeatureDraftRuntime):
    """Sessions holding random target states over their histories, after `start`."""
    generator = torch.Generator().manual_seed(0)
    sessions = [draft.new_session() for _ in HISTORIES]
    for session, history in zip(sessions, HISTORIES):
        states = torch.randn(len(history), draft.model.config.reads, draft.hidden_size, generator=generator)
        draft.add_features(session, states, 0)
    return sessions, draft.start(sessions, HISTORIES)


def stepped(draft: FeatureDraftRuntime, sessions, first, steps: int):
    """`steps` greedy steps one at a time from the tokens `first`: each step's outputs."""
    outputs, tokens = [], first
    for _ in range(steps):
        out = draft.step(sessions, tokens)
        outputs.append(out)
        tokens = out.logits.argmax(dim=-1).tolist()
    return outputs


def assert_same_steps(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.logits.argmax(-1).tolist() == b.logits.argmax(-1).tolist()
        finite = torch.isfinite(b.logits)
        assert torch.equal(torch.isfinite(a.logits), finite)
        torch.testing.assert_close(a.logits[finite], b.logits[finite], atol=1e-3, rtol=1e-3)  # float32: sums over other gathered lengths
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-3, rtol=1e-3)  # float32: sums over other gathered lengths


@pytest.mark.gpu
def test_the_static_cache_serves_a_feature_draft_as_its_slots_do():
    slots, static = runtime("slots"), runtime("static")
    (slot_sessions, slot_first), (static_sessions, static_first) = started(slots), started(static)
    assert_same_steps([static_first], [slot_first])
    first = slot_first.logits.argmax(-1).tolist()
    assert_same_steps(stepped(static, static_sessions, first, 3), stepped(slots, slot_sessions, first, 3))
    assert [s.tokens for s in static_sessions] == [s.tokens for s in slot_sessions]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_a_chain_gives_the_outputs_of_its_steps_one_at_a_time(graphs):
    """With `graphs` the chain is padded to its bucket (4 sessions, 8 steps, 64 positions) and, on CUDA,
    captured and replayed; the cache then serves the steps after it as before."""
    options = {"graphs": True, "pad_off_cuda": True} if graphs else {}
    chained, reference = runtime("static", **options), runtime("static")
    (sessions, first), (ref_sessions, _) = started(chained), started(reference)
    tokens = first.logits.argmax(-1).tolist()
    assert chained.kv.graphs == graphs
    got = chained.chain(sessions, tokens, 5)
    assert_same_steps(got, stepped(reference, ref_sessions, tokens, 5))
    assert [s.tokens for s in sessions] == [s.tokens for s in ref_sessions]
    assert len(chained._chains) == graphs
    after = got[-1].logits.argmax(-1).tolist()
    assert_same_steps(stepped(chained, sessions, after, 2), stepped(reference, ref_sessions, after, 2))


def test_a_chain_runs_eagerly_where_its_bucket_would_pass_the_capacity():
    kv = runtime("static", graphs=True, pad_off_cuda=True).kv
    assert chain_bucket(kv, 3, 5, 40) == (4, 8, 64)
    assert chain_bucket(kv, 3, 5, 90) is None  # 90 + 8 steps > 96 positions


def test_the_chains_argmax_is_the_first_best_of_the_full_vocabulary():
    """A chain chooses from the trimmed scores what `draw` takes from the scattered logits: with ties,
    the smallest id (the draft's vocabulary is not sorted: ids 1 and 3 come last)."""
    from specdec.sampling import argmax

    draft = runtime().model
    trimmed = torch.zeros(2, len(draft.vocab_ids))
    trimmed[0, [1, -1]] = 5.0  # ids 2 and 3 tie
    trimmed[1, -2] = 1.0  # id 1
    assert draft.argmax(trimmed).tolist() == argmax(draft.scatter(trimmed)).tolist() == [2, 1]


def test_a_chain_stops_where_a_session_would_pass_the_capacity():
    """A chain asked for 8 steps beside a session with room for 4 more positions runs 4: no key lands
    past a row (the other sessions draft on step by step)."""
    draft = runtime("static")
    sessions, first = started(draft)
    lengths = [len(s) for s in sessions]
    draft.kv.capacity = lengths[0] + 4  # the long session holds 26 pairs
    assert len(draft.chain(sessions, first.logits.argmax(-1).tolist(), 8)) == 4
    assert [len(s) for s in sessions] == [n + 4 for n in lengths]


def test_every_chain_bucket_is_captured_at_start():
    """A replica's start-up probe captures every bucket (sessions up to the cache's 4 rows, steps up
    to 8, lengths 32 to 64 of 96 positions and the row's 97); a chain then finds its own."""
    draft = runtime("static", graphs=True, pad_off_cuda=True)
    draft.capture_graphs()
    assert sorted(draft._chains) == [(b, k, n) for b in (1, 2, 4) for k in (1, 2, 4, 8) for n in (32, 64)]
    sessions, first = started(draft)
    draft.chain(sessions, first.logits.argmax(-1).tolist(), 5)
    assert len(draft._chains) == 24


@pytest.mark.gpu
def test_a_chain_is_judged_at_once_as_its_steps_are_one_at_a_time():
    """`rounds.read_ahead`: every step's token is its argmax, and the head judges every step's
    candidate in one call, as `judged_acceptances` judges each step alone; a row whose policy has
    no head gets no judgement. Rows at other candidate counts judge other positions."""
    from specdec.head import AcceptanceHead, HeadConfig
    from specdec.policies import FixedK
    from specdec.policies.base import DraftStep
    from specdec.policies.specdec_pp import judged_acceptances
    from specdec.policies.specdec_pp_cost import SpecDecPPCost
    from specdec.rounds import DraftRow, _Ahead, Drafting
    from specdec.sampling import SamplingParams

    draft = runtime("static", graphs=True, pad_off_cuda=True)
    sessions, first = started(draft)
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=draft.hidden_size, depth=1, draft_identity="tiny",
                                     features="hidden+distribution")).to(DEVICE).eval()
    policies = [SpecDecPPCost(head), FixedK(k=8), SpecDecPPCost(head)]
    rows = [Drafting(DraftRow(s, h, p, 12, 0, SamplingParams(), None)) for s, h, p in zip(sessions, HISTORIES, policies)]
    for d, token in zip(rows, first.logits.argmax(-1).tolist()):
        d.proposal.candidates.append(token)
    rows[2].proposal.candidates.insert(0, 7)  # two candidates already: its chain drafts y_3, y_4, ...
    calls = []
    forward = head.acceptance_probability
    head.acceptance_probability = lambda inputs: calls.append(inputs.shape) or forward(inputs)
    ahead = _Ahead(draft, rows, 5)
    assert len(calls) == 1 and calls[0][0] == 5 * 2  # one call: 5 steps of the 2 rows with a head
    for k, out in enumerate(ahead.outputs):
        assert ahead.tokens[k] == out.logits.argmax(-1).tolist()
        probs = torch.softmax(out.logits.float(), dim=-1)
        steps = [DraftStep(len(rows[b].proposal.candidates) + 1 + k, ahead.tokens[k][b], probs[b], out.hidden[b], 0,
                           out.hidden[b], True) for b in (0, 2)]
        expected = judged_acceptances(head, steps)
        assert ahead.judged[k][1] is None
        assert [ahead.judged[k][0], ahead.judged[k][2]] == pytest.approx(expected, abs=1e-5)
    assert ahead.judged[0][0] != pytest.approx(ahead.judged[0][2], abs=1e-6)  # the rows differ


@pytest.mark.gpu
def test_a_runtime_captures_while_another_one_lies_in_a_reference_cycle():
    """Two engines in one process (an H200 run: the second one's capture was invalidated when the
    first one's chain graphs, dropped in a reference cycle, were collected mid-capture). On the CPU
    nothing is captured and this passes whatever `capture` does: it is a GPU test
    (`SPECDEC_TEST_DEVICE=cuda`, benchmarks/gpu/run.sh); tests/core/models/test_static.py checks the
    collector's pause on the CPU."""
    first = runtime("static", graphs=True, pad_off_cuda=True)
    first.capture_graphs()
    first.cycle = first  # garbage once dropped, freed only by the collector
    del first
    second, reference = runtime("static", graphs=True, pad_off_cuda=True), runtime("static")
    second.capture_graphs()
    (sessions, first_out), (ref_sessions, _) = started(second), started(reference)
    tokens = first_out.logits.argmax(-1).tolist()
    assert_same_steps(second.chain(sessions, tokens, 5), stepped(reference, ref_sessions, tokens, 5))
    second.close()
    assert not second._chains
