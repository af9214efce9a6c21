"""Per-request metrics on a hand-made sequence of rounds, and the paper's latency model."""

from __future__ import annotations

from collections import Counter

import pytest

from specdec.metrics import RequestStats, predicted_latency_per_token

# (K, n) per round: all accepted, a rejection at position 2, a rejection at position 1, a round
# with no candidates (token budget or target-only), and a short all-accepted round.
ROUNDS = [(3, 3), (3, 1), (2, 0), (0, 0), (1, 1)]


def stats_of(rounds: list[tuple[int, int]]) -> RequestStats:
    """Stats as the engine records them: one record per round, n + 1 tokens committed."""
    stats = RequestStats()
    for num_candidates, num_accepted in rounds:
        stats.record_round(num_candidates, num_accepted)
        stats.generated_tokens += num_accepted + 1
        stats.draft_forward_passes += num_candidates
    return stats


def test_record_round_counts():
    stats = stats_of(ROUNDS)
    assert stats.rounds == stats.target_forward_passes == 5
    assert stats.draft_tokens == 9
    assert stats.accepted_tokens == 5
    assert stats.discarded_tokens == 4
    assert stats.generated_tokens == 10  # 4 + 2 + 1 + 1 + 2
    assert stats.k_histogram == Counter({3: 2, 2: 1, 0: 1, 1: 1})
    assert stats.drafted_per_position == [4, 3, 2]
    assert stats.accepted_per_position == [3, 1, 1]


def test_derived_rates():
    stats = stats_of(ROUNDS)
    assert stats.verification_rate == pytest.approx(5 / 10)
    assert stats.discard_rate == pytest.approx(4 / 10)
    assert stats.acceptance_rate == pytest.approx(5 / 9)
    assert stats.mean_accepted_length == pytest.approx(10 / 5)  # committed tokens per round
    assert stats.acceptance_by_position == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    stats.wall_time_s = 4.0
    assert stats.tokens_per_s == pytest.approx(2.5)


def test_empty_stats_have_zero_rates():
    stats = RequestStats()
    assert (stats.verification_rate, stats.discard_rate, stats.acceptance_rate,
            stats.mean_accepted_length, stats.tokens_per_s) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert stats.acceptance_by_position == []


def test_target_only_rounds():
    stats = stats_of([(0, 0)] * 6)
    assert stats.verification_rate == 1.0 and stats.discard_rate == 0.0
    assert stats.mean_accepted_length == 1.0 and stats.drafted_per_position == []


def test_merge_equals_recording_everything_in_one():
    first, second = ROUNDS[:2], ROUNDS[2:] + [(5, 4)]  # the second reaches further positions
    merged = stats_of(first)
    merged.draft_time_s, merged.target_time_s, merged.wall_time_s = 1.0, 2.0, 3.5
    other = stats_of(second)
    other.draft_time_s, other.target_time_s, other.wall_time_s = 0.5, 1.5, 2.5
    merged.merge(other)

    expected = stats_of(first + second)
    expected.draft_time_s, expected.target_time_s, expected.wall_time_s = 1.5, 3.5, 6.0
    assert merged == expected
    assert merged.drafted_per_position == [5, 4, 3, 1, 1]
    assert merged.accepted_per_position == [4, 2, 2, 1, 0]
    assert merged.acceptance_by_position == pytest.approx([4 / 5, 2 / 4, 2 / 3, 1, 0])


def test_positions_drafted_and_never_accepted_count_zero():
    """A dashboard reads position j's acceptance at [j]: a round whose candidates were all rejected
    still has its positions, at 0."""
    stats = stats_of([(4, 0)])
    assert stats.drafted_per_position == [1, 1, 1, 1] and stats.accepted_per_position == [0, 0, 0, 0]
    assert stats.acceptance_by_position == [0.0, 0.0, 0.0, 0.0]
    short = RequestStats(drafted_per_position=[2, 1], accepted_per_position=[1])  # (as older replies carry them)
    assert short.acceptance_by_position == [0.5, 0.0]


def test_merge_into_empty_stats_copies_position_counts():
    merged = RequestStats()
    merged.merge(stats_of(ROUNDS))
    assert merged.to_dict() == stats_of(ROUNDS).to_dict()


def test_to_dict_and_summary():
    stats = stats_of(ROUNDS)
    data = stats.to_dict()
    assert data["k_histogram"] == {"0": 1, "1": 1, "2": 1, "3": 2}
    assert data["verification_rate"] == pytest.approx(0.5)
    assert data["acceptance_by_position"] == pytest.approx([0.75, 1 / 3, 0.5])
    assert "verification rate 0.500" in stats.summary() and "discard rate 0.400" in stats.summary()


def test_predicted_latency_per_token_hand_example():
    # t_draft + t_draft * discard + (t_target - t_draft) * verification = 1 + 0.5 + 9 * 0.25
    assert predicted_latency_per_token(1.0, 10.0, discard_rate=0.5, verification_rate=0.25) == pytest.approx(3.75)
    assert predicted_latency_per_token(0.0, 10.0, discard_rate=0.0, verification_rate=1.0) == pytest.approx(10.0)


def test_predicted_latency_matches_the_cost_model_total():
    """Eq. 2.1-2.3: T_total = t_draft * N_draft + t_target * N_target with N_draft = the candidates
    drafted; latency/token from the two rates times N must give the same total."""
    t_draft, t_target = 0.02, 0.3
    stats = stats_of(ROUNDS)
    total = t_draft * stats.draft_tokens + t_target * stats.target_forward_passes
    latency = predicted_latency_per_token(t_draft, t_target, stats.discard_rate, stats.verification_rate)
    assert latency * stats.generated_tokens == pytest.approx(total)
