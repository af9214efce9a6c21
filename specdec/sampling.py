"""Turning logits into the distribution a token is drawn from.

The same transform (temperature, then top-k, then top-p, the order of HF's logits processors) is
applied to the draft's and the target's logits: verification compares the two processed
distributions, so the output follows exactly what target-only sampling with the same parameters
would produce. Temperature 0 means greedy: the distribution collapses to the argmax and
verification becomes exact match.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

# Largest number of independent samples one request may ask for; more is almost surely a mistake
# and would hold a session's caches for a long time.
MAX_SAMPLES_PER_REQUEST = 64


class SamplingParams(BaseModel):
    """How tokens are chosen. Identical for the draft and the target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p.

    For greedy requests this is the plain softmax (temperature 1, no filters): policies such as
    SVIP and confidence read the draft's distribution even when the token is the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def choose_token(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from probs [V] (argmax when greedy)."""
    if params.greedy:
        return int(torch.argmax(probs))
    return int(torch.multinomial(probs, 1, generator=generator))
