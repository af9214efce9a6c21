"""The decision of the SpecDec++ MDP: after each drafted token, stop the round or draft another.

The drafting loop (see `specdec.engine`) follows Algorithm 2 of the paper. Step i runs one draft
forward pass over y_{i-1} (over the committed tail when i = 1), which yields the final hidden state
e_{i-1} of y_{i-1} (of the last committed token when i = 1) and the distribution q_i; it samples
y_i ~ q_i and then asks the policy:

    CONTINUE  -> step i + 1
    STOP      -> the round's candidates are y_1..y_i
    DROP_LAST -> the round's candidates are y_1..y_{i-1} (the hindsight oracle, and `specdec++cost`
                 when y_i does not pay; at i = 1 the round verifies no candidate: plain decoding)

Losslessness constrains DROP_LAST: when y_i is drawn from q_i (not greedy), whether y_i enters the
round must not depend on y_i itself. Verification's proof needs the candidate distributed as q_i;
a candidate kept only for some values is distributed as q_i restricted to them, and the output
drifts from the target's (tests/core/test_lossless.py catches it). CONTINUE and STOP may depend on
y_i (the round's length is then a stopping time, as in the paper). Greedy verification is exact
match and its output does not depend on the candidates at all.

A round also stops once `round_limit()` candidates are drafted, without asking.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specdec.errors import InvalidRequestError

PAPER_MAX_CANDIDATES = 20  # the paper stops every round at 20 candidates: the SpecDec++ policies' cap

if TYPE_CHECKING:
    from specdec.head import AcceptanceHead


class Decision(enum.Enum):
    CONTINUE = "continue"
    STOP = "stop"
    DROP_LAST = "drop_last"


@dataclass(frozen=True)
class DraftStep:
    index: int  # i: 1-based index of the candidate just drafted in this round
    token: int  # y_i
    # [V] q_i, the draft distribution y_i was drawn from (plain softmax when greedy); None for a greedy
    # step of a policy that does not read it (`PolicyTraits.reads_distribution`)
    probs: torch.Tensor | None
    prev_hidden: torch.Tensor | None  # [H] e_{i-1}, the draft's final hidden state at y_{i-1}; None when i = 1
    num_generated: int  # tokens generated before this round; y_i would be generated token number num_generated + i
    # [H] the hidden state q_i was computed from: e_{i-1}, and at i = 1 the state at the last committed
    # token (the `hidden+distribution` head reads it; specdec/features.py). None where not known.
    hidden: torch.Tensor | None = None
    greedy: bool = False  # y_i is the argmax of q_i (a greedy request), not a draw from it
    # The head's judged acceptance at this step (`specdec_pp.judged_acceptances`: of y_i, or of y_{i-1}
    # for the paper's head), where it was computed ahead: a chain's steps are judged all at once.
    # None: the policy's head judges the step itself.
    judged: float | None = None


@dataclass(frozen=True)
class PolicyTraits:
    """What a policy needs, said once by the policy so that the loop, the request rules and the
    services read it here instead of comparing policy names."""

    uses_draft: bool = True  # False: rounds verify no candidates (target-only decoding)
    needs_head: bool = False  # an acceptance head must be loaded on the draft's side
    greedy_only: bool = False  # defined for temperature 0 only
    needs_reference: bool = False  # reads the target's greedy continuation in advance (the oracle)
    # Its round lengths come from the batch's verification budget (specdec/budget.py): the policy
    # supplies acceptance estimates (`estimate`), the budget decides who drafts on and what is kept.
    budgeted: bool = False
    # Reads the draft's distribution q_i (`DraftStep.probs`) even when greedy.
    reads_distribution: bool = False
    # Stops on q_i itself (its entropy, its top probability): a model-free draft's q is one-hot, on
    # which it would never stop (models/suffix.py).
    stops_on_q: bool = False
    # Reads a request's `threshold` (h, an entropy or a probability level); `k` means something to
    # every policy that drafts (K, the initial K, or the cap per round).
    reads_threshold: bool = False

    @property
    def servable(self) -> bool:
        """Can run on a draft replica: a reference never travels over the wire."""
        return not self.needs_reference


@dataclass(frozen=True)
class Estimate:
    """A budgeted policy's acceptance estimates for the candidate y_i just drafted (budget.py)."""

    blind: float  # P(y_i accepted) not knowing which token y_i is: what the keep decision may read
    known: float  # a(y_i), which the decision to draft on after y_i may read
    previous: float | None = None  # a revised estimate of y_{i-1} (a head that judges one step late)


class StoppingPolicy(ABC):
    """Decides per drafted token whether the round goes on. One instance serves one sequence."""

    name: ClassVar[str]
    traits: ClassVar[PolicyTraits] = PolicyTraits()
    max_candidates: int
    head: AcceptanceHead | None = None  # the acceptance head it reads (`traits.needs_head`)

    @property
    def uses_draft(self) -> bool:
        return self.traits.uses_draft

    def round_limit(self) -> int:
        """Most candidates this round may hold."""
        return self.max_candidates

    @abstractmethod
    def decide(self, step: DraftStep) -> Decision: ...

    def start_round(self) -> None:
        """Called before the first draft step of every round."""

    def end_round(self, num_candidates: int, num_accepted: int) -> None:
        """Called with the verification outcome of every round."""

    def estimate(self, step: DraftStep) -> Estimate:
        """Budgeted policies only: the acceptance estimates of y_i (`decide` is then not asked)."""
        raise NotImplementedError(f"policy {self.name!r} is not budgeted")

    # A drafting step asks every session's policy at once, one call per policy class: a policy
    # with a model (the acceptance head) overrides these to run it once for all of them.

    @classmethod
    def decide_many(cls, policies: list[StoppingPolicy], steps: list[DraftStep]) -> list[Decision]:
        return [policy.decide(step) for policy, step in zip(policies, steps)]

    @classmethod
    def estimate_many(cls, policies: list[StoppingPolicy], steps: list[DraftStep]) -> list[Estimate]:
        return [policy.estimate(step) for policy, step in zip(policies, steps)]


# The rules of a policy's values, one home each: its constructor checks what it is built with (the
# engine as a library builds policies itself) and resolve_policy a request's flags, in the same words.

def check_threshold(value: float) -> float:
    if not 0.0 < value < 1.0:  # (NaN too)
        raise InvalidRequestError(f"threshold must be in (0, 1), got {value}")
    return value


def check_count(name: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise InvalidRequestError(f"{name} must be at least {minimum}, got {value}")
    return value
