"""The step's verification budget (specdec/budget.py) on hand-computed steps, and rounds.propose
spending it over a batch whose sessions get different K (0 included)."""

from __future__ import annotations

import pytest
import torch

from specdec.budget import (StepBudget, best_allocation, curve_probe, decide_step, draining_allocation, draining_batch,
                            drafting_pays, drafting_saving, expected_remaining, expected_tokens, geometric,
                            hopeful_acceptance, overlap_saving, replay_step, who_drafts,
                            worth_catching_up)
from specdec.cost_profile import CostProfile, LiveCosts, PassTiming
from specdec.features import FEATURES_DISTRIBUTION
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.runtime import DraftOutputs, KVSession
from specdec.policies import FixedK, SpecDecPPCost
from specdec.rounds import DraftRow, propose
from specdec.sampling import SamplingParams

HIDDEN = 4
# a llama.cpp target curve (2-core Intel CPU) with a cheap draft (5 ms): pass(k) = 35, 65, 87.5, 110 ms.
CHEAP_DRAFT = CostProfile(t_draft_ms=5.0, t_target_ms={1: 35.0, 2: 65.0, 4: 110.0, 8: 237.0, 16: 305.0})
LLAMA_CPP = CHEAP_DRAFT.model_copy(update={"t_draft_ms": 22.0})  # the measured draft: 22 ms a token
FLAT = CostProfile(t_draft_ms=10.0, t_target_ms={1: 100.0})
# the 2-core AMD EPYC: a drafting step 40.6 ms, a pass over k candidates 61 + 32.5 k, a plain pass 50
AMD = CostProfile(t_draft_ms=40.6, t_target_ms={1: 50.0, 2: 93.5, 21: 711.0})


def replay_round(profile: CostProfile, acceptance: list[float], limit: int) -> tuple[int, int]:
    """One session's step of replay_step -> (K, drafting steps)."""
    return replay_step(profile, [acceptance], [limit])[0]


def test_expected_tokens_and_the_geometric_sum():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert geometric(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert geometric(1.0, 4) == 4.0 and geometric(0.3, 0) == 0.0


def test_the_worked_example():
    """The module docstring: a_1 = 0.95 is kept and drafts on; a_2 = 0.3 is dropped."""
    assert replay_round(CHEAP_DRAFT, [0.95, 0.3, 0.9], 20) == (1, 2)


def test_k_zero_when_even_the_first_candidate_does_not_pay():
    """a_1 = 0.1: 1.1 tokens in 5 + 65 ms against 1 in 5 + 35: dropped. a_1 = 0.8: 1.8 / 70 > 1 / 40,
    kept; another at 0.8 (2.44 / 97.5) or two (2.952 / 125) do worse: the round is y_1."""
    assert replay_round(CHEAP_DRAFT, [0.1, 0.9], 20) == (0, 1)
    assert replay_round(CHEAP_DRAFT, [0.8, 0.8, 0.8], 20) == (1, 1)


def test_stops_where_the_next_candidate_stops_paying():
    """Flat 100 ms verification, 10 ms a draft step, a = 0.9 throughout: E(k) / (10 k + 100) peaks
    at k = 10 (6.862 / 200 = 0.03431; k = 11: 0.03417)."""
    assert replay_round(FLAT, [0.9] * 20, 20) == (10, 10)


def test_one_budget_over_a_steps_sessions_drafts_longer_where_acceptance_is_higher():
    """replay_step: two sessions share a step's budget and its pass. The likely session keeps two
    candidates (alone it keeps three: the other's token makes every pass longer), the unlikely one's
    first is drafted and dropped."""
    assert replay_step(CHEAP_DRAFT, [[0.95] * 20, [0.1] * 20], [20, 20]) == [(2, 3), (0, 1)]
    assert replay_round(CHEAP_DRAFT, [0.95] * 20, 20) == (3, 3)
    assert replay_step(FLAT, [[0.9] * 20, [0.9] * 20], [3, 20])[0] == (3, 3)  # a limit ends its round


def test_free_drafting_on_a_flat_curve_continues_to_the_cap():
    free = CostProfile(t_draft_ms=0.0, t_target_ms={1: 100.0, 16: 100.0})
    assert replay_round(free, [0.3] * 20, 7) == (7, 7)


def test_lookahead_drafts_through_a_first_step_that_alone_does_not_pay():
    """A pass costs 100 ms for 1 token and 101 ms for up to 5; a draft step 30 ms; a = 0.9. One
    candidate: 1.9 / 131 < 1 / 100 ... no: 0.0145 > 0.01, kept; on: four more cost 120 ms for 2.5
    expected tokens, so the budget drafts on although the next step alone (2.71 / 161) pays less
    than stopping would not."""
    curve = CostProfile(t_draft_ms=30.0, t_target_ms={1: 100.0, 2: 101.0, 6: 101.0, 7: 200.0})
    k, _ = replay_round(curve, [0.9] * 20, 20)
    assert k == 5


def test_the_step_prefers_the_pass_sizes_the_kernels_batch_well():
    """llama.cpp's repacked kernels work in 4-row tiles: on the Intel machine a 4-token pass cost less
    than a 3-token one (docs/performance.md). The budget plans with the curve as measured, dip
    included, and the live profile keeps it (exact buckets up to 32 tokens)."""
    measured = {1: 68.0, 2: 100.0, 3: 123.0, 4: 108.0, 5: 141.0, 6: 161.0, 8: 194.0}
    dip = CostProfile(t_draft_ms=21.0, t_target_ms=measured)
    smoothed = CostProfile(t_draft_ms=21.0, t_target_ms=measured | {4: 130.0})
    assert best_allocation(dip, 1, 20, acceptance=0.9).candidates == 3  # a 4-token pass
    assert best_allocation(smoothed, 1, 20, acceptance=0.9).candidates == 4
    live = LiveCosts()
    live.observe(PassTiming("verifier", tokens, ms, probe=True) for tokens, ms in measured.items())
    live.observe([PassTiming("draft", 1, 21.0, probe=True)])
    assert live.profile().t_target_ms == measured


def test_drafting_pays_reads_the_costs_only():
    """issue 32's AMD figures: 2 tokens for 40.6 + 93.5 ms even if y_1 is accepted, against 1 token in
    50 ms, and no longer round or larger batch does better: the draft need not run."""
    assert not drafting_pays(AMD, sessions=1, max_candidates=20)
    assert not drafting_pays(LLAMA_CPP, 1, 20) and drafting_pays(CHEAP_DRAFT, 1, 20)
    assert not drafting_pays(CHEAP_DRAFT, 4, 0) and not drafting_pays(CHEAP_DRAFT, 0, 4)
    # a batch of 4: plain, a pass of 4 tokens. AMD: 158.5 ms, 4 / 158.5 = 0.0252 a ms; every token more
    # costs 32.5 ms and a step 40.6: even 4 sessions x 20 accepted candidates make 84 / 3570 = 0.0235.
    assert not drafting_pays(AMD, 4, 20)
    # the cheap draft's curve flattens past 8 tokens: 4 sessions x 3 candidates, 16 / (15 + 305) = 0.05 >
    # 4 / 110 = 0.036 (though a single candidate each, 8 / 242 = 0.033, would not)
    assert drafting_pays(CHEAP_DRAFT, 4, 20) and not drafting_pays(CHEAP_DRAFT, 4, 1)


def test_the_batch_keeps_the_candidates_that_pay_in_the_shared_pass():
    """Three sessions verify beside each other; a pass costs 28 + 2 ms a token, 5 ms drafted. Gains
    0.9, 0.5, 0.05: stopping makes 3 / 39 = 0.077 a ms; adding the first (3.9 / 41 = 0.095) and the
    second (4.4 / 43 = 0.102) beats it, the third does not (4.45 / 45 = 0.099). On the steeper
    llama.cpp curve only the first pays (3.9 / 115 = 0.034 > 3 / 92.5; 4.4 / 146.75 = 0.030)."""
    linear = CostProfile(t_draft_ms=5.0, t_target_ms={1: 30.0, 16: 60.0})
    assert StepBudget(linear, expected=3.0, tokens=3, spent_ms=5.0).keep([0.05, 0.9, 0.5]) == [False, True, True]
    assert StepBudget(CHEAP_DRAFT, expected=3.0, tokens=3, spent_ms=5.0).keep([0.05, 0.9, 0.5]) == [False, True, False]
    assert StepBudget(linear, expected=1.0, tokens=1).keep([]) == []


def test_the_batch_drafts_on_with_the_sessions_that_pay():
    """Flat pass, so only the draft step costs: a session likely to be accepted drafts on, one that is
    not stops, one with nothing left stops."""
    budget = StepBudget(FLAT, expected=2.0, tokens=2, spent_ms=10.0)
    assert budget.draft_on(survive=[0.9, 0.02, 0.9], acceptance=[0.9, 0.1, 0.9], left=[5, 5, 0]) == [True, False, False]


# ------------------------------------------------------------------------------------------------
# rounds.propose spends the budget over a batch


def q_head() -> AcceptanceHead:
    """A `hidden+distribution` head whose acceptance is exactly q(y_i): it returns exp(log q(y))."""
    head = AcceptanceHead(HeadConfig(hidden_size=HIDDEN, depth=0, draft_identity="x", features=FEATURES_DISTRIBUTION))
    head.acceptance_probability = lambda inputs: inputs[..., HIDDEN].exp()  # column HIDDEN: log q(y)
    return head.eval()


class ScriptedDraft:
    """A draft whose session s proposes token 0 with q(0) = script[s] at every step (vocabulary 2):
    under `q_head` its candidates' acceptance is script[s]. Counts the rows of every pass."""

    vocab_size, kind, chain_steps = 2, "fake", 0  # steps one at a time (`DraftRole.chain_steps`)

    def __init__(self, script: dict[int, float]):
        self.script, self.passes, self.fed_tokens = script, [], 0

    def _outputs(self, sessions: list[KVSession]) -> DraftOutputs:
        self.passes.append(len(sessions))
        self.fed_tokens += len(sessions)
        return DraftOutputs(torch.log(torch.tensor([[self.script[s.handle], 1 - self.script[s.handle]] for s in sessions])),
                            torch.zeros(len(sessions), HIDDEN))

    def start(self, sessions, histories):
        return self._outputs(sessions)

    def step(self, sessions, tokens):
        return self._outputs(sessions)


def row(session: int, policy, limit: int = 20) -> DraftRow:
    return DraftRow(KVSession(handle=session), [1, 2, 3], policy, limit, 0, SamplingParams(temperature=0.0),
                    torch.Generator().manual_seed(session))


def test_propose_gives_each_session_of_the_batch_its_own_k():
    """On a flat pass with 10 ms draft steps: the session at 0.95 drafts long, the one at 0.6 short,
    and a fixed-K session beside them drafts its K; every step is timed."""
    draft = ScriptedDraft({0: 0.95, 1: 0.6, 2: 0.9})
    timings = []
    proposals = propose(draft, [row(0, SpecDecPPCost(q_head())), row(1, SpecDecPPCost(q_head())), row(2, FixedK(3))],
                        FLAT, timings=timings)
    lengths = [len(p.candidates) for p in proposals]
    assert lengths[0] > lengths[1] >= 1 and lengths[2] == 3
    assert len(timings) == len(draft.passes) and [t.tokens for t in timings] == draft.passes
    assert all(t.role == "draft" and t.ms > 0 for t in timings)


def test_a_step_that_captured_a_graph_is_not_timed(monkeypatch):
    """On CUDA a pass of a new size captures its graph first (tens of ms of warm-up and capture): a
    step across a capture would price every later step of its size at that, so it goes untimed."""
    from specdec.models import static

    draft = ScriptedDraft({0: 0.9})
    outputs = draft._outputs

    def capturing(sessions):  # the second pass captures
        if len(draft.passes) == 1:
            monkeypatch.setattr(static, "_captured", static.graphs_captured() + 1)
        return outputs(sessions)

    draft._outputs = capturing
    timings = []
    propose(draft, [row(0, FixedK(3))], FLAT, timings=timings)
    assert len(draft.passes) == 3 and len(timings) == 2  # the second step's timing is left out


def test_the_step_decision_turns_the_draft_off_when_no_round_can_pay():
    """At AMD's costs no round pays even if every candidate is accepted: nobody drafts, and while the
    draft is off an off-probe comes every few hundred steps; at FLAT's the sessions in step draft."""
    off = decide_step(AMD, 2, 20, 0.8, 0.92, lags=[1, 1], left=[100, 100], stop_rate=0.0)
    assert not off.pays and off.joins == (False, False) and off.probe_interval > 100
    on = decide_step(FLAT, 2, 20, 0.8, 0.92, lags=[1, 1], left=[100, 100], stop_rate=0.0)
    assert on.pays and on.joins == (True, True)


def test_propose_drafts_nothing_for_a_budgeted_session_without_costs():
    """Nothing priced the step: a budgeted session drafts nothing, a fixed-K one beside it its K."""
    draft = ScriptedDraft({0: 0.99, 1: 0.9})
    proposals = propose(draft, [row(0, SpecDecPPCost(q_head())), row(1, FixedK(2))])
    assert [len(p.candidates) for p in proposals] == [0, 2]
    assert proposals[0].forward_passes == 0 and draft.passes == [1, 1]  # the fixed-K session alone drafts


def test_a_lagging_draft_catches_up_only_when_the_generation_earns_it_back():
    """A draft step 40 ms (16 tokens 400 ms: 24 ms a token more), a target pass 100.6 / 155.8 / 231
    ms for 1 / 2 / 4 tokens. At best (3 candidates, all accepted: the first step feeds 2 tokens, 64
    ms) a token costs (64 + 80 + 231) / 4 = 93.75 ms against 100.6: 6.85 ms saved a token, 877 ms
    over 128 tokens, less than a 40-token prompt's prefill into the draft (976 - 40 ms); over 256
    tokens it pays."""
    barely = CostProfile(t_draft_ms=40.0, t_draft_rows_ms={1: 40.0, 16: 400.0},
                         t_target_ms={1: 100.6, 2: 155.8, 4: 231.0, 8: 565.3})
    assert drafting_pays(barely, 1, 20)
    saving = drafting_saving(barely, 1, 20)
    assert saving == pytest.approx(100.6 - 93.75)
    assert not worth_catching_up(barely, saving, 1, lag=40, remaining=128)
    assert worth_catching_up(barely, saving, 1, lag=40, remaining=256)
    assert worth_catching_up(barely, -1.0, 1, lag=2, remaining=128)  # in step: nothing to pay, the step decides
    assert not worth_catching_up(AMD, drafting_saving(AMD, 1, 20), 1, lag=3, remaining=128)  # nothing pays there


def test_a_catch_up_needs_a_saving_beyond_the_costs_error():
    """3% of a plain token (100.6 ms) would repay a 3-token catch-up many times over in a long
    generation, but it is within what the measured costs and acceptance are known to: no catch-up.
    6% is not."""
    barely = CostProfile(t_draft_ms=40.0, t_target_ms={1: 100.6, 2: 155.8, 4: 255.0, 8: 565.3})
    assert not worth_catching_up(barely, 0.03 * 100.6, 1, lag=3, remaining=10_000)
    assert worth_catching_up(barely, 0.06 * 100.6, 1, lag=3, remaining=10_000)
    assert not worth_catching_up(barely, 0.03 * 100.6 / 4, 4, lag=3, remaining=10_000)  # a token of a 4-session pass


def test_the_saving_at_a_measured_acceptance_is_below_the_bound():
    """The bound (every candidate accepted) decides whether the draft may run at all; a catch-up is
    an investment, judged at the acceptance measured so far. At 0.8 the barely-paying costs above
    save nothing: (59.2 + 155.8) / 1.8 = 119.4 ms a token for one candidate (its first step feeds
    1.8 tokens in expectation), more than plain's 100.6."""
    barely = CostProfile(t_draft_ms=40.0, t_draft_rows_ms={1: 40.0, 16: 400.0},
                         t_target_ms={1: 100.6, 2: 155.8, 4: 255.0, 8: 565.3})
    assert drafting_saving(barely, 1, 20) > 0 >= drafting_saving(barely, 1, 20, acceptance=0.8)
    torch_like = CostProfile(t_draft_ms=56.0, t_target_ms={1: 397.0, 21: 857.0})
    assert drafting_saving(torch_like, 1, 20, acceptance=0.8) > 100.0  # on torch a catch-up pays at once


# The live profile at 8 sessions after plain decoding at 16 (llama.cpp, 2-core AMD EPYC, issue 32's
# concurrency run): a plain step of 8 tokens took 762 ms, one of 16 only 1026.
AFTER_16 = CostProfile(t_draft_ms=44.5, t_draft_rows_ms={1: 44.5, 2: 76.0, 16: 472.0},
                       t_target_ms={1: 107.9, 2: 186.6, 3: 263.7, 4: 339.0, 7: 559.0, 8: 762.1, 9: 826.3,
                                    10: 876.8, 11: 925.6, 12: 994.3, 15: 1149.9, 16: 1026.4})


def test_a_rounds_first_step_feeds_the_last_candidate_too():
    """A round's first drafting step feeds each session's unseen tokens: after a fully accepted
    round, its last candidate and the bonus token. A draft step of 1 row 40 ms, 2 rows 80; a pass of
    1 / 2 / 3 / 4 tokens 100 / 130 / 190 / 260 ms. One candidate, accepted: (80 + 130) / 2 = 105 ms
    a token, not (40 + 130) / 2 = 85; two: (80 + 40 + 190) / 3 = 103; three (80 + 80 + 260) / 4 =
    105: none beats plain decoding's 100."""
    steep = CostProfile(t_draft_ms=40.0, t_draft_rows_ms={1: 40.0, 2: 80.0}, t_target_ms={1: 100.0, 2: 130.0,
                                                                                          3: 190.0, 4: 260.0})
    assert not drafting_pays(steep, 1, 20)
    flat_rows = steep.model_copy(update={"t_draft_rows_ms": {1: 40.0, 2: 40.0}})
    assert drafting_saving(flat_rows, 1, 20) == pytest.approx(100.0 - 85.0)


def test_a_catch_up_is_repaid_by_the_sessions_own_tokens():
    """8 sessions all drafting would save 7 ms a token: each session's own 126 tokens earn 882 ms, a
    fifth of its ~150-token prefill into the draft (~4.2 s): none catches up. Credited with the
    whole batch's saving (7 s), each did, and the 8 prefills (34 s) cost that run 30% against plain
    decoding."""
    lag = 150
    catch_up = AFTER_16.draft_ms(lag) - AFTER_16.draft_ms(1)
    assert 8 * 126 * 7.0 > catch_up > 126 * 7.0
    assert not worth_catching_up(AFTER_16, 7.0, 8, lag=lag, remaining=126)
    assert worth_catching_up(AFTER_16, 7.0, 8, lag=lag, remaining=1000)
    # and at the prior acceptance (0.8), with each round's first step fed its unseen tokens, no
    # allocation saves anything there
    assert best_allocation(AFTER_16, 8, 20, acceptance=0.8).drafters == 0


def test_where_one_drafting_session_pays_one_catches_up():
    """The live profile at 15 sessions after plain decoding at 16 (llama.cpp, AMD): 15 tokens cost
    1150 ms and 16 only 1040, so one session drafting one candidate pays (16.8 tokens in 82 + 1040
    ms against 15 in 1150). With a generation long enough to repay a prefill, one session catches
    up, the one with the shortest prompt, not all 15 (all 15 did once: 74 s of prefill, 0.70x plain
    decoding); with 126 tokens left none does. Sessions in step draft whatever the allocation (the
    step's budget decides)."""
    jagged = CostProfile(t_draft_ms=50.0, t_draft_rows_ms={1: 50.0, 2: 82.0, 16: 481.0},
                         t_target_ms={1: 108.0, 2: 187.0, 4: 339.0, 8: 762.0, 15: 1150.0, 16: 1040.0})
    best = best_allocation(jagged, 15, 20, acceptance=0.8)
    assert best.drafters == 1
    lags = [150 + s for s in range(15)]
    lags[3] = 120
    assert who_drafts(jagged, best, 15, lags, [2000] * 15) == [s == 3 for s in range(15)]
    assert who_drafts(jagged, best, 15, lags, [126] * 15) == [False] * 15
    assert who_drafts(jagged, best, 15, [2, 1, 150], [2000] * 3) == [True, True, False]  # m = 1 already drafts


def test_a_catch_up_is_repaid_only_by_the_tokens_expected_before_the_generation_stops():
    """16 HumanEval sessions on torch, 128 tokens allowed: 13 of them stopped at EOS, after 1225
    tokens in all (77 a request). At that stop rate a session with 126 tokens left is expected to
    generate ~70 more: a catch-up that 126 tokens would repay by a third more than it costs is not
    repaid by 70."""
    assert expected_remaining(126, 0.0) == 126.0
    assert expected_remaining(1, 0.5) == pytest.approx(1.0)
    assert expected_remaining(126, 13 / 1225) == pytest.approx(70.0, abs=1.0)
    lag = 120
    catch_up = AFTER_16.draft_ms(lag) - AFTER_16.draft_ms(1)
    saving = 1.3 * catch_up / 126  # ms a token; above the catch-up margin on this profile
    assert worth_catching_up(AFTER_16, saving, 8, lag=lag, remaining=expected_remaining(126, 0.0))
    assert not worth_catching_up(AFTER_16, saving, 8, lag=lag, remaining=expected_remaining(126, 13 / 1225))


def test_the_hopeful_acceptance_narrows_to_the_measured_rate():
    """One standard deviation of the Beta posterior above the rate: 0.92 at the prior alone (8
    accepted of 10), 0.813 once 1000 trials measured 0.8, never above 1."""
    assert hopeful_acceptance(8.0, 10.0) == pytest.approx(0.92, abs=0.005)
    assert hopeful_acceptance(800.0, 1000.0) == pytest.approx(0.8126, abs=0.001)
    assert hopeful_acceptance(94.0, 100.0) > 0.94 and hopeful_acceptance(10.0, 10.0) == 1.0


def test_a_pass_past_the_measured_curve_is_probed_at_the_next_power_of_two():
    curve = CostProfile(t_draft_ms=5.0, t_target_ms={1: 50.0, 2: 90.0, 4: 100.0, 8: 120.0})
    assert curve_probe(curve, 8) is None and curve_probe(curve, 9) == 16 and curve_probe(curve, 200) == 16
    assert curve_probe(CostProfile(t_draft_ms=5.0, t_target_ms={1: 50.0, 9: 130.0}), 10) == 16
    assert curve_probe(CostProfile(t_draft_ms=5.0, t_target_ms={1: 50.0, 16: 150.0}), 17) == 32


# llama.cpp on the faster AMD machine, 8 HumanEval sessions (target-only then fixed:1, one process):
# plain steps of 4 and 8 sessions took 98 and 222 ms, fixed:1's verification of 16 tokens at 8
# sessions 259 (its 8 tokens at 4 sessions 230: the extra tokens cost little only in a full batch).
LLAMACPP_AT_8 = CostProfile(t_draft_ms=13.0, t_draft_rows_ms={1: 13.0, 2: 21.6, 4: 32.7, 8: 54.3, 16: 111.0,
                                                              583: 1850.0},  # the prompts' catch-up
                            t_target_ms={1: 33.0, 2: 66.0, 4: 98.0, 5: 125.0, 8: 222.0, 16: 259.0})
# torch on the same machine (budget-trace-torch-c8-faithful-probes.log): a smaller batch saves more.
TORCH_AT_8 = CostProfile(t_draft_ms=32.0, t_draft_rows_ms={1: 32.0, 2: 34.5, 16: 70.6},
                         t_target_ms={1: 200.0, 2: 285.0, 4: 326.0, 8: 403.0, 16: 511.0})


def test_a_batch_drains_as_its_sessions_stop():
    assert draining_batch(8, 126, 0.0) == 8  # nobody is expected to stop: the batch stays
    assert draining_batch(8, 126, 13 / 1225) == 5  # HumanEval's stop rate: ~70 of 126 tokens each
    assert draining_batch(1, 126, 0.5) == 1 and draining_batch(8, 0, 0.1) == 8


def test_a_catch_up_is_judged_by_what_drafting_saves_as_the_batch_drains():
    """llama.cpp: drafting saves 21% of a token's time at 8 sessions, under 4% at 5; where sessions stop
    (HumanEval's rate), a catch-up is judged by the drained batch's saving, under the catch-up margin,
    so none happens. With no stops it is judged at 8 as before, and on torch, where 5 sessions save
    more than 8, nothing changes."""
    best, at_5 = best_allocation(LLAMACPP_AT_8, 8, 20, 0.97), best_allocation(LLAMACPP_AT_8, 5, 20, 0.97)
    assert best.saving > 0.2 * best.plain_ms and at_5.saving < 0.04 * at_5.plain_ms
    assert draining_allocation(LLAMACPP_AT_8, best, 8, 20, 0.97, 126, 0.0) == best
    judged = draining_allocation(LLAMACPP_AT_8, best, 8, 20, 0.97, 126, 13 / 1225)
    assert judged.saving == pytest.approx(at_5.saving) and judged.drafters == best.drafters
    assert who_drafts(LLAMACPP_AT_8, best, 8, [130] * 8, [126.0] * 8) != [False] * 8
    assert who_drafts(LLAMACPP_AT_8, judged, 8, [130] * 8, [70.0] * 8) == [False] * 8
    torch_best = best_allocation(TORCH_AT_8, 8, 20, 0.95)
    assert draining_allocation(TORCH_AT_8, torch_best, 8, 20, 0.95, 126, 13 / 1225) == torch_best


# ------------------------------------------------------------------------------------------------
# Drafting the next round while the step verifies

# The H200's captured passes (docs/results/gpu/2026-12-04-h200-b): the 0.5B's step, 1.5B and 7B passes.
H200_1_5B = CostProfile(t_draft_ms=3.0, t_target_ms={1: 4.1, 2: 4.15, 4: 4.3, 8: 4.6})
H200_7B = CostProfile(t_draft_ms=3.0, t_target_ms={1: 7.3, 2: 7.35, 4: 7.5, 8: 7.9})


def test_drafting_ahead_pays_where_verifying_outlasts_it_and_the_two_run_at_once():
    # 7B: a round of k = 1 drafts ahead 2 steps (6 ms) inside a 7.3 ms pass; a hit (0.8^2) saves the next step's 3 ms
    assert overlap_saving(H200_7B, [1], 0.8, 2, (1.0, 1.0)) == pytest.approx(0.64 * 3.0 - 0.0, abs=0.05)
    # k = 3 drafts ahead 12 ms, 4.5 more than the pass: the saving (0.41 of 9 ms) does not cover it
    assert overlap_saving(H200_7B, [3], 0.8, 4, (1.0, 1.0)) < 0
    # in process the calls run one after the other: the phase's wall is their sum, never a saving
    serial = (7.35 + 6.0) / 7.35
    assert overlap_saving(H200_7B, [1], 0.8, 2, (1.0, serial)) < 0
    # the 1.5B's pass barely outlasts one draft step: k = 1 saves 0.1 ms in expectation, k = 2 costs
    assert overlap_saving(H200_1_5B, [1], 0.8, 2, (1.0, 1.0)) < 0.5
    assert overlap_saving(H200_1_5B, [2], 0.8, 3, (1.0, 1.0)) < 0


def test_drafting_ahead_for_many_sessions_saves_only_where_every_one_hits():
    """The next step's draft call is saved only where no session missed; the ones that missed draft as usual."""
    one, eight = overlap_saving(H200_7B, [1], 0.8, 2, (1.0, 1.0)), overlap_saving(H200_7B, [1] * 8, 0.8, 16, (1.0, 1.0))
    assert eight < one
