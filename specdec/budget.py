"""One verification budget per step for the whole batch (vLLM's adaptive verification and SmartSpec
decide the same way): who drafts, who drafts on, and which drafted candidates are verified, from the
expected accepted tokens against the measured cost of the step and of the tokens added to the pass.
Pure functions: the step planner (specdec/planner.py) keeps the state they read, and
docs/planner.md tells why each rule is what it is, with the runs that showed it.

A step advances sessions s = 1..B. With a_{s,j} the estimated P(y_j accepted | y_<j accepted) of
session s's candidates (the head's calibrated a_j: policies/specdec_pp_cost.py) and
P_{s,j} = a_{s,1} ... a_{s,j}, a round of k_s candidates commits in expectation

    E_s = 1 + P_{s,1} + ... + P_{s,k_s}          (the accepted prefix plus the correction/bonus token)

and the step takes T = sum over drafting steps of t_draft(rows) + t_target(N), N = sum_s (k_s + 1)
tokens in the verification pass (specdec/cost_profile.py: both curves measured where the loop runs).
A round's first drafting step feeds each session the tokens its draft has not seen: the correction
token, and after a fully accepted round the last candidate too, so m sessions feed m (1 + P_k) rows
in expectation (at k = 1 and every candidate accepted, twice a later step's).
The budget maximises the step's rate R = (sum_s E_s) / T, K = 0 included for one session and for
all:

- `decide_step`: before the step, once (the planner's one call). If no allocation (m sessions
  drafting k candidates each, every one accepted) beats plain decoding's B / t_target(B), the draft
  does not run at all; and a session whose draft cache lags (its prompt, or tokens decoded without
  the draft) drafts only if the best allocation at the upper end of the acceptance measured so far
  (`hopeful_acceptance`) saves at least CATCH_UP_MARGIN of a plain token's time and what that
  saves over its own remaining tokens repays the catch-up pass (`worth_catching_up`), and only as
  many catch up as the allocation has drafting sessions (`who_drafts`).
- `keep`: after drafting step i, for the sessions that drafted y_i. Its draft pass is spent either
  way; session s gains g_s = P_{s,i-1} a_s for one token more in the pass. The top m by gain are
  kept, m maximising (E + g_1 + ... + g_m) / (T + t_target(N + m) - t_target(N)). Losslessness
  (policies/base.py): a_s here must not read which token a sampled y_i is (`Estimate.blind`).
- `draft_on`: the sessions that kept y_i, ranked by g_s = P_{s,i} a_s with a_s now a(y_i) and the
  unknown a_{s,i+1..} estimated by it (acceptance runs in streaks). For m sessions and d more steps
  the gain is sum_s P_{s,i} (a_s + ... + a_s^d) at d t_draft(m) + t_target(N + m d) - t_target(N);
  the top m draft on if the best (m, d) beats stopping now.

- `overlap_saving`: after the step's Propose, whether its drafting sessions draft their next round
  while the target verifies this one (PEARL's post-verify, loop.py): the ahead round drafts a guess
  of the bonus token and the next candidates after this round's k, and is used only where all k
  are accepted and the guess is the target's token (P = a^(k+1)), when the next step drafts none
  of those sessions. Verifying and drafting ahead run at once where the draft has a device (or
  process) of its own: the phase costs the larger of the two, times a factor the planner measures
  (contention, and in process, where the calls run one after the other, their sum).

The draft time already spent stays in T on both sides of every comparison: the rate is the step's.
Sessions whose policy is not budgeted (fixed K, SVIP, ...) add their tokens and their rows to the
passes and count one committed token each.

Worked example (one session; t_draft = 5 ms; pass(1..4) = 35, 65, 87.5, 110 ms): y_1 drafted with
a = 0.95: keep, (1 + 0.95) / (5 + 65) = 0.0279 > 1 / (5 + 35) = 0.025; draft on? d = 1:
(1.95 + 0.9025) / (10 + 87.5) = 0.0293 > 0.0279: yes. y_2 with blind a = 0.3: keep it?
(1.95 + 0.285) / (10 + 87.5) = 0.0229 < 1.95 / (10 + 65) = 0.026: no, the round is y_1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import statistics
from dataclasses import dataclass

import numpy as np

from specdec.cost_profile import CostProfile
from specdec.policies.specdec_pp_cost import SpecDecPPCost

MAX_CANDIDATES = SpecDecPPCost.DEFAULT_MAX_K  # a budgeted round's cap where the request gives no --k

# P(a candidate is accepted | the ones before were) before any is verified, and its weight in
# candidates: the planner's estimate starts here and follows the rounds' outcomes.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.8, 10.0
# While the draft is off, one off-probe of its cost may take this share of the plain steps (probe_interval).
PROBE_SHARE = 0.005
# A curve probe (a target pass longer than the live curve reaches) may take this share of the steps
# since the last one (planner.py). Each size is probed once, so this bounds a handful of passes.
CURVE_PROBE_SHARE = 0.1
# Most tokens a session decodes without its draft after drafting rounds that verified nothing (rest_after).
MAX_REST = 32
# Per finished sample: the planner's estimate of how often a token ends a generation follows the last
# ~50 requests' samples (expected_remaining); before any finishes, none is assumed to stop early.
STOP_RATE_DECAY = 0.98
# A lagging draft catches up only for a saving above this share of a plain token's time (worth_catching_up).
CATCH_UP_MARGIN = 0.05
# A draft that ran last round lags by at most this: its last candidate and the bonus token (or the
# correction token), which the round's first step feeds (best_allocation prices it): no catch-up.
IN_STEP_LAG = 2


def expected_tokens(acceptance: list[float]) -> float:
    """E(k) = 1 + sum_j prod_{l <= j} a_l for a round whose candidates have acceptance [a_1..a_k]."""
    total, survive = 1.0, 1.0
    for a in acceptance:
        survive *= a
        total += survive
    return total


def geometric(a, depth):
    """a + a^2 + ... + a^depth: the expected accepted tokens of `depth` more candidates at a each
    (numbers, or arrays that broadcast)."""
    a, depth = np.asarray(a, dtype=float), np.asarray(depth, dtype=float)
    whole = a >= 1.0
    y = np.where(whole, depth, a * (1.0 - a ** depth) / np.where(whole, 1.0, 1.0 - a))
    return y if y.ndim else float(y)


@dataclass(frozen=True)
class Allocation:
    """The best steady step of a batch: m sessions draft k candidates each (m = 0: plain decoding)."""

    token_ms: float  # time per generated token
    drafters: int  # m
    candidates: int  # k
    plain_ms: float  # plain decoding's time per token, pass(B) / B

    @property
    def saving(self) -> float:
        """ms a token this allocation saves against plain decoding (0 for plain decoding itself)."""
        return self.plain_ms - self.token_ms


def best_allocation(profile: CostProfile, sessions: int, max_candidates: int, acceptance: float = 1.0) -> Allocation:
    """The least time per generated token of a step of B = `sessions` sessions: plain decoding's
    pass(B) / B, or a step in which m of them draft k candidates each, each accepted with
    probability a = `acceptance` given the ones before:
    (t_draft(m (1 + a^k)) + (k - 1) t_draft(m) + pass(B + m k)) / (B + m (a + ... + a^k))."""
    return best_allocations(profile, sessions, max_candidates, (acceptance,))[0]


def best_allocations(profile: CostProfile, sessions: int, max_candidates: int,
                     acceptances: Sequence[float]) -> list[Allocation]:
    """`best_allocation` at each of `acceptances`, every (a, m, k) priced in one grid (`decide_step`
    asks at the bound, at the upper end of the measured acceptance and at it)."""
    plain = profile.pass_ms(sessions) / sessions
    if sessions < 1 or max_candidates < 1:
        return [Allocation(plain, 0, 0, plain) for _ in acceptances]
    a = np.asarray(acceptances, dtype=float)[:, None, None]  # [A, 1, 1]
    m = np.arange(1, sessions + 1, dtype=float)[None, :, None]  # [1, M, 1] sessions drafting
    k = np.arange(1, max_candidates + 1, dtype=float)[None, None, :]  # [1, 1, K] candidates each
    draft = profile.draft_ms(m * (1 + a ** k)) + (k - 1) * profile.draft_ms(m)  # [A, M, K]
    token_ms = ((draft + profile.pass_ms(sessions + m * k)) / (sessions + m * geometric(a, k))).reshape(len(a), -1)
    best = token_ms.argmin(axis=1)  # [A]: the first of equals, fewest sessions first
    return [Allocation(float(token_ms[i, j]), int(j) // max_candidates + 1, int(j) % max_candidates + 1, plain)
            if token_ms[i, j] < plain else Allocation(plain, 0, 0, plain) for i, j in enumerate(best)]


def drafting_saving(profile: CostProfile, sessions: int, max_candidates: int, acceptance: float = 1.0) -> float:
    """The most ms per generated token drafting can save against plain decoding at `acceptance`
    (1: every candidate accepted, the bound); <= 0: no step in which m of `sessions` sessions draft
    k candidates each beats plain decoding of all of them."""
    if sessions < 1 or max_candidates < 1:
        return 0.0
    return best_allocation(profile, sessions, max_candidates, acceptance).saving


def drafting_pays(profile: CostProfile, sessions: int, max_candidates: int) -> bool:
    return drafting_saving(profile, sessions, max_candidates) > 0


def worth_catching_up(profile: CostProfile, saving: float, sessions: int, lag: int, remaining: float) -> bool:
    """Whether a session whose draft cache lags `lag` committed tokens (its prompt, at its first
    round; the tokens decoded while it did not draft) should draft: the catch-up pass costs
    t_draft(lag) - t_draft(1) once, and drafting saves `saving` (at `hopeful_acceptance`, not the
    all-accepted bound: this is an investment) a token. Only the session's own `remaining` tokens
    are credited: the batch around it changes while it repays. A saving under CATCH_UP_MARGIN of a
    plain token's time is within what the costs and the acceptance are known to, while the prefill
    is spent for sure: no catch-up for it (docs/planner.md, "Catching up"). A draft in step
    (lag <= IN_STEP_LAG) has nothing to catch up: the step's budget decides."""
    if lag <= IN_STEP_LAG:
        return True
    if saving <= CATCH_UP_MARGIN * profile.pass_ms(sessions) / sessions:
        return False
    return remaining * saving > profile.draft_ms(lag) - profile.draft_ms(1)


def hopeful_acceptance(accepted: float, trials: float) -> float:
    """The acceptance a catch-up is judged at (`who_drafts`): one standard deviation above the
    measured rate `accepted` / `trials` (accept-or-reject events of verified candidates, the prior's
    included), as a Beta posterior spreads it: 0.92 at the prior alone (0.8 of 10), within ~0.01 of
    the rate after a few hundred. The measured rate moves only while sessions draft, so judged at it
    alone a low prior could keep every session from ever drafting; optimism under uncertainty, as a
    bandit's upper confidence bound, lets the few that catch up measure it (docs/planner.md)."""
    rate = accepted / trials
    return min(1.0, rate + math.sqrt(rate * (1.0 - rate) / (trials + 1.0)))


def expected_remaining(left: int, stop_rate: float) -> float:
    """Tokens a session is expected to still generate when at most `left` more are allowed and each
    ends the generation (EOS, a stop string) with probability `stop_rate`: sum_{t < left} (1 - h)^t.
    A catch-up is repaid only by the tokens that follow it (`worth_catching_up`): crediting `left`
    where requests stop early overpays it."""
    if stop_rate <= 0.0:
        return float(left)
    return (1.0 - (1.0 - min(stop_rate, 1.0)) ** left) / stop_rate


def draining_batch(sessions: int, left: int, stop_rate: float) -> int:
    """The batch a session's next `left` tokens share on average where no session joins: each of the
    other sessions - 1 is still running t tokens on with probability (1 - h)^t, h = `stop_rate`, so
    1 + (sessions - 1) expected_remaining(left, h) / left (rounded)."""
    if sessions <= 1 or left <= 0:
        return sessions
    return max(1, round(1 + (sessions - 1) * expected_remaining(left, stop_rate) / left))


def draining_allocation(profile: CostProfile, best: Allocation, sessions: int, max_candidates: int,
                        acceptance: float, left: int, stop_rate: float) -> Allocation:
    """The allocation a catch-up is judged by (`who_drafts`): `best`, the best at `sessions`, with its
    saving cut to what the draining batch's best saves (`draining_batch`) where that is less. A
    catch-up is repaid over the session's remaining tokens, and those share steps with fewer sessions
    as the others finish unless new ones join; where drafting pays only in a full batch, it must pay
    in both (docs/planner.md, "Catching up")."""
    draining = draining_batch(sessions, left, stop_rate)
    if not best.drafters or draining >= sessions:
        return best
    saving = min(best.saving, max(best_allocation(profile, draining, max_candidates, acceptance).saving, 0.0))
    return Allocation(best.plain_ms - saving, best.drafters, best.candidates, best.plain_ms)


def curve_probe(profile: CostProfile, wanted: int) -> int | None:
    """The target pass to time next when the step's budget weighs passes of up to `wanted` tokens
    and the measured curve stops short of that: the next power of two past the curve's last point
    (None: the curve reaches `wanted`). Past its last point the curve is extrapolated at its steepest
    mean slope (cost_profile.Curve), which on a CPU overprices long passes; doubling reaches any size
    in a few probes, each interpolated from measured points only (docs/planner.md, "Curve probes")."""
    last = max(profile.t_target_ms)
    return 1 << last.bit_length() if wanted > last else None


def rest_after(empty_rounds: int) -> int:
    """Tokens a session decodes without its draft after `empty_rounds` drafting rounds in a row that
    verified nothing: 1, 2, 4, ... up to MAX_REST. A drafting step learns y_1's estimate only by
    drafting it; where the step's budget then drops y_1 the pass was spent for nothing, and on text
    the draft does not predict the next ones mostly would be too. Backing off bounds that loss to
    about log2 of the generation's length in passes, while a stretch the draft does predict is found
    again within MAX_REST tokens (docs/planner.md, "Rests"). The one backoff of the system: no
    policy keeps another."""
    return min(2 ** (empty_rounds - 1), MAX_REST)


def who_drafts(profile: CostProfile, best: Allocation, sessions: int, lags: list[int],
               remaining: list[float]) -> list[bool]:
    """Which budgeted sessions of a step of `sessions` call the draft, given how far each one's draft
    lags (`lags`) and the tokens it is expected to still generate (`expected_remaining`): those in
    step (lag <= IN_STEP_LAG) all (the step's budget decides their rounds); lagging ones, the
    shortest catch-up first, while fewer than the best allocation's m draft and the saving over its
    own remaining tokens repays its catch-up (`worth_catching_up`). Where one drafting session is
    what pays, one catches up, not all."""
    joins = [lag <= IN_STEP_LAG for lag in lags]
    drafters = sum(joins)
    for s in sorted((s for s, lag in enumerate(lags) if lag > IN_STEP_LAG), key=lambda s: lags[s]):
        if drafters < best.drafters and worth_catching_up(profile, best.saving, sessions, lags[s], remaining[s]):
            joins[s], drafters = True, drafters + 1
    return joins


def probe_interval(profile: CostProfile, sessions: int, share: float = PROBE_SHARE) -> int:
    """Steps between off-probes while the draft is off: an off-probe (a draft step of the step's size
    and a target pass one token longer) costs `share` of the plain steps in between."""
    probe_ms = profile.draft_ms(sessions) + profile.pass_ms(sessions + 1)
    return max(1, math.ceil(probe_ms / (share * profile.pass_ms(sessions))))


@dataclass(frozen=True)
class StepDecision:
    """What one priced step decides (`decide_step`)."""

    pays: bool  # some allocation beats plain decoding if every candidate is accepted: the draft is on
    joins: tuple[bool, ...]  # per session ready to draft: it calls the draft this step
    curve_probe: int | None  # a target pass to time first: the decision weighed passes past the measured curve
    probe_interval: int = 0  # steps between off-probes while the draft is off (0: the draft is on)


def decide_step(profile: CostProfile, sessions: int, cap: int, acceptance: float, upper: float,
                lags: Sequence[int], left: Sequence[int], stop_rate: float,
                probe_share: float = PROBE_SHARE) -> StepDecision:
    """Who of a step's budgeted sessions ready to draft calls the draft: B = `sessions` in the step,
    at most `cap` candidates a round; `acceptance` measured, `upper` its hopeful end (a catch-up is
    an investment: `hopeful_acceptance`); per ready session its draft's lag and the tokens it may
    still generate; `stop_rate` how often a token ends a generation.

    Nothing drafts where no allocation pays even if every candidate is accepted. Otherwise sessions
    in step draft and lagging ones catch up where that repays (`who_drafts`), judged at `upper` by
    the batch as it drains where one lags. The curve probe is the pass the decision weighed past the
    measured curve: what the sessions will draft at `acceptance` (at `upper` where none would), or
    where none drafts a first candidate's B + 1 tokens."""
    bound, hopeful, likely = best_allocations(profile, sessions, cap, (1.0, upper, acceptance))
    if bound.saving <= 0:
        return StepDecision(False, (False,) * len(lags), curve_probe(profile, sessions + 1),
                            probe_interval(profile, sessions, probe_share))
    likely = likely if hopeful.drafters else hopeful
    judged = hopeful if all(lag <= IN_STEP_LAG for lag in lags) else draining_allocation(
        profile, hopeful, sessions, cap, upper, statistics.median_low(left), stop_rate)
    joins = who_drafts(profile, judged, sessions, list(lags), [expected_remaining(n, stop_rate) for n in left])
    wanted = max(likely.drafters * likely.candidates, 1) if any(joins) else 1
    return StepDecision(True, tuple(joins), curve_probe(profile, sessions + wanted))


def overlap_saving(profile: CostProfile, rounds: Sequence[int], acceptance: float, verify_tokens: int,
                   factors: tuple[float, float]) -> float:
    """Expected ms a step saves by drafting `rounds` (each session's k) ahead while it verifies a
    pass of `verify_tokens` tokens; negative where it costs. `factors`: the measured wall of the
    verify phase over its priced time, plain and overlapped (priced at the larger of verifying and
    drafting ahead). The ahead round drafts k + 1 steps on average (the bonus's guess first); the
    next step's drafting, k steps of every session, shrinks to the sessions that missed."""
    sessions = len(rounds)
    k = sum(rounds) / sessions
    hits = [acceptance ** (r + 1) for r in rounds]
    verify_ms, step_ms = profile.pass_ms(verify_tokens), profile.draft_ms(sessions)
    misses = sessions - sum(hits)
    # the next step drafts unless every session hit; then for about `misses` sessions
    next_ms = (1.0 - math.prod(hits)) * k * profile.draft_ms(max(misses, 1.0))
    plain, overlapped = factors
    return k * step_ms - next_ms - (overlapped * max(verify_ms, (k + 1) * step_ms) - plain * verify_ms)


def replay_step(profile: CostProfile, acceptance: list[list[float]], limits: list[int]) -> list[tuple[int, int]]:
    """A step's rounds for several sessions as rounds.propose spends the step's one budget (every
    session budgeted), each session's acceptance given in advance -> per session (K, the drafting
    steps it took part in)."""
    sessions = len(acceptance)
    budget = StepBudget(profile, expected=float(sessions), tokens=sessions)
    survive, rounds = [1.0] * sessions, [(0, 0)] * sessions
    active = [s for s in range(sessions) if min(limits[s], len(acceptance[s])) > 0]
    i = 0
    while active:
        i += 1
        budget.spent_ms += profile.draft_ms(len(active))
        gains = [survive[s] * acceptance[s][i - 1] for s in active]
        kept = [s for s, keep in zip(active, budget.keep(gains)) if keep]
        for s in active:
            rounds[s] = (i - 1, i)  # y_i drafted; dropped unless kept
        for s in kept:
            survive[s] *= acceptance[s][i - 1]
            budget.add(survive[s])
            rounds[s] = (i, i)
        left = [min(limits[s], len(acceptance[s])) - i for s in kept]
        on = budget.draft_on([survive[s] for s in kept], [acceptance[s][i - 1] for s in kept], left)
        active = [s for s, go in zip(kept, on) if go]
    return rounds


@dataclass
class StepBudget:
    """A step's running totals while its sessions draft: the expected tokens E, the tokens N of the
    verification pass, and the draft time spent (all from `profile`)."""

    profile: CostProfile
    expected: float  # E: sum over the step's sessions of their round's expected tokens so far
    tokens: int  # N: tokens the verification pass will feed so far
    spent_ms: float = 0.0  # drafting steps so far

    def rate(self, gain=0.0, tokens=0, draft_ms=0.0):
        """R with `gain` expected tokens, `tokens` pass tokens and `draft_ms` more (numbers, or
        arrays that broadcast)."""
        return (self.expected + gain) / (self.spent_ms + draft_ms + self.profile.pass_ms(self.tokens + tokens))

    def add(self, survive: float) -> None:
        """A kept candidate joins the pass; `survive` is its session's P_i with it."""
        self.expected += survive
        self.tokens += 1

    def step_ms(self, rows: int, beside: int = 0) -> float:
        """What `rows` sessions add to a drafting step that `beside` other sessions take part in."""
        return self.profile.draft_ms(rows + beside) - self.profile.draft_ms(beside)

    def keep(self, gains: list[float]) -> list[bool]:
        """Which of the just-drafted candidates (blind gains P_{s,i-1} a_s) join the pass: the top m
        by gain, m = 0 .. M at once."""
        order = sorted(range(len(gains)), key=lambda s: -gains[s])
        if not order:
            return []
        m = np.arange(1, len(order) + 1)  # [M]
        rates = self.rate(np.cumsum([gains[s] for s in order]), m)  # [M]
        best_m = int(np.argmax(rates)) + 1 if rates.max() > self.rate() else 0
        kept = set(order[:best_m])
        return [s in kept for s in range(len(gains))]

    def draft_on(self, survive: list[float], acceptance: list[float], left: list[int], beside: int = 0) -> list[bool]:
        """Which sessions take another drafting step: survive P_{s,i}, acceptance a_s, left: candidates
        each may still draft; `beside`: rows of other policies in the next step. Every (d, m) at once."""
        order = sorted((s for s in range(len(survive)) if left[s] > 0), key=lambda s: -survive[s] * acceptance[s])
        if not order:
            return [False] * len(survive)
        p, a, most = (np.array([v[s] for s in order], dtype=float) for v in (survive, acceptance, left))  # [M]
        d = np.arange(1, int(most.max()) + 1, dtype=float)[:, None]  # [D, 1] more drafting steps
        steps = np.minimum(d, most[None, :])  # [D, M] candidates each session adds
        gain = np.cumsum(p * geometric(a, steps), axis=1)  # [D, M]: the top m sessions' expected tokens
        tokens = np.cumsum(steps, axis=1)  # [D, M]
        m = np.arange(1, len(order) + 1)  # [M]
        rates = self.rate(gain, tokens, d * self.step_ms(m, beside))  # [D, M]
        best = np.unravel_index(np.argmax(rates), rates.shape)  # the first of equals: fewest steps, then sessions
        best_m = int(best[1]) + 1 if rates[best] > self.rate() else 0
        chosen = set(order[:best_m])
        return [s in chosen for s in range(len(survive))]
