"""KV caches hold exactly the accepted prefix after accept, partial reject and full reject."""

import pytest
import torch

from specdec.models.runtime import DraftRuntime, TargetRuntime, common_prefix_length
from tiny import tiny_model

VOCAB = 40
PROMPT = [3, 17, 5, 9, 22, 1]
CANDIDATES = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def target():
    return TargetRuntime(tiny_model(VOCAB, hidden_size=32, layers=2, seed=7))


@pytest.fixture(scope="module")
def draft():
    return DraftRuntime(tiny_model(VOCAB, hidden_size=16, layers=1, seed=8))


def fresh_logits(runtime, sequence):
    """Next-token logits after `sequence`, computed by a full prefill in a new session."""
    session = runtime.new_session()
    logits, _ = runtime._forward(session, sequence, num_outputs=1)
    return logits[0]


@pytest.mark.parametrize("num_accepted", [len(CANDIDATES), 2, 0], ids=["accept-all", "partial-reject", "full-reject"])
def test_target_cache_holds_accepted_prefix(target, num_accepted):
    session = target.new_session()
    logits = target.score(session, PROMPT, CANDIDATES)
    assert logits.shape == (len(CANDIDATES) + 1, VOCAB)
    assert len(session) == len(PROMPT) + len(CANDIDATES)

    target.rollback(session, len(PROMPT) + num_accepted)
    kept = PROMPT + CANDIDATES[:num_accepted]
    assert session.tokens == kept
    assert session.cache.get_seq_length() == len(kept)

    correction = 11
    next_logits = target.score(session, kept + [correction], [])
    assert len(session) == len(kept) + 1  # only the correction was fed
    torch.testing.assert_close(next_logits[0], fresh_logits(target, kept + [correction]), rtol=1e-4, atol=1e-4)


def test_score_rows_match_fresh_prefills(target):
    session = target.new_session()
    logits = target.score(session, PROMPT, CANDIDATES)
    for i in range(len(CANDIDATES) + 1):
        torch.testing.assert_close(logits[i], fresh_logits(target, PROMPT + CANDIDATES[:i]), rtol=1e-4, atol=1e-4)


def test_draft_catches_up_on_committed_tokens_before_drafting(draft):
    session = draft.new_session()
    draft.start(session, PROMPT)
    for token in CANDIDATES:  # drafted y_1..y_4
        draft.step(session, token)
    assert session.tokens == PROMPT + CANDIDATES

    # Verification accepted y_1, y_2 and corrected y_3 to 30: the next round names that history.
    history = PROMPT + CANDIDATES[:2] + [30]
    out = draft.start(session, history)
    assert session.tokens == history
    assert session.cache.get_seq_length() == len(history)
    torch.testing.assert_close(out.logits, fresh_logits(draft, history), rtol=1e-4, atol=1e-4)


def test_lost_cache_reprefills_from_history(draft):
    history = PROMPT + [4, 4, 2]
    session = draft.new_session()
    out = draft.start(session, history)
    torch.testing.assert_close(out.logits, fresh_logits(draft, history), rtol=1e-4, atol=1e-4)


def test_fully_cached_sequence_still_yields_outputs(target):
    session = target.new_session()
    target.score(session, PROMPT, [])
    logits = target.score(session, PROMPT, [])  # nothing new: the last position is recomputed
    assert len(session) == len(PROMPT)
    torch.testing.assert_close(logits[0], fresh_logits(target, PROMPT), rtol=1e-4, atol=1e-4)


def test_draft_step_returns_hidden_state_of_fed_token(draft):
    session = draft.new_session()
    draft.start(session, PROMPT)
    out = draft.step(session, 12)
    assert out.hidden.shape == (16,)
    assert out.logits.shape == (VOCAB,) and out.logits.dtype == torch.float32


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
