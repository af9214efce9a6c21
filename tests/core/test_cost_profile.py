"""Cost profiles: the interpolated t_target(k), loading from JSON or a bench run, bad files; the live
profile the loop measures (`LiveCosts`) on a fake clock."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from specdec.budget import decide_step, drafting_pays
from specdec.cost_profile import CostProfile, LiveCosts, PassTiming, bucket
from specdec.errors import InvalidRequestError

LLAMA_CPP = {"t_draft_ms": 22, "t_target_ms": {"1": 35, "2": 65, "4": 110, "8": 237, "16": 305}}


def test_t_target_interpolates_the_curve_at_k_plus_one_tokens():
    profile = CostProfile.model_validate(LLAMA_CPP)
    assert profile.t_target(0) == 35 and profile.t_target(1) == 65  # plain decoding; one candidate + 1
    assert profile.t_target(2) == pytest.approx(87.5)  # 3 tokens: halfway from 65 to 110
    assert profile.t_target(19) == pytest.approx(305 + 4 * (305 - 35) / 15)  # past 16: the span's slope, steeper
    assert profile.draft_ms(1) == 22 and profile.draft_ms(8) == 8 * 22  # no curve by sessions: per session
    assert profile.draft_ms(0) == 0
    batched = profile.model_copy(update={"t_draft_rows_ms": {1: 22.0, 4: 40.0}})
    assert batched.draft_ms(2) == pytest.approx(28.0) and batched.draft_ms(8) == pytest.approx(64.0)
    assert CostProfile(t_draft_ms=1, t_target_ms={4: 50}).t_target(9) == 50  # one point: flat
    steep_end = CostProfile(t_draft_ms=1, t_target_ms={1: 10, 8: 12, 16: 40})  # a GPU turning compute-bound
    assert steep_end.pass_ms(20) == pytest.approx(40 + 4 * 28 / 8)  # the last segment, steeper


def test_a_noisy_last_point_does_not_make_longer_passes_cheap():
    """The live curve the concurrency run had after plain decoding at 16 sessions (its 16-token
    bucket below its 15-token one): extended along that last segment, a 52-token pass cost nothing
    and the budget started every session's draft at 4 sessions (0.7x plain decoding). Past the end
    the curve now grows at its whole span's mean slope."""
    measured = CostProfile(t_draft_ms=44.0, t_draft_rows_ms={1: 44.0, 2: 75.0, 16: 471.0},
                           t_target_ms={1: 93.0, 2: 146.0, 4: 273.0, 8: 579.0, 10: 876.0, 11: 929.0, 12: 1000.0,
                                        15: 1148.0, 16: 1006.0})
    assert measured.pass_ms(52) == pytest.approx(1006 + 36 * (1006 - 93) / 15)
    assert all(measured.pass_ms(n + 1) >= measured.pass_ms(n) for n in range(16, 400))
    assert not drafting_pays(measured, 4, 20)


def test_load_a_profile_or_a_bench_run(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(LLAMA_CPP))
    assert CostProfile.load(path) == CostProfile.model_validate(LLAMA_CPP)
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"forward_times": {"draft_s": {"1": 0.05, "4": 0.07},
                                                   "target_s": {"1": 0.25, "8": 0.35}}}))
    profile = CostProfile.load(bench)
    assert profile.t_draft_ms == pytest.approx(50) and profile.t_target_ms == pytest.approx({1: 250, 8: 350})
    fitted = {"t_draft_ms": 56.0, "t_target_ms": {"1": 400.0, "21": 860.0}}  # the loop's own costs win
    bench.write_text(json.dumps({"cost_profile": fitted, "forward_times": {"draft_s": {"1": 0.05},
                                                                           "target_s": {"1": 0.25}}}))
    assert CostProfile.load(bench) == CostProfile.model_validate(fitted)
    live = {"t_draft_ms": 81.0, "t_target_ms": {"1": 385.0, "2": 726.0, "8": 994.0}, "t_draft_rows_ms": {"1": 81.0},
            "source": "measured in the loop", "drafting": True}  # what the loop planned with wins over the fit
    bench.write_text(json.dumps({"live_profile": live, "cost_profile": fitted}))
    loaded = CostProfile.load(bench)
    assert loaded.t_target_ms == {1: 385.0, 2: 726.0, 8: 994.0} and loaded.t_draft_rows_ms == {1: 81.0}
    assert str(bench) in loaded.source


def test_a_curve_measured_from_many_tokens_on_prices_shorter_passes_above_nothing():
    """Found by a bug hunt: a hand-given curve starting at 16 tokens and steep at first was extended
    back along its first segment to 0 ms at 8 tokens and less (clamped there), and the planner
    divided by the free pass. Before its first point a pass costs at least that point's cost per
    token."""
    profile = CostProfile(t_draft_ms=2.0, t_target_ms={16: 10.0, 32: 30.0})
    assert [profile.pass_ms(n) for n in (1, 8)] == [10.0 / 16, 5.0]
    concave = CostProfile(t_draft_ms=2.0, t_target_ms={4: 10.0, 8: 12.0})
    assert concave.pass_ms(2) == pytest.approx(9.0)  # along the first segment where it is dearer
    decide_step(profile, sessions=1, cap=8, acceptance=0.8, upper=0.9, lags=[0], left=[100], stop_rate=0.0)


@pytest.mark.parametrize("text", ["{", json.dumps({"t_draft_ms": 1}), json.dumps({**LLAMA_CPP, "t_target_ms": {"0": 5}}),
                                  json.dumps({**LLAMA_CPP, "extra": 1}), json.dumps({"live_profile": [1, 2]}),
                                  '{"t_draft_ms": Infinity, "t_target_ms": {"1": 5}}'])
def test_a_bad_profile_is_one_line(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(InvalidRequestError, match="bad cost profile") as info:
        CostProfile.load(path)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="cannot read"):
        CostProfile.load(tmp_path / "missing.json")


def test_a_negative_cost_is_refused():
    with pytest.raises(ValidationError):
        CostProfile(t_draft_ms=-1, t_target_ms={1: 10})


# ------------------------------------------------------------------------------------------------
# The live profile


def timings(role: str, tokens: int, *ms: float, probe: bool = False) -> list[PassTiming]:
    return [PassTiming(role, tokens, m, probe) for m in ms]


def test_buckets_are_exact_then_two_significant_bits():
    assert [bucket(n) for n in (1, 7, 32, 33, 47, 48, 63, 64, 100)] == [1, 7, 32, 32, 32, 48, 48, 64, 96]


def test_nothing_is_planned_until_both_roles_are_measured():
    costs = LiveCosts()
    assert costs.profile() is None
    costs.observe(timings("draft", 1, 20.0, 21.0, 22.0))
    assert costs.profile() is None
    costs.observe(timings("verifier", 1, 50.0, 51.0))  # two timings: not enough for a bucket yet
    assert costs.profile() is None
    costs.observe(timings("verifier", 1, 52.0))
    profile = costs.profile()
    assert profile.t_draft_ms == 21.0 and profile.pass_ms(1) == 51.0 and profile.source.startswith("measured")


def test_a_probe_counts_at_once_and_replaces_its_bucket():
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 30.0, probe=True) + timings("verifier", 2, 90.0, probe=True))
    assert costs.profile().t_draft_ms == 30.0 and costs.profile().pass_ms(2) == 90.0
    costs.observe(timings("draft", 1, 31.0, 32.0, 33.0, 34.0))
    assert costs.profile().t_draft_ms == 32.0
    costs.observe(timings("draft", 1, 5.0, probe=True))
    assert costs.profile().t_draft_ms == 5.0


def test_the_profile_ignores_an_outlier_and_follows_a_change():
    """A fake clock: a pass of 8 tokens takes 100 ms, once 5000 ms (a hiccup: nothing moves), then
    200 ms from some time on: followed within LEVEL_WINDOW passes."""
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 10.0, 10.0, 10.0))
    costs.observe(timings("verifier", 8, *[100.0] * 8, 5000.0, 100.0))
    assert costs.profile().pass_ms(8) == 100.0
    for _ in range(LiveCosts.LEVEL_WINDOW):
        costs.observe(timings("verifier", 8, 200.0))
    assert costs.profile().pass_ms(8) == pytest.approx(200.0)
    assert costs.profile().t_draft_ms == 10.0  # the other role is untouched


def test_an_idle_drafts_curve_moves_with_the_machine():
    """The draft timed at start (10 ms), then only plain passes for a while (the draft off), then
    the host gets 1.5x slower: the draft's curve follows the target's level, or drafting would look
    cheaper by as much. A draft being timed keeps its own level."""
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 10.0, probe=True) + timings("draft", 1, *[10.0] * LiveCosts.LEVEL_WINDOW))
    costs.observe(timings("verifier", 8, *[100.0] * (LiveCosts.IDLE_TIMINGS + 1)))
    for _ in range(LiveCosts.LEVEL_WINDOW):
        costs.observe(timings("verifier", 8, 150.0))
    profile = costs.profile()
    assert profile.pass_ms(8) == pytest.approx(150.0) and profile.t_draft_ms == pytest.approx(15.0)
    costs.observe(timings("draft", 1, 15.0))  # drafting again, as slow as its curve says: it stays there
    assert costs.profile().t_draft_ms == pytest.approx(15.0)

    busy = LiveCosts()
    busy.observe(timings("draft", 1, 10.0, probe=True))
    for _ in range(LiveCosts.IDLE_TIMINGS + LiveCosts.LEVEL_WINDOW):
        busy.observe(timings("verifier", 8, 150.0 if busy.observed > LiveCosts.IDLE_TIMINGS else 100.0)
                     + timings("draft", 1, 10.0))
    assert busy.profile().pass_ms(8) == pytest.approx(150.0) and busy.profile().t_draft_ms == pytest.approx(10.0)


def test_a_slower_machine_moves_sizes_that_are_not_being_timed():
    """Plain decoding (1 token) and a verification of 4 were timed at 50 and 120 ms; the host gets 3x
    slower while only plain passes run (the draft is off): the 4-token pass follows."""
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 40.0, probe=True))
    costs.observe(timings("verifier", 1, 50.0, 50.0, 50.0) + timings("verifier", 4, 120.0, 120.0, 120.0))
    for _ in range(LiveCosts.LEVEL_WINDOW):
        costs.observe(timings("verifier", 1, 150.0))
    profile = costs.profile()
    assert profile.pass_ms(1) == pytest.approx(150.0) and profile.pass_ms(4) == pytest.approx(360.0)
    for _ in range(LiveCosts.LEVEL_WINDOW):  # noise within the band moves nothing
        costs.observe(timings("verifier", 1, 160.0))
    assert costs.profile().pass_ms(4) == pytest.approx(360.0)


def test_noisy_plain_passes_do_not_walk_the_sizes_that_are_not_being_timed():
    """llama.cpp's plain passes on a 2-core host: 33 ms, one in three up to 60. 4000 of them (40
    prompts) while a 4-token pass, timed at 100 ms at the start, is not timed again: it stays within
    the plain passes' spread (60 / 33) of 100 ms (a level that moved by the ratio to each bucket's
    current value walked it to 10x)."""
    rng = random.Random(0)
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 10.0, probe=True))
    costs.observe(timings("verifier", 1, 33.0, 33.0, 33.0) + timings("verifier", 4, 100.0, probe=True))
    for _ in range(4000):
        costs.observe(timings("verifier", 1, 33.0 if rng.random() < 0.66 else rng.uniform(33.0, 60.0)))
        assert 90.0 <= costs.profile().pass_ms(4) <= 185.0


def test_a_pass_timed_in_a_smaller_step_does_not_price_a_larger_steps_extra_tokens():
    """The llama.cpp curve that did it: 4 sessions' rounds timed passes of 9 and 12 tokens at 199
    and 228 ms; 8 sessions' plain pass of 8 took 229 (every cached token is read). For a step of 8
    the 9-12 token passes are left out (the curve goes on at its slope past 8) until timed in a
    step of 8; a step of 4, and the report, keep them."""
    costs = LiveCosts()
    costs.observe(timings("draft", 1, 13.0, probe=True))
    costs.observe(timings("verifier", 4, 117.0, probe=True))
    costs.observe(timings("verifier", 9, 199.0, 199.0, 199.0) + timings("verifier", 12, 228.0, 228.0, 228.0),
                  sessions=4)
    costs.observe(timings("verifier", 8, 229.0, 229.0, 229.0), sessions=8)
    assert costs.profile(4).pass_ms(9) == 199.0 and costs.profile().pass_ms(12) == 228.0
    at_8 = costs.profile(8)
    assert set(at_8.t_target_ms) == {4, 8}
    assert at_8.pass_ms(9) > at_8.pass_ms(8) and at_8.pass_ms(12) > 229.0 + 3 * 25.0  # along 4 -> 8's slope
    assert not drafting_pays(CostProfile(t_draft_ms=13.0, t_target_ms=at_8.t_target_ms), 8, 4)
    assert drafting_pays(CostProfile(t_draft_ms=13.0, t_target_ms=costs.profile().t_target_ms), 8, 4)
    costs.observe(timings("verifier", 16, 274.0, probe=True), sessions=8)  # the loop's curve probe at 8
    assert costs.profile(8).pass_ms(16) == 274.0


def test_bad_timings_are_ignored():
    costs = LiveCosts()
    costs.observe([PassTiming("draft", 0, 5.0), PassTiming("draft", 1, float("nan")), PassTiming("draft", 1, -1.0),
                   PassTiming("other", 1, 5.0)])
    assert costs.observed == 0 and costs.curve("draft") == {}
