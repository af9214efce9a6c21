"""The suffix draft (models/suffix.py, proposers.py `SuffixProposer`): its index finds the longest
earlier context and its last continuation, its estimates learn from verified rounds, and through
the real engine loop its rounds are lossless (greedy equality with target-only for every policy it
runs, chi-squared at T = 1 and top-k with its one-hot q). The lossless tests run where
test_lossless.py's do: `SPECDEC_TEST_DEVICE=cuda SPECDEC_TEST_KV=static` puts them on a GPU's
captured passes (benchmarks/gpu/run.sh), the suffix's candidates coming from the host."""

from __future__ import annotations

import asyncio
import copy

import pytest

from specdec.cost_profile import CostProfile
from specdec.engine import SpecDecEngine
from specdec.errors import InvalidRequestError
from specdec.models.runtime import TargetRuntime
from specdec.models.suffix import MAX_ORDER, Match, MatchHead, MatchStats, SuffixDraft, SuffixIndex, prior_acceptance
from specdec.params import GenerationParams
from specdec.policies import PolicyConfig
from specdec.sampling import MAX_SAMPLES_PER_REQUEST, SamplingParams
from stats import chi2_pvalue
from test_lossless import DEVICE, KV, SIGNIFICANCE, prefix_counts, target_joint
from tiny import tiny_model

VOCAB = 6
# Repeats that the target's own continuation partly follows: rounds see acceptances and rejections.
PROMPT = [1, 2, 0, 1, 2, 0, 1, 2, 0, 5, 1, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_model(VOCAB, hidden_size=16, layers=2, seed=3, init_range=0.5)


def on_device(model):
    """The model where the lossless tests run (a copy there: the module's target stays on the CPU,
    where the exact distributions are computed and the model drafts are made from it)."""
    return model if DEVICE.type == "cpu" else copy.deepcopy(model).to(DEVICE)


def suffix_engine(target) -> SpecDecEngine:
    from specdec.models.static import StaticOptions

    target = TargetRuntime(on_device(target), kv=KV, static=StaticOptions(graphs=True))
    return SpecDecEngine(SuffixDraft(VOCAB), target, head=MatchHead())


def generate(engine: SpecDecEngine, prompt: list[int], params: GenerationParams):
    return asyncio.run(engine.loop.generate(prompt, params))


def test_the_index_finds_the_longest_earlier_context_and_its_last_continuation():
    index = SuffixIndex()
    index.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    assert index.match([1, 2]) == Match(order=2, token=3, frequency=1.0, position=6)  # "1 2" was followed by 3 twice
    assert index.match([2, 3]) == Match(order=2, token=5, frequency=0.5, position=7)  # by 4, then by 5: the last wins
    assert index.match([7, 4, 1, 2, 3]) == Match(order=4, token=5, frequency=1.0, position=7)  # "4 1 2 3": once, by 5
    assert index.match([7, 3, 1, 2, 3]) == Match(order=3, token=5, frequency=0.5, position=7)  # only "1 2 3" occurred
    assert index.match([9]) is None
    assert index.match([0, 1]) == Match(order=1, token=2, frequency=1.0, position=9)  # a leading id 0 is a token of its own
    # each token registers at most MAX_ORDER contexts (O(1) a token)
    long = SuffixIndex()
    long.extend(list(range(100)) * 3)
    assert len(long._table) <= (MAX_ORDER + 1) * len(long)
    # a match of the longest order knows how often its candidate followed it
    assert long.match(list(range(50, 50 + MAX_ORDER))) == Match(order=MAX_ORDER, token=50 + MAX_ORDER, frequency=1.0, position=250 + MAX_ORDER)


def test_the_index_follows_the_history_and_builds_again_where_it_was_taken_back():
    index = SuffixIndex()
    index.sync([4, 5, 4])
    index.sync([4, 5, 4, 5])  # appended
    assert index.tokens == [4, 5, 4, 5] and index.match([4]) == Match(order=1, token=5, frequency=1.0, position=3)
    index.sync([4, 5, 3])  # a committed token taken back: the same as built from scratch
    fresh = SuffixIndex()
    fresh.extend([4, 5, 3])
    assert index.tokens == fresh.tokens and index._table == fresh._table


def test_the_copy_a_walk_follows_is_measured_past_the_longest_context():
    index = SuffixIndex()
    text = list(range(40)) + [99] + list(range(40))
    index.extend(text)
    match = index.match(text)
    assert match.order == MAX_ORDER and match.token == 99 and match.position == 40
    assert index.run(text[:-1], [39], match.position) == 40  # the whole of range(40): a 40-token copy
    assert index.run([7, 8], [], 2) == 0 and index.run(text, [5], 40, cap=10) == 0


def test_match_estimates_start_from_the_prior_and_learn_from_verified_rounds():
    stats = MatchStats()
    assert stats.estimate(3, 1.0, greedy=True) == pytest.approx(prior_acceptance(3, 1.0))
    bucket = MatchStats.bucket(3, 1.0, greedy=True)
    for _ in range(40):  # walks of two candidates of this bucket, the first taken, the second not
        stats.learn([bucket, bucket], accepted=1, shown=2)
    assert stats.estimate(3, 1.0, greedy=True) == pytest.approx(0.5, abs=0.05)
    assert stats.estimate(3, 1.0, greedy=False) == pytest.approx(prior_acceptance(3, 1.0))  # sampled apart
    stats.learn([bucket, bucket, bucket], accepted=0, shown=3)  # only the first was judged
    stats.learn([bucket, bucket, bucket], accepted=1, shown=1)  # one token committed since: it took the first
    assert stats.verified[bucket] == 82 and stats.accepted[bucket] == 41


def test_a_walk_is_learnt_from_whether_it_was_proposed_or_not():
    from specdec.models.suffix import SuffixSession

    session = SuffixSession()
    session.index.sync([1, 2, 3, 1, 2])
    session.round_start, session.walk = 5, [3, 1, 2]  # walked, none proposed (K = 0)
    assert session.outcome([1, 2, 3, 1, 2, 3]) == (1, 1)  # plain decoding took the first
    assert session.outcome([1, 2, 3, 1, 2, 4]) == (0, 1)
    assert session.outcome([1, 2, 3, 1, 2, 3, 1, 7, 9]) == (2, 3)  # a round: two taken, the third not
    assert session.outcome([1, 2, 3, 1, 2]) is None  # nothing committed since
    assert session.outcome([1, 2, 9, 1, 2, 3]) is None  # taken back before the walk


def test_an_occurrence_other_than_the_last_is_found_near_a_position_and_followed():
    index = SuffixIndex()
    index.extend([5, 1, 2, 3, 6, 1, 2, 4])
    assert index.follow([7, 1, 2], 2, 3) == Match(order=2, token=3, frequency=0.5, position=3)  # "1 2": by 3, by 4
    assert index.nearest([9, 1], 0) == (2, 1)  # "1" is followed first at position 2
    assert index.nearest([9, 1], 3) == (6, 1)  # past position 3, at 6
    assert index.nearest([6, 1], 0) == (6, 2)  # the longer run wins over the nearer
    assert index.nearest([9, 8], 0) == (None, 0)


def test_a_copy_followed_on_reads_the_same_match_from_the_hash_before():
    """`follow` with `after` (the candidate before, a copy going on) derives its context's hash from
    that candidate's: the same match as hashing the context again, as the order grows to MAX_ORDER
    and then slides."""
    import random

    rng = random.Random(5)
    text = [rng.randrange(4) for _ in range(300)]
    index = SuffixIndex()
    index.extend(text + text[:60])  # the copy: text's first 60 tokens again
    tail, position, before = text[:1], 1, None
    for length in range(1, 40):
        order = min(length, MAX_ORDER)
        again = index.follow(tail, order, position)
        if before is not None:
            rolled = index.follow(tail, order, position, after=before)
            assert rolled == again and rolled.pair == again.pair
        before = again
        tail, position = (tail + [again.token])[-MAX_ORDER - 1:], position + 1


def test_a_walk_starts_past_its_cursor_on_a_tie_and_follows_its_copy_on():
    """An edit copies its source in order: where several contexts of the history's end are as
    long, the walk starts at the one nearest past where the target last took a candidate (the
    cursor), not at the text's last, and keeps to that copy while no longer context is elsewhere."""
    from specdec.models.suffix import SuffixSession
    from specdec.policies import make_policy
    from specdec.proposers import SuffixProposer
    from specdec.protocol import StepPlan
    from specdec.rounds import DraftRow

    source = [10, 1, 2, 3, 4, 5, 11, 2, 3, 9, 12]

    def walk(cursor: int | None) -> list[int]:
        session = SuffixSession()
        session.cursor = cursor
        row = DraftRow(session, source + [20, 2], make_policy(PolicyConfig(name="fixed", k=4)), 4, 3,
                       SamplingParams(), None)
        [proposal] = SuffixProposer(SuffixDraft(32)).propose([row], StepPlan(), [])
        return proposal.candidates

    assert walk(None) == [3, 9, 12, 20]  # "2" and "2 3" last went on with 3, then 9
    # past the cursor "2" went on with 3 first, and "2 3" with 4 there: the copy goes on, though
    # "2 3" went on with 9 last
    assert walk(1) == [3, 4, 5, 11]

    session = SuffixSession()  # the cursor: just past the last candidate the target took
    session.index.sync(source)
    session.round_start, session.walk, session.buckets, session.positions = 11, [3, 4, 5], [None] * 3, [3, 4, 5]
    session.learn(source + [3, 4, 9], MatchStats())
    assert session.cursor == 5


GREEDY_POLICIES = [PolicyConfig(name="fixed", k=3), PolicyConfig(name="heuristic"),
                   PolicyConfig(name="specdec++"), PolicyConfig(name="specdec++cost"), PolicyConfig()]


@pytest.mark.parametrize("policy", GREEDY_POLICIES, ids=lambda p: p.name or "default")
def test_greedy_output_with_the_suffix_draft_equals_target_greedy(target, policy):
    """The first request on the costs measured here (the walk's longest pass timed), the second on a
    flat curve, where a budgeted round pays wherever its candidates are likely whatever the machine's
    load did to the measured passes: it drafts with what the first taught the estimates."""
    engine = suffix_engine(target)
    plain = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=PolicyConfig(name="target-only")))
    first = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=policy))
    assert first.completions[0].token_ids == plain.completions[0].token_ids
    if policy.name != "fixed":  # the walk's longest pass (20 candidates) was timed, not extrapolated
        assert 16 in engine.loop.costs["default"].curve("verifier")
    for planner in engine.loop.planners:
        planner.given = CostProfile(t_draft_ms=0.01, t_target_ms={1: 10.0, 64: 11.0})
    result = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=policy))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.accepted_tokens > 0  # rounds happened and some were taken
    assert engine.draft.stats.verified  # the estimates learnt from them


SAMPLINGS = {"temperature-1": SamplingParams(temperature=1.0), "top-k-3": SamplingParams(temperature=1.0, top_k=3)}
SAMPLED_NEW_TOKENS = 4
SAMPLES = 1024


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("policy", [PolicyConfig(name="fixed", k=3), PolicyConfig(name="specdec++", threshold=0.5)],
                         ids=lambda p: p.name)
def test_sampled_outputs_with_the_suffix_draft_follow_the_target_distribution(target, policy, sampling_name):
    """A one-hot q: y accepted with probability p(y), a rejection drawn from p without y."""
    sampling = SAMPLINGS[sampling_name]
    # (A fixed seed: a change to the loop's schedule draws other samples. Seed 500 drew p = 2.8e-4 at
    # 3 tokens for specdec++ once 1,024 samples no longer ran at once past the stores' 256 sessions;
    # 24 other seeds gave 0.04-0.99 there, as a right distribution does.)
    completions = sample_all(suffix_engine(target), PROMPT, policy, sampling, seed=1500)
    assert_target_distribution(target, PROMPT, sampling, completions)


def sample_all(engine: SpecDecEngine, prompt: list[int], policy: PolicyConfig, sampling: SamplingParams,
               seed: int) -> list[list[int]]:
    """SAMPLES completions of the prompt, all requests at once; the case sees acceptances and rejections."""
    requests = [GenerationParams(max_new_tokens=SAMPLED_NEW_TOKENS, n=MAX_SAMPLES_PER_REQUEST, policy=policy,
                                 sampling=sampling.model_copy(update={"seed": seed + r}))
                for r in range(SAMPLES // MAX_SAMPLES_PER_REQUEST)]

    async def run():
        return await asyncio.gather(*(engine.loop.generate(prompt, params) for params in requests))

    completions, accepted, discarded = [], 0, 0
    for result in asyncio.run(run()):
        completions += [c.token_ids for c in result.completions]
        accepted += result.stats.accepted_tokens
        discarded += result.stats.discarded_tokens
    assert accepted > 0 and discarded > 0
    return completions


def assert_target_distribution(target, prompt: list[int], sampling: SamplingParams, completions: list[list[int]]):
    for length in (1, 2, 3):
        expected = target_joint(target, prompt, sampling, length)
        pvalue = chi2_pvalue(prefix_counts(completions, length, VOCAB), expected)
        assert pvalue > SIGNIFICANCE, f"first {length} token(s): chi-squared p = {pvalue:.2e}"


@pytest.mark.parametrize("name", ["svip", "confidence"])
def test_a_policy_that_stops_on_q_is_refused_for_the_suffix_draft_in_one_line(target, name):
    engine = suffix_engine(target)
    with pytest.raises(InvalidRequestError, match="one-hot") as caught:
        generate(engine, PROMPT, GenerationParams(max_new_tokens=4, policy=PolicyConfig(name=name)))
    assert "\n" not in str(caught.value)
    # the engine serves the next request as before
    assert len(generate(engine, PROMPT, GenerationParams(max_new_tokens=4)).completions[0].token_ids) == 4


def test_where_no_suffix_round_pays_its_sessions_rest(target, monkeypatch):
    """The planner turns the suffix draft off where its walks verify nothing (its call costs host
    work every step): after empty rounds a session rests 1, 2, 4 ... tokens without calling it."""
    from specdec.proposers import SuffixProposer

    engine, calls = suffix_engine(target), []
    for planner in engine.loop.planners:  # every token more in the pass costs a whole pass: no round pays
        planner.given = CostProfile(t_draft_ms=0.01, t_target_ms={1: 10.0, 2: 20.0, 64: 640.0})
    propose = SuffixProposer.propose
    monkeypatch.setattr(SuffixProposer, "propose", lambda self, rows, *args: calls.append(len(rows)) or propose(
        self, rows, *args))
    plain = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=PolicyConfig(name="target-only")))
    result = generate(engine, PROMPT, GenerationParams(max_new_tokens=40))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.draft_tokens == 0 and result.stats.held["resting"] > 30
    assert len(calls) < 10  # of 40 steps


def test_the_suffix_draft_builds_from_its_source_name_on_any_target(tiny_pair):
    from specdec.builder import EngineConfig, build_engine, build_rules

    _, target_dir = tiny_pair
    config = EngineConfig(draft="suffix", target=str(target_dir))
    engine = build_engine(config, progress=False)
    assert isinstance(engine.draft, SuffixDraft) and engine.draft.vocab_size == engine.target.vocab_size
    rules = build_rules(config, progress=False)
    assert rules.drafts["default"].model_free and rules.drafts["default"].has_head  # the default is specdec++cost
    prompt = engine.rules.encode_prompt("abcabcabcabc", chat_template=False)
    result = generate(engine, prompt, GenerationParams(max_new_tokens=8))
    plain = generate(engine, prompt, GenerationParams(max_new_tokens=8, policy=PolicyConfig(name="target-only")))
    assert result.completions[0].token_ids == plain.completions[0].token_ids


def test_a_fused_draft_builds_from_suffix_plus_its_model_source(tiny_pair):
    from specdec.builder import EngineConfig, build_engine, build_rules
    from specdec.errors import ModelSourceError
    from specdec.proposers import FusedProposer

    draft_dir, target_dir = tiny_pair
    config = EngineConfig(draft=f"suffix+{draft_dir}", target=str(target_dir), drafts={"suffix": "suffix"})
    engine = build_engine(config, progress=False)
    assert isinstance(engine.draft.suffix, SuffixDraft) and isinstance(engine.draft_worker.proposer, FusedProposer)
    assert engine.rules.drafts["default"].fused and not engine.rules.drafts["suffix"].fused
    assert build_rules(config, progress=False).drafts["default"].fused
    prompt = engine.rules.encode_prompt("abcabcabcabc", chat_template=False)
    result = generate(engine, prompt, GenerationParams(max_new_tokens=8))  # (no head here: the model alone)
    plain = generate(engine, prompt, GenerationParams(max_new_tokens=8, policy=PolicyConfig(name="target-only")))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    for bad in ("suffix+", "suffix+suffix", "suffix+suffix+x"):
        with pytest.raises(ModelSourceError, match="suffix\\+SOURCE") as caught:
            build_rules(EngineConfig(draft=bad, target=str(target_dir)), progress=False)
        assert "\n" not in str(caught.value)


def test_a_cache_of_earlier_responses_is_read_within_its_scope_only(target):
    """A response joins its scope's cache when its session is released; a request of the same scope
    then drafts from it (the prompt alone repeats nothing), one of another scope does not."""
    engine, prompt = suffix_engine(target), [3, 1, 4, 1, 5, 0, 2]
    plain = generate(engine, prompt, GenerationParams(max_new_tokens=30, policy=PolicyConfig(name="target-only")))

    def run(scope):
        return generate(engine, prompt, GenerationParams(max_new_tokens=30, cache_scope=scope))

    first = run("a")
    assert not engine.draft.cache or list(engine.draft.cache) == ["a"]
    again, other = run("a"), run("b")
    for result in (first, again, other):
        assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert again.stats.accepted_tokens > other.stats.accepted_tokens
    assert again.stats.target_forward_passes < other.stats.target_forward_passes
    run(None)  # (a released session's response joins at the draft's next batch)
    assert sorted(engine.draft.cache) == ["a", "b"]  # each scope's own responses


def test_the_cache_of_earlier_responses_stays_bounded():
    from specdec.models.suffix import CACHE_SCOPES, CACHE_TOKENS

    draft = SuffixDraft(VOCAB)
    for scope in range(CACHE_SCOPES + 2):
        draft.remember(str(scope), [4, 5] * 10)
    assert list(draft.cache) == [str(scope) for scope in range(2, CACHE_SCOPES + 2)]  # the least recent dropped
    assert draft.cache["2"].tokens == [4, 5] * 10
    for response in ([3] * (CACHE_TOKENS // 4 + 1), [0] * (CACHE_TOKENS // 4), [1] * (CACHE_TOKENS // 2)):
        draft.remember("2", response)
    cache = draft.cache["2"]
    assert len(cache) <= CACHE_TOKENS
    # built again from whole responses, each still a document of its own: "0" was never followed by 1
    assert cache.documents() == [[0] * (CACHE_TOKENS // 4), [1] * (CACHE_TOKENS // 2)]
    assert cache.match([0]).token == 0


def test_a_copy_from_earlier_responses_ends_with_its_response():
    """In the cache of earlier responses, a walk's copy stops at the end of the response it copies
    (the next one's first token never followed it), and a copy's length is measured within it."""
    from specdec.models.suffix import SuffixSession
    from specdec.policies import make_policy
    from specdec.proposers import SuffixProposer
    from specdec.protocol import StepPlan
    from specdec.rounds import DraftRow

    draft = SuffixDraft(60)
    for response in ([1, 2, 3, 4], [4, 50, 51, 52]):
        draft.remember("a", response)
    cache = draft.cache["a"]
    assert not cache.goes_on(3) and cache.goes_on(4) and not cache.goes_on(7)
    assert cache.run([9, 3, 4], [], 4) == 0  # "3 4" ends the first response: the second's 4 follows nothing
    asker = SuffixSession()
    asker.scope = "a"
    row = DraftRow(asker, [7, 1, 2, 3], make_policy(PolicyConfig(name="fixed", k=6)), 6, 0, SamplingParams(), None)
    [proposal] = SuffixProposer(draft).propose([row], StepPlan(), [])
    assert proposal.candidates[:2] == [4, 50]  # "3" went on with 4; the copy of [1, 2, 3, 4] ends there


def suffix_item(session_id: str, history, k: int = 4, **fields):
    from specdec.protocol import ProposeItem, RoundSeed

    return ProposeItem(session_id, history, PolicyConfig(name="fixed", k=k), SamplingParams(), k, 0, [],
                       RoundSeed(1, 0, 0), **fields)


def test_a_draft_worker_of_the_suffix_draft_learns_every_round_remembers_what_it_saw_and_refuses_rounds_ahead():
    """Served as a Draft replica's worker: a round that walks nothing (a probe, K = 0) still learns
    what became of the walk before it; a released session's response joins its scope's cache as far
    as its last Propose's history went; an item asking for a round drafted ahead is refused in one
    line and the rest of the batch is served."""
    from specdec.protocol import HistoryDelta, Refused
    from specdec.workers import DraftWorker

    draft = SuffixDraft(VOCAB)
    worker = DraftWorker(draft, MatchHead())
    prompt = [1, 2, 3, 4, 1, 2]
    [first] = worker.propose([suffix_item("s", HistoryDelta(len(prompt), prompt, True), cache_scope="a")])
    assert first.candidates == [3, 4, 1, 2]
    taken = [3, 4, 5]  # the target took two candidates, then 5
    [probe] = worker.propose([suffix_item("s", HistoryDelta(len(prompt) + 3, taken, False), probe=True)])
    assert probe.candidates == [] and draft.stats.verified  # learnt, though nothing walked
    assert worker.release(["s"]) == [True]
    assert "a" not in draft.cache  # not yet: it joins on the thread that drafts, at the next batch
    answers = worker.propose([suffix_item("t", HistoryDelta(len(prompt), prompt, True), ahead=True),
                              suffix_item("u", HistoryDelta(len(prompt), prompt, True))])
    assert draft.cache["a"].tokens == taken  # the response past the prompt, tokens after the last walk included
    assert isinstance(answers[0], Refused) and "ahead" in answers[0].reason and "\n" not in answers[0].reason
    assert answers[1].candidates == [3, 4, 1, 2]


def test_a_release_from_another_thread_changes_the_shared_cache_on_the_thread_that_drafts():
    """Release arrives on a gRPC server's thread or a replica's event loop while the torch thread may
    be walking the scope's cache: adding the response there raced the walk (an IndexError failed
    the whole draft call). The response joins on the drafting thread, at its next batch."""
    import threading

    from specdec.protocol import HistoryDelta
    from specdec.workers import DraftWorker

    draft = SuffixDraft(VOCAB)
    worker = DraftWorker(draft, MatchHead())
    prompt = [1, 2, 3, 4, 1, 2]
    worker.propose([suffix_item("s", HistoryDelta(len(prompt), prompt, True), cache_scope="a")])
    worker.propose([suffix_item("s", HistoryDelta(len(prompt) + 2, [3, 5], False))])
    remembered_on = []
    remember = draft.remember
    draft.remember = lambda *args: (remembered_on.append(threading.current_thread()), remember(*args))
    releasing = threading.Thread(target=worker.release, args=(["s"],))
    releasing.start()
    releasing.join()
    worker.propose([suffix_item("t", HistoryDelta(len(prompt), prompt, True), cache_scope="a")])
    assert remembered_on == [threading.current_thread()] and draft.cache["a"].tokens == [3, 5]


def test_a_released_session_leaves_nothing_of_its_cache_behind():
    """What a released session leaves for the drafting thread holds nothing of its cache (its KV was
    kept until the draft's next batch, an idle replica's for good); one without a scope leaves nothing."""
    import gc
    import weakref

    from specdec.protocol import HistoryDelta
    from specdec.workers import DraftWorker

    worker = DraftWorker(SuffixDraft(VOCAB), MatchHead())
    prompt = [1, 2, 3, 4, 1, 2]
    worker.propose([suffix_item("s", HistoryDelta(len(prompt), prompt, True), cache_scope="a"),
                    suffix_item("t", HistoryDelta(len(prompt), prompt, True))])
    sessions = [weakref.ref(worker.sessions.get(name).kv) for name in ("s", "t")]
    worker.release(["s", "t"])
    gc.collect()
    assert [session() for session in sessions] == [None, None] and len(worker._ended) == 1  # s's response


def test_how_often_a_candidate_followed_counts_where_the_two_end_a_text():
    """The share of a context's continuations that were its candidate counts the pairs that end a
    response (nothing followed them there) and the one that ends the text, whichever occurrence
    the walk copies."""
    index = SuffixIndex()
    for document in ([5, 1, 2], [6, 1, 2], [7, 8]):
        index.add_document(document)
    assert index.match([1]).frequency == 1.0  # "1" was followed by 2 both times
    text = SuffixIndex()
    text.extend([1, 2, 3, 1, 2])
    assert text.match([1]).frequency == 1.0
    assert text.follow([1], 1, 1).frequency == 1.0  # the earlier occurrence: the same pair


def test_a_cache_of_earlier_responses_needs_the_suffix_draft_in_one_line(tiny_engine):
    with pytest.raises(InvalidRequestError, match="needs the suffix draft") as caught:
        tiny_engine.generate_ids([5, 6, 7], GenerationParams(max_new_tokens=2, cache_scope="a"))
    assert "\n" not in str(caught.value)


def test_a_cache_of_earlier_responses_on_the_fused_draft_needs_the_policy_that_walks_it(tiny_pair):
    """The fused draft walks its suffix under specdec++cost only: with another policy the option was
    taken, each response written to the cache and nothing read from it."""
    from specdec.builder import EngineConfig, build_rules

    draft_dir, target_dir = tiny_pair
    rules = build_rules(EngineConfig(draft=f"suffix+{draft_dir}", target=str(target_dir)), progress=False)
    for policy in (PolicyConfig(name="fixed", k=2), PolicyConfig(name="target-only")):
        with pytest.raises(InvalidRequestError, match="reads a cache of earlier responses under specdec..cost only"):
            rules.validate([5, 6, 7], GenerationParams(max_new_tokens=2, cache_scope="a", policy=policy))


def test_match_statistics_stay_bounded_and_follow_recent_walks():
    from specdec.models.suffix import STATS_WINDOW

    stats, bucket = MatchStats(), MatchStats.bucket(20, 1.0, greedy=True)
    for _ in range(int(STATS_WINDOW)):  # a long run of taken candidates, then a change of workload
        stats.learn([bucket], accepted=1, shown=1)
    for _ in range(int(STATS_WINDOW)):
        stats.learn([bucket], accepted=0, shown=1)
    assert stats.verified[bucket] <= STATS_WINDOW and stats.estimate(20, 1.0, greedy=True) < 0.4


def test_the_gpu_replay_decodes_the_targets_output_again_through_the_suffix_proposer():
    """benchmarks/suffix_replay.py: an output that copies its prompt is decoded in fewer, longer
    rounds than tokens on a flat pass curve (a GPU's), and every token of it is committed."""
    from benchmarks.suffix_replay import replay
    from specdec.cost_profile import CostProfile
    from specdec.proposers import SuffixProposer

    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    output = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [0, 0]
    curve = {1: 4.0, 2: 4.2, 4: 4.3, 8: 4.4, 16: 4.6}
    spec, plain, rounds = replay(SuffixProposer(SuffixDraft(VOCAB + 4)), prompt, output, CostProfile(t_draft_ms=0.01,
                                 t_target_ms=curve), 0.5, curve)
    assert plain == len(output) * 4.5 and rounds < len(output) / 3 and spec < plain / 2


def test_the_copy_oracle_copies_what_occurred_before_and_bounds_the_walk():
    """benchmarks/suffix_replay.py `copy_oracle`: a round copies the longest run of the output's next
    tokens found earlier, as far as its pass is cheapest a token; new text goes one token a pass;
    no walk decodes the same output for less."""
    from benchmarks.suffix_replay import copy_oracle, replay
    from specdec.cost_profile import CostProfile
    from specdec.proposers import SuffixProposer

    curve = {1: 4.0, 2: 4.2, 4: 4.3, 8: 4.4, 16: 4.6}
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    assert copy_oracle(prompt, [20, 21, 22], curve, 0.0) == (12.0, 3)  # nothing to copy: a pass a token
    copied = [3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 30]  # 17 tokens found before, then a new one
    ms, rounds = copy_oracle(prompt, copied, curve, 0.0)
    assert rounds == 2 and ms == pytest.approx(4.6 + 4.2)  # 15 candidates and a token, then 1 and the new one
    spec, _, _ = replay(SuffixProposer(SuffixDraft(VOCAB + 4)), prompt, copied,
                        CostProfile(t_draft_ms=0.01, t_target_ms=curve), 0.0, curve)
    assert ms <= spec


# ------------------------------------------------------------------------------------------------
# The fused draft (proposers.py `FusedProposer`): the suffix's candidates, the model's, or both


def fused_engine(target, noise: float = 0.05, kv: str = KV) -> SpecDecEngine:
    """A model draft (a noisy copy of the target) with the suffix draft fused in, its rounds priced
    on a curve where drafting pays (the model's step cheap, a token more in the pass a fifth of one).
    `kv`: both models' cache ("static": padded to its graph buckets off CUDA, as a GPU runs them)."""
    from specdec.models.runtime import DraftRuntime
    from specdec.models.static import StaticOptions
    from test_lossless import noisy_copy, q_reading_head

    static = StaticOptions(slots=8, capacity=256, graphs=True, pad_off_cuda=True, min_graph_length=64)
    draft = DraftRuntime(on_device(noisy_copy(target, noise, seed=5)), kv=kv, static=static)
    draft.suffix = SuffixDraft(VOCAB)
    engine = SpecDecEngine(draft, TargetRuntime(on_device(target), kv=kv, static=static),
                           head=q_reading_head(bias=1.5).to(DEVICE))
    for planner in engine.loop.planners:
        planner.given = CostProfile(t_draft_ms=0.5, t_target_ms={1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0, 64: 136.0})
    return engine


class Recorded:
    """What the fused rounds drafted: (suffix candidates kept, candidates in all, model passes) a row."""

    def __init__(self, monkeypatch):
        import specdec.proposers

        self.rows: list[tuple[int, int, int]] = []
        propose = specdec.proposers.propose

        def recording(draft, rows, *args, **kwargs):
            proposals = propose(draft, rows, *args, **kwargs)
            self.rows += [(len(r.prefix), len(p.candidates), p.forward_passes) for r, p in zip(rows, proposals)]
            return proposals

        monkeypatch.setattr(specdec.proposers, "propose", recording)


@pytest.mark.parametrize("kv", ["slots", "static"])
def test_greedy_output_with_the_fused_draft_equals_target_greedy(target, kv, monkeypatch):
    engine, recorded = fused_engine(target, kv=kv), Recorded(monkeypatch)
    plain = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=PolicyConfig(name="target-only")))
    for _ in range(2):
        result = generate(engine, PROMPT, GenerationParams(max_new_tokens=40))
        assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.accepted_tokens > 0
    # rounds of the model alone and of the suffix's candidates continued by the model
    assert any(prefix == 0 and passes for prefix, _, passes in recorded.rows)
    assert any(0 < prefix < total and passes for prefix, total, passes in recorded.rows), recorded.rows


# A prompt whose end the suffix continues by two sure candidates ("1 2 0" was always followed by
# "3 4"), then by an unsure one ("3 4" was followed by 5 and by 1): the model goes on from there.
FORK = [1, 2, 0, 3, 4, 5, 1, 2, 0, 3, 4, 1, 1, 2, 0]


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
def test_sampled_outputs_with_the_fused_draft_follow_the_target_distribution(target, sampling_name, monkeypatch):
    """One-hot q for the suffix's candidates, the model's q for its continuation drawn after them,
    in one round from the first: the planner's model acceptance is set to 0.7 and the suffix's
    estimates stay at their prior (the suffix's sure candidates stay, its unsure one gives way), and
    nothing lags (the model drafts at once)."""
    from specdec.planner import StepPlanner

    engine, sampling, recorded = fused_engine(target), SAMPLINGS[sampling_name], Recorded(monkeypatch)
    monkeypatch.setattr(StepPlanner, "lag", lambda self, s: 0)
    monkeypatch.setattr(MatchStats, "learn", lambda *args: None)
    for planner in engine.loop.planners:
        planner._accepted, planner._verified = 700.0, 1000.0
        planner.given = CostProfile(t_draft_ms=0.01, t_target_ms={1: 10.0, 64: 11.0})
    completions = sample_all(engine, FORK, PolicyConfig(), sampling, seed=700)
    mixed = sum(0 < prefix < total for prefix, total, _ in recorded.rows)
    assert mixed > SAMPLES // 4, mixed  # both drafts in one round, most samples' first
    assert_target_distribution(target, FORK, sampling, completions)


def test_a_fused_feature_draft_never_drafts_after_the_suffixs_candidates(target, monkeypatch):
    """A feature draft reads the target's states at every position it feeds, and there are none yet
    at the suffix's candidates: fused, it drafts from scratch or not at all."""
    from specdec.models.feature_runtime import FeatureDraftRuntime
    from test_lossless import q_reading_head, target_greedy
    from tiny import tiny_feature_draft

    draft = FeatureDraftRuntime(tiny_feature_draft(target, None, seed=1), identity="tiny-feature")
    draft.suffix = SuffixDraft(VOCAB)
    engine, recorded = SpecDecEngine(draft, TargetRuntime(target), head=q_reading_head(bias=1.5)), Recorded(monkeypatch)
    for planner in engine.loop.planners:  # as where the fused model draft continues the suffix's candidates
        planner._accepted, planner._verified = 700.0, 1000.0
        planner.given = CostProfile(t_draft_ms=0.01, t_target_ms={1: 10.0, 64: 11.0})
    for _ in range(2):
        result = generate(engine, FORK, GenerationParams(max_new_tokens=40))
        assert result.completions[0].token_ids == target_greedy(target, FORK, 40)
    assert recorded.rows and all(prefix == 0 for prefix, _, _ in recorded.rows)
    assert result.stats.accepted_tokens > 0


def test_where_the_model_does_not_pay_the_fused_draft_drafts_its_suffix_alone(target, monkeypatch):
    """A model step as dear as the target's pass: the planner holds the model, and the suffix's
    rounds still come (no model pass), their output the target's."""
    engine, recorded = fused_engine(target), Recorded(monkeypatch)
    for planner in engine.loop.planners:
        planner.given = CostProfile(t_draft_ms=20.0, t_target_ms={1: 10.0, 8: 11.0, 32: 13.0, 64: 16.0})
    plain = generate(engine, PROMPT, GenerationParams(max_new_tokens=40, policy=PolicyConfig(name="target-only")))
    result = generate(engine, PROMPT, GenerationParams(max_new_tokens=40))
    assert result.completions[0].token_ids == plain.completions[0].token_ids
    assert result.stats.accepted_tokens > 0 and result.stats.draft_forward_passes == 0
    assert not recorded.rows  # the model never drafted
