"""Stopping policies: one small class each, all driven by the same drafting loop."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidRequestError
from specdec.head import AcceptanceHead
from specdec.policies.base import (Decision, DraftStep, Estimate, PolicyTraits, StoppingPolicy, check_count,
                                   check_threshold)
from specdec.policies.confidence import Confidence
from specdec.policies.fixed import FixedK
from specdec.policies.heuristic import Heuristic
from specdec.policies.oracle import Oracle
from specdec.policies.specdec_pp import SpecDecPP
from specdec.policies.specdec_pp_cost import SpecDecPPCost
from specdec.policies.svip import SVIP
from specdec.policies.target_only import TargetOnly

POLICIES: dict[str, type[StoppingPolicy]] = {policy.name: policy for policy in (
    SpecDecPP, SpecDecPPCost, FixedK, SVIP, Heuristic, Confidence, Oracle, TargetOnly)}
POLICY_NAMES = tuple(POLICIES)
HEAD_POLICIES = tuple(name for name, policy in POLICIES.items() if policy.traits.needs_head)

# A request that names no policy gets the cost-aware SpecDec++ when the engine has an acceptance head
# (the default pair ships one: specdec/heads/), else SVIP, the best policy that needs no training.
# The cost rule stops where another candidate no longer pays for its draft step and its share of the
# verification, so it falls back to plain decoding where drafting does not pay; on validation prompts
# it measured best on both runtimes (docs/benchmarks.md, "On llama.cpp"; docs/training.md,
# "The shipped head").
DEFAULT_POLICY, FALLBACK_POLICY = "specdec++cost", "svip"


class PolicyConfig(BaseModel):
    """The policy flags of a request. `k` is K for `fixed`, the initial K for `heuristic` and the
    cap on candidates per round for the adaptive policies; `threshold` is h for `specdec++`, the
    entropy threshold for `svip` and the probability threshold for `confidence`. No `name`: the
    default, resolved by `resolve_policy` where the engine's head is known. A value the policy does
    not read is refused there: `specdec++cost` reads no threshold (it stops by the cost profile,
    specdec/cost_profile.py), nor do `fixed` and `heuristic`; `target-only` reads no k."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, min_length=1)
    # strict: a bool is no number (lax mode read JSON's true as K = 1); an int is still a float
    k: int | None = Field(None, strict=True)
    threshold: float | None = Field(None, strict=True)


def policy_traits(name: str) -> PolicyTraits:
    """What the named policy needs (policies/base.py); raises InvalidRequestError for an unknown name."""
    if name not in POLICIES:
        raise InvalidRequestError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return POLICIES[name].traits


def default_policy_name(has_head: bool) -> str:
    return DEFAULT_POLICY if has_head else FALLBACK_POLICY


def resolve_policy(config: PolicyConfig, has_head: bool) -> PolicyConfig:
    """A request's policy flags checked before any model work (raises InvalidRequestError) and its
    name filled in (a request that names no policy gets the default): where a request is accepted,
    once; what runs it trusts the result."""
    default = "" if config.name else " (the default)"
    config = config if config.name else config.model_copy(update={"name": default_policy_name(has_head)})
    traits = policy_traits(config.name)
    if traits.needs_head and not has_head:
        raise InvalidRequestError(f"policy {config.name!r} needs an acceptance head: pass --head PATH")
    if config.k is not None:  # (the rules of the policies' constructors: base.py)
        check_count("k", config.k)
    if config.k is not None and not traits.uses_draft:  # (a value no policy reads is refused, not ignored)
        raise InvalidRequestError(f"policy {config.name!r}{default} drafts nothing: k does not apply")
    if config.threshold is not None:
        check_threshold(config.threshold)
    if config.threshold is not None and not traits.reads_threshold:
        readers = ", ".join(name for name in POLICY_NAMES if policy_traits(name).reads_threshold)
        raise InvalidRequestError(f"policy {config.name!r}{default} reads no threshold (those that do: {readers})")
    return config


def check_model_free(policy: str) -> None:
    """Raises InvalidRequestError for a policy that stops on q itself (`PolicyTraits.stops_on_q`):
    a model-free draft's is one-hot (models/suffix.py)."""
    if policy_traits(policy).stops_on_q:
        raise InvalidRequestError(f"policy {policy!r} stops on the draft's distribution, and the suffix draft's "
                                  f"is one-hot: use fixed, heuristic, specdec++ or specdec++cost")


def make_policy(
    config: PolicyConfig,
    head: AcceptanceHead | None = None,
    reference: Sequence[int] | None = None,
) -> StoppingPolicy:
    """A fresh policy for one sample (policies such as `heuristic` keep state across rounds); raises
    InvalidRequestError for flags the policy cannot take (a draft replica is where a served round's
    policy arrives)."""
    config = resolve_policy(config, has_head=head is not None)
    k, threshold = config.k, config.threshold
    cap = {} if k is None else {"max_candidates": k}
    level = {} if threshold is None else {"threshold": threshold}
    match config.name:
        case "fixed":
            return FixedK() if k is None else FixedK(k)
        case "heuristic":
            return Heuristic() if k is None else Heuristic(k)
        case "svip":
            return SVIP(**level, **cap)
        case "confidence":
            return Confidence(**level, **cap)
        case "specdec++":
            return SpecDecPP(head, **level, **cap)
        case "specdec++cost":
            return SpecDecPPCost(head, **cap)
        case "oracle":
            if reference is None:
                raise InvalidRequestError("policy 'oracle' needs the target's greedy continuation")
            return Oracle(reference, **cap)
        case _:
            return TargetOnly()


__all__ = [
    "POLICIES", "POLICY_NAMES", "HEAD_POLICIES", "DEFAULT_POLICY", "FALLBACK_POLICY", "PolicyConfig", "default_policy_name",
    "policy_traits", "resolve_policy", "check_model_free", "make_policy",
    "Decision", "DraftStep", "Estimate", "PolicyTraits", "StoppingPolicy",
    "FixedK", "SpecDecPP", "SpecDecPPCost", "SVIP", "Heuristic", "Confidence", "Oracle", "TargetOnly",
]
