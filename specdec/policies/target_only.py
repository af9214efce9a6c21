from __future__ import annotations

from specdec.policies.base import Decision, DraftStep, PolicyTraits, StoppingPolicy


class TargetOnly(StoppingPolicy):
    """No speculation: every round verifies zero candidates, so the target decodes token by token.
    The baseline the speedups are measured against."""

    name = "target-only"
    traits = PolicyTraits(uses_draft=False)
    max_candidates = 0

    def decide(self, step: DraftStep) -> Decision:  # never asked: the draft does not run
        return Decision.STOP
