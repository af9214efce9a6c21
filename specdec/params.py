"""A request's parameters (everything but the prompt), from flags or the wire, with one-line errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from specdec.errors import InvalidRequestError, ModelSourceError, validation_message
from specdec.policies import PolicyConfig
from specdec.sampling import MAX_SAMPLES_PER_REQUEST, SamplingParams

FINISH_STOP, FINISH_LENGTH = "stop", "length"  # OpenAI's finish reasons
# The name of an engine's first draft (`--draft`); the others are named where they are given
# (`EngineConfig.drafts`), and a request picks one by name (`GenerationParams.draft`).
DEFAULT_DRAFT = "default"
T = TypeVar("T")


def named_drafts(first: T, more: Mapping[str, T]) -> dict[str, T]:
    """Each of an engine's drafts (or its config) by name, the first as DEFAULT_DRAFT."""
    if DEFAULT_DRAFT in more:
        raise ModelSourceError(f"{DEFAULT_DRAFT!r} names the first draft (--draft): give the others other names")
    return {DEFAULT_DRAFT: first, **more}


MAX_STOP_STRINGS = 16  # (OpenAI's API takes 4)
S = TypeVar("S", bound=Sequence[str])


def few_stops(stop: S) -> S:
    """At most MAX_STOP_STRINGS, with one reason wherever they are given (pydantic's max_length said
    "Tuple should have ..." here, "List should have ..." for the OpenAI route's array)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise PydanticCustomError("too_long", "at most {most} stop strings, got {count}",
                                  {"most": MAX_STOP_STRINGS, "count": len(stop)})
    return stop


class GenerationParams(BaseModel):
    """Everything about a request but the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict, as the OpenAI route's fields (services/openai_api.py) and PolicyConfig's: a bool where a
    # number is expected is refused (lax mode read true as 1), as is a number for a bool.
    max_new_tokens: int = Field(128, ge=1, strict=True)
    n: int = Field(1, ge=1, le=MAX_SAMPLES_PER_REQUEST, strict=True)
    # ("" would stop before the first token.) At most MAX_STOP_STRINGS: every commit of every sample
    # scans its new text for each, on the loop's thread, so thousands would stall every other session.
    stop: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], AfterValidator(few_stops)] = ()
    chat_template: bool = Field(True, strict=True)
    sampling: SamplingParams = SamplingParams()
    policy: PolicyConfig = PolicyConfig()
    # Which of the engine's drafts proposes this request's rounds (None: its first, DEFAULT_DRAFT).
    # Requests with different drafts share the steps: each draft drafts its own sessions, one
    # target pass verifies them all.
    draft: str | None = Field(None, min_length=1)
    # The cache of earlier responses the request's suffix draft reads and adds its response to
    # (models/suffix.py `SuffixDraft.remember`): one per API key, served (the ingress sets it from
    # the key that authenticated the request, services/auth.py `cache_scope`: a client names
    # none); in process, any name. None: the request reads its own text only.
    cache_scope: str | None = Field(None, min_length=1, max_length=128)


POLICY_FLAGS = {"policy": "name", "k": "k", "threshold": "threshold"}  # flag -> PolicyConfig field


def build_params(**flags) -> GenerationParams:
    """GenerationParams from flat flags (temperature=..., policy=..., k=...; None = default),
    raising InvalidRequestError with a one-line reason."""
    given = {key: value for key, value in flags.items() if value is not None}
    sampling = {key: given.pop(key) for key in list(given) if key in SamplingParams.model_fields}
    policy = {POLICY_FLAGS[key]: given.pop(key) for key in list(given) if key in POLICY_FLAGS}
    try:
        return GenerationParams(sampling=SamplingParams(**sampling), policy=PolicyConfig(**policy), **given)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc, {"name": "policy"})) from None
