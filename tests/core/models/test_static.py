"""The static KV cache (models/static.py): rows from a slot pool, eviction, capacity, and the engine
on it (many sessions per pass: tests/core/models/test_runtime.py runs it beside the slot cache)."""

import gc
import os

import pytest
import torch

from specdec.engine import SpecDecEngine
from specdec.models.cache import Feed
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.models.static import StaticOptions
from specdec.params import build_params
from tiny import tiny_model

DEVICE = torch.device(os.environ.get("SPECDEC_TEST_DEVICE", "cpu"))  # cuda: the captured graphs (benchmarks/gpu/run.sh)

VOCAB = 40
PROMPTS = [[3, 17, 5, 9, 22, 1], [1, 2, 3], list(range(10, 30))]


def reference(model, history, candidates):
    alone = TargetRuntime(model, kv="reference")
    [logits] = alone.score([alone.new_session()], [history], [candidates])
    return logits


def small_static(model, slots: int, capacity: int = 64, **options) -> TargetRuntime:
    return TargetRuntime(model, kv="static", static=StaticOptions(slots=slots, capacity=capacity, **options))


def test_a_session_evicted_for_another_reprefills_from_its_history():
    model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)
    target = small_static(model, slots=2)
    a, b, c = (target.new_session() for _ in range(3))
    target.score([a, b], PROMPTS[:2], [[4], [5]])
    target.score([b], [PROMPTS[1] + [5]], [[6]])  # b is now the most recently used
    target.score([c], [PROMPTS[2]], [[7]])  # takes a's row
    assert a.handle is None and a.tokens == [] and {b.handle, c.handle} == {0, 1}
    [logits] = target.score([a], [PROMPTS[0] + [4]], [[8]])  # a re-prefills (evicting b)
    torch.testing.assert_close(logits, reference(model, PROMPTS[0] + [4], [8]), rtol=1e-4, atol=1e-4)


def test_a_pass_of_more_sessions_than_rows_runs_as_several():
    model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)
    target = small_static(model, slots=2)
    sessions = [target.new_session() for _ in PROMPTS]
    passes = target.forward_passes
    rows = target.score(sessions, PROMPTS, [[4], [], [6, 7]])
    assert target.forward_passes == passes + 2
    for prompt, candidates, logits in zip(PROMPTS, [[4], [], [6, 7]], rows):
        torch.testing.assert_close(logits, reference(model, prompt, candidates), rtol=1e-4, atol=1e-4)


def test_a_dropped_session_hands_its_row_back():
    target = small_static(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), slots=2)
    sessions = [target.new_session() for _ in range(2)]
    target.score(sessions, PROMPTS[:2], [[1], [2]])
    assert target.kv.pool._free == []
    del sessions
    gc.collect()
    keep = target.new_session()
    target.score([keep], [PROMPTS[2]], [[3]])
    assert len(target.kv.pool._free) == 1 and keep.handle is not None


def test_the_context_is_the_cache_capacity_and_a_longer_session_fails_clearly():
    target = small_static(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), slots=2, capacity=16)
    assert target.max_context == 16
    with pytest.raises(ValueError, match="does not fit"):
        target.score([target.new_session()], [list(range(1, 15))], [[3, 4, 5]])


def test_the_engine_on_static_caches_decodes_greedily_as_target_only_on_slots():
    def pair(kv: str) -> SpecDecEngine:  # a model's attention is set by its cache: one pair each
        return SpecDecEngine(DraftRuntime(tiny_model(VOCAB, hidden_size=16, layers=1, seed=8), kv=kv),
                             TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), kv=kv))

    static, slots = pair("static"), pair("slots")
    prompts = [p + [9] * i for i, p in enumerate(PROMPTS * 2)]
    got = static.generate_many(prompts, build_params(policy="fixed", k=3, max_new_tokens=12, chat_template=False))
    want = slots.generate_many(prompts, build_params(policy="target-only", max_new_tokens=12, chat_template=False))
    assert [r.completions[0].token_ids for r in got] == [r.completions[0].token_ids for r in want]


@pytest.mark.gpu
def test_passes_padded_to_their_graph_bucket_give_the_eager_outputs():
    """What a CUDA graph replays: the pass padded to a bucket of sessions, tokens and length, the
    padding on the scratch row (on the CPU nothing is captured; `pad_off_cuda` runs the padded pass
    eagerly; with `SPECDEC_TEST_DEVICE=cuda` the buckets are captured and replayed). Round after round (3 sessions -> bucket 4, K = 0..2 -> k bucket 4, lengths past 32 ->
    64), every row equals an unpadded eager pass's."""
    padded_model, eager_model = (tiny_model(VOCAB, hidden_size=32, layers=2, seed=7).to(DEVICE) for _ in range(2))
    padded = small_static(padded_model, slots=4, capacity=128, graphs=True, pad_off_cuda=True, min_graph_length=32)
    eager = small_static(eager_model, slots=4, capacity=128)
    assert padded.kv.graphs and not eager.kv.graphs
    histories = [list(range(1, 9)), [5, 6], [7] * 28]
    sessions = {runtime: [runtime.new_session() for _ in histories] for runtime in (padded, eager)}
    eager.score(sessions[eager], histories, [[] for _ in histories])  # prefills: eager on both
    padded.score(sessions[padded], histories, [[] for _ in histories])
    for round_index in range(3):
        candidates = [[(3 * b + round_index) % VOCAB] * ((b + round_index) % 3) for b in range(len(histories))]
        got = padded.score(sessions[padded], histories, candidates)
        want = eager.score(sessions[eager], histories, candidates)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        for b in range(len(histories)):
            histories[b] = histories[b] + candidates[b] + [int(want[b][-1].argmax())]
    assert sorted(padded.kv._captured) == [(2, 8, 32), (4, 4, 32), (4, 4, 64)]  # (2, 8): the two short prefills


def test_graphs_off_cuda_only_where_padding_is_asked_for():
    model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)
    assert not small_static(model, slots=1, graphs=True).kv.graphs  # the CPU captures nothing
    assert small_static(model, slots=1, graphs=True, pad_off_cuda=True).kv.graphs
    assert not small_static(model, slots=1, pad_off_cuda=True).kv.graphs


def test_a_long_feed_runs_in_a_pass_of_its_own_and_the_rows_come_back_in_order():
    """A prefill beside one-token steps would pad every step to its length."""
    model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)
    target = small_static(model, slots=4)
    histories, candidates = [PROMPTS[0], list(range(1, 40)), PROMPTS[1]], [[4], [5, 6], []]
    sessions = [target.new_session() for _ in histories]
    target.score(sessions[::2], histories[::2], [[], []])  # the short ones cached: they feed 2 and 1 tokens
    passes = target.forward_passes
    rows = target.score(sessions, histories, candidates)
    assert target.forward_passes == passes + 1 and [len(r) for r in rows] == [2, 3, 1]
    for history, cands, logits in zip(histories, candidates, rows):
        torch.testing.assert_close(logits, reference(model, history, cands), rtol=1e-4, atol=1e-4)


def test_a_pass_that_reads_no_output_runs():
    """A session's first token fed alone (int8 weights, models/runtime.py `_feed_first_tokens`)."""
    target = small_static(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), slots=2)
    session = target.new_session()
    assert target.kv.hidden_states(target.model, [Feed(session, [3], 0)])[0].shape == (0, 32)



def test_a_step_of_more_sessions_than_rows_drafts_in_groups_that_fit():
    """Within one drafting call a later pass would evict an earlier one's rows between its steps
    (workers.DraftWorker drafts in groups of at most the rows); verification passes split too."""
    rows = StaticOptions(slots=2, capacity=64)
    engine = SpecDecEngine(DraftRuntime(tiny_model(VOCAB, hidden_size=16, layers=1, seed=8), kv="static", static=rows),
                           TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), kv="static", static=rows))
    plain = SpecDecEngine(DraftRuntime(tiny_model(VOCAB, hidden_size=16, layers=1, seed=8)),
                          TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)))
    prompts = [p + [9] * i for i, p in enumerate(PROMPTS * 2)]  # 6 sessions a step, 2 rows
    got = engine.generate_many(prompts, build_params(policy="fixed", k=3, max_new_tokens=12, chat_template=False))
    want = plain.generate_many(prompts, build_params(policy="target-only", max_new_tokens=12, chat_template=False))
    assert [r.completions[0].token_ids for r in got] == [r.completions[0].token_ids for r in want]
    assert sum(r.stats.accepted_tokens for r in got) > 0


def test_no_garbage_is_collected_while_a_graph_is_captured():
    """A CUDA graph destroyed while a stream captures invalidates the capture (an H200 run: a dropped
    engine's chain graphs, held in a reference cycle, were collected during another engine's
    capture). `capture` collects before and pauses the collector during: garbage made before is
    gone when the block starts, and garbage made inside, however much allocation follows, waits."""
    from specdec.models.static import collector_paused

    collected = []

    class Graph:  # stands in for a captured graph: its destructor is what must not run mid-capture
        def __init__(self, name):
            self.name, self.cycle = name, self

        def __del__(self):
            collected.append((self.name, inside))

    inside = False
    Graph("before")
    with collector_paused():
        inside = True
        Graph("during")
        _ = [[object()] for _ in range(100_000)]  # enough allocation to trigger the collector
        inside = False
    gc.collect()
    assert collected == [("before", False), ("during", False)]


@pytest.mark.parametrize("policy", ["target-only", "fixed"])
def test_a_step_makes_one_target_pass_whatever_the_sessions(policy):
    """Sessions joining at once prefill in one padded pass, and every later step is one pass of all
    of them (padded to its bucket as a graph replays it): the passes a run makes do not grow with
    its sessions (an H200 run: 64 sessions joining made 64 eager prefill passes of ~20 ms, and the
    loop's pass per step grew from 6 to 77 ms)."""
    options = dict(slots=8, capacity=128, graphs=True, pad_off_cuda=True, min_graph_length=32)

    def passes(sessions: int) -> list[int]:
        """The static passes of each of the target's calls (`_forward`) while `sessions` decode."""
        target = small_static(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), **options)
        draft = DraftRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), kv="static",
                             static=StaticOptions(**options))  # a self-draft: greedy accepts every candidate
        engine = SpecDecEngine(draft, target)
        counts, kv_pass, forward = [], target.kv._pass, target._forward
        target.kv._pass = lambda model, feeds: counts.__setitem__(-1, counts[-1] + 1) or kv_pass(model, feeds)
        target._forward = lambda feeds: counts.append(0) or forward(feeds)
        prompts = [[(5 * i + j) % VOCAB for j in range(19 + 3 * i)] for i in range(sessions)]  # 19-40 tokens: past the buckets' 16
        engine.generate_many(prompts, build_params(policy=policy, k=3 if policy == "fixed" else None, max_new_tokens=12,
                                                   chat_template=False))
        return counts

    one, eight = passes(1), passes(8)
    assert one == eight and set(one) == {1}


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [[0, 1], None])  # two decoder layers' outputs; the output state
def test_a_static_pass_hands_out_the_states_a_slot_pass_does(layers):
    """A feature draft's target on the static cache: every pass, the prefill of sessions joining
    together, the padded (on CUDA: captured and replayed) verifications, returns the read layers'
    states at every position it fed, as the slot cache's pass does (bfloat16 both)."""
    options = dict(slots=4, capacity=128, graphs=True, pad_off_cuda=True, min_graph_length=32)
    static = small_static(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7).to(DEVICE), **options)
    slots = TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7).to(DEVICE))
    for runtime in (static, slots):
        runtime.read_features(layers)
    histories = [list(range(1, 25)), [5, 6, 7], [9] * 30]
    sessions = {runtime: [runtime.new_session() for _ in histories] for runtime in (static, slots)}
    for round_index in range(3):
        candidates = [[(3 * b + round_index) % VOCAB] * ((b + round_index) % 3) for b in range(len(histories))]
        got, want = (runtime.score(sessions[runtime], histories, candidates) for runtime in (static, slots))
        assert got.starts == want.starts
        for g, w in zip(got.features, want.features):
            assert g.dtype == w.dtype == torch.bfloat16 and g.shape == w.shape
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
        for b in range(len(histories)):
            histories[b] = histories[b] + candidates[b] + [int(want[b][-1].argmax())]
    assert static.kv._captured  # the verifications replayed (off CUDA: padded to) their buckets
