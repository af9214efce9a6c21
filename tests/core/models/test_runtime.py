"""KV caches hold exactly the accepted prefix after accept, partial reject and full reject; a ragged
pass over many sessions gives each the outputs it would get alone (the batch-1 reference runtime)."""

import pytest
import torch
from transformers import DynamicCache

from specdec.models.cache import RaggedBatch, SlotBuffers
from specdec.models.runtime import DraftRuntime, TargetRuntime, common_prefix_length
from tiny import tiny_model

VOCAB = 40
PROMPT = [3, 17, 5, 9, 22, 1]
CANDIDATES = [7, 8, 9, 10]
KV_KINDS = ("slots", "static", "reference")
BATCHED = ("slots", "static")  # the caches that run many sessions per pass


@pytest.fixture(scope="module", params=KV_KINDS)
def target(request):
    return TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), kv=request.param)


@pytest.fixture(scope="module", params=KV_KINDS)
def draft(request):
    return DraftRuntime(tiny_model(VOCAB, hidden_size=16, layers=1, seed=8), kv=request.param)


@torch.inference_mode()
def fresh_logits(runtime, sequence):
    """Next-token logits after `sequence` from a full forward pass without any cache."""
    return runtime.model(torch.tensor([sequence])).logits[0, -1].float()


@pytest.mark.parametrize("num_accepted", [len(CANDIDATES), 2, 0], ids=["accept-all", "partial-reject", "full-reject"])
def test_target_cache_holds_accepted_prefix(target, num_accepted):
    session = target.new_session()
    [logits] = target.score([session], [PROMPT], [CANDIDATES])
    assert logits.shape == (len(CANDIDATES) + 1, VOCAB)
    assert len(session) == len(PROMPT) + len(CANDIDATES)

    target.rollback(session, len(PROMPT) + num_accepted)
    kept = PROMPT + CANDIDATES[:num_accepted]
    assert session.tokens == kept
    if isinstance(session.handle, DynamicCache):
        assert session.handle.get_seq_length() == len(kept)

    correction = 11
    [next_logits] = target.score([session], [kept + [correction]], [[]])
    assert len(session) == len(kept) + 1  # only the correction was fed
    torch.testing.assert_close(next_logits[0], fresh_logits(target, kept + [correction]), rtol=1e-4, atol=1e-4)


def test_score_rows_match_fresh_prefills(target):
    session = target.new_session()
    [logits] = target.score([session], [PROMPT], [CANDIDATES])
    for i in range(len(CANDIDATES) + 1):
        torch.testing.assert_close(logits[i], fresh_logits(target, PROMPT + CANDIDATES[:i]), rtol=1e-4, atol=1e-4)


def test_draft_catches_up_on_committed_tokens_before_drafting(draft):
    session = draft.new_session()
    draft.start([session], [PROMPT])
    for token in CANDIDATES:  # drafted y_1..y_4
        draft.step([session], [token])
    assert session.tokens == PROMPT + CANDIDATES

    # Verification accepted y_1, y_2 and corrected y_3 to 30: the next round names that history.
    history = PROMPT + CANDIDATES[:2] + [30]
    [out] = draft.start([session], [history])
    assert session.tokens == history
    torch.testing.assert_close(out.logits, fresh_logits(draft, history), rtol=1e-4, atol=1e-4)


def test_lost_cache_reprefills_from_history(draft):
    history = PROMPT + [4, 4, 2]
    [out] = draft.start([draft.new_session()], [history])
    torch.testing.assert_close(out.logits, fresh_logits(draft, history), rtol=1e-4, atol=1e-4)


def test_fully_cached_sequence_still_yields_outputs(target):
    session = target.new_session()
    target.score([session], [PROMPT], [[]])
    [logits] = target.score([session], [PROMPT], [[]])  # nothing new: the last position is recomputed
    assert len(session) == len(PROMPT)
    torch.testing.assert_close(logits[0], fresh_logits(target, PROMPT), rtol=1e-4, atol=1e-4)


def test_draft_step_returns_hidden_state_of_fed_token(draft):
    session = draft.new_session()
    draft.start([session], [PROMPT])
    [out] = draft.step([session], [12])
    assert out.hidden.shape == (16,)
    assert out.logits.shape == (VOCAB,) and out.logits.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# Many sessions in one pass

HISTORIES = [PROMPT, [1, 2, 3], list(range(10, 30)), [5]]
RAGGED_CANDIDATES = [[7, 8, 9, 10], [], [4], [6, 6]]


@pytest.mark.parametrize("kv", BATCHED)
def test_a_ragged_verification_pass_gives_each_session_its_own_rows(kv):
    model = tiny_model(VOCAB, hidden_size=32, layers=2, seed=7)
    batched, alone = TargetRuntime(model, kv=kv), TargetRuntime(model, kv="reference")
    sessions = [batched.new_session() for _ in HISTORIES]
    passes = batched.forward_passes
    rows = batched.score(sessions, HISTORIES, RAGGED_CANDIDATES)
    assert batched.forward_passes == passes + 1  # four sessions, four different K, one pass
    for history, candidates, logits in zip(HISTORIES, RAGGED_CANDIDATES, rows):
        [expected] = alone.score([alone.new_session()], [history], [candidates])
        assert logits.shape == (len(candidates) + 1, VOCAB)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", BATCHED)
def test_sessions_roll_back_on_their_own_and_keep_sharing_passes(kv):
    """Round after round: each session accepts a different prefix, rolls back, and the next pass
    (committed tail plus new candidates, a prefill joining) still matches a fresh prefill."""
    target = TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7), kv=kv)
    histories = [list(h) for h in HISTORIES[:3]]
    sessions = [target.new_session() for _ in histories]
    generator = torch.Generator().manual_seed(0)
    for round_index in range(4):
        candidates = [torch.randint(0, VOCAB, (k,), generator=generator).tolist() for k in (3, 1 + round_index, 5)]
        if round_index == 2:  # a new session joins with its prompt
            histories.append(list(range(2, 14)))
            sessions.append(target.new_session())
            candidates.append([3, 3])
        rows = target.score(sessions, histories, candidates)
        for history, cands, logits in zip(histories, candidates, rows):
            for i in range(len(cands) + 1):
                torch.testing.assert_close(logits[i], fresh_logits(target, history + cands[:i]), rtol=1e-4, atol=1e-4)
        for b, (session, cands) in enumerate(zip(sessions, candidates)):
            accepted = (b + round_index) % (len(cands) + 1)
            target.rollback(session, len(histories[b]) + accepted)
            histories[b] += cands[:accepted] + [int(rows[b][accepted].argmax())]  # the correction / bonus token
            assert session.tokens == histories[b][:-1]


@pytest.mark.parametrize("kv", BATCHED)
def test_batched_draft_steps_match_single_sessions(kv):
    model = tiny_model(VOCAB, hidden_size=16, layers=1, seed=8)
    batched, alone = DraftRuntime(model, kv=kv), DraftRuntime(model, kv="reference")
    sessions = [batched.new_session() for _ in HISTORIES]
    outs = batched.start(sessions, HISTORIES)
    outs_step = batched.step(sessions[:2], [11, 12])  # two sessions draft on, two stopped
    for history, out in zip(HISTORIES, outs):
        [expected] = alone.start([alone.new_session()], [history])
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.hidden, expected.hidden, rtol=1e-4, atol=1e-4)
    for history, token, out in zip(HISTORIES, [11, 12], outs_step):
        torch.testing.assert_close(out.logits, fresh_logits(batched, history + [token]), rtol=1e-4, atol=1e-4)


def test_max_tokens_per_pass_splits_a_batch_into_passes():
    model = tiny_model(VOCAB, hidden_size=16, layers=1, seed=8)
    limited = DraftRuntime(model, max_tokens_per_pass=9)
    sessions = [limited.new_session() for _ in HISTORIES]
    outs = limited.start(sessions, HISTORIES)  # 6 + 3 | 20 (alone: never split) | 1
    assert limited.forward_passes == 3
    for history, out in zip(HISTORIES, outs):
        torch.testing.assert_close(out.logits, fresh_logits(limited, history), rtol=1e-4, atol=1e-4)


def test_ragged_batch_layout_worked_example():
    batch = RaggedBatch([SlotBuffers(), SlotBuffers()], starts=[5, 2], counts=[2, 1])
    assert batch.bounds == [0, 2, 3] and batch.positions == [5, 6, 2]
    mask = batch.mask(0, torch.device("cpu"))
    assert mask.shape == (2, 7) and mask[0].tolist() == [True] * 6 + [False] and mask[1].all()
    assert batch.mask(1, torch.device("cpu")) is None


def test_a_slot_grows_keeping_what_it_holds():
    slot, like = SlotBuffers(), torch.zeros(2, 1, 4)
    slot.reserve(0, like, length=3, keep=0)
    slot.keys[0][:, :3] = torch.arange(3.0)[None, :, None]
    capacity = slot.keys[0].shape[1]
    slot.reserve(0, like, length=capacity + 1, keep=3)
    assert slot.keys[0].shape[1] >= 2 * capacity
    assert slot.keys[0][:, :3, 0].tolist() == [[0.0, 1.0, 2.0]] * 2


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_common_prefix_length_is_the_first_difference():
    import random

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 80))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == want == common_prefix_length(b, a)
