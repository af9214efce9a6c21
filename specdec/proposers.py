"""Proposers: what drafts a step's rounds, one class per kind of draft, each with one `propose`.

A draft worker (specdec/workers.py) keeps its sessions and answers the round protocol; its proposer
takes each session's inputs (`take_inputs`) and turns the batch's rows into proposals (`propose`).
Who calls the draft this step and with what costs was decided by the step planner
(specdec/planner.py, carried in the `StepPlan`); how long a round drafts, by its stopping policy
or, for a budgeted policy, by the step's budget (rounds.py `still_drafting`, specdec/budget.py).

- `ModelProposer`: a draft model on any runtime (torch, CUDA, llama.cpp): `rounds.propose` drives
  its passes, in groups that fit its cache.
- `FeatureProposer`: a feature draft (models/feature_runtime.py): the target's states first (from
  the item, served; from the verifier in process, workers.py `FeatureLink`), then drafted as a
  model, each session only once its states reach its history's end.
"""

from __future__ import annotations

from typing import Protocol

from specdec.cost_profile import PassTiming
from specdec.errors import InvalidRequestError
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.runtime import DraftRole, KVSession
from specdec.protocol import Proposal, ProposeItem, StepPlan
from specdec.rounds import DraftRow, LogitsFilterFactory, in_groups, propose


class ModelProposer:
    """A draft model's rounds: `rounds.propose` over its passes."""

    def __init__(self, draft: DraftRole, logits_filter: LogitsFilterFactory | None = None):
        self.draft, self.logits_filter = draft, logits_filter

    def take_inputs(self, kv: KVSession, item: ProposeItem, history: list[int]) -> bool:
        """What the item brings besides its history into the session's cache `kv`; whether the
        session can draft after `history` now."""
        if item.features is not None:
            raise InvalidRequestError("this draft reads no target features")
        return True

    def propose(self, rows: list[DraftRow], plan: StepPlan, timings: list[PassTiming]) -> list[Proposal]:
        """Every row's round, in groups that fit the draft's cache (`in_groups`), each budgeted beside
        the others as sessions that verify plainly, with the costs the planner priced the step with;
        the drafting steps' times appended to `timings`."""
        return in_groups(rows, self.draft.max_pass_sessions, lambda group: propose(
            self.draft, group, plan.costs, plan.other_sessions + len(rows) - len(group), timings,
            self.logits_filter))


class WaitingStates(Protocol):
    """Where a session's target states wait for its next Propose in process (workers.py `FeatureLink`)."""

    def take(self, session_id: str, draft: FeatureDraftRuntime, kv: KVSession) -> None:
        """What waits for the session into its draft's cache `kv`."""


class FeatureProposer(ModelProposer):
    """A feature draft's rounds: a session drafts once the target's states reach its history's end
    (its first round, the prompt's prefill, computes them; nothing is guessed)."""

    draft: FeatureDraftRuntime

    def __init__(self, draft: FeatureDraftRuntime, logits_filter: LogitsFilterFactory | None = None):
        super().__init__(draft, logits_filter)
        self.link: WaitingStates | None = None  # in process: the states come from the verifier, not in items

    def take_inputs(self, kv: KVSession, item: ProposeItem, history: list[int]) -> bool:
        if self.link is not None:  # what it holds is the target's; what waits joins it
            self.link.take(item.session_id, self.draft, kv)
        elif item.history.full:  # a rebuilt entry: served, the items carry the states again from where they start
            self.draft.clear_features(kv)
        if item.features is not None:
            if not 0 <= item.features_start <= len(history):
                raise InvalidRequestError(f"features start at position {item.features_start}, past the history's "
                                          f"{len(history)} tokens")
            self.draft.add_features(kv, item.features, item.features_start)
        return self.draft.can_draft(kv, history)


def proposer_for(draft: DraftRole, logits_filter: LogitsFilterFactory | None = None) -> ModelProposer:
    """The proposer of this kind of draft."""
    return (FeatureProposer if draft.reads_features else ModelProposer)(draft, logits_filter)
