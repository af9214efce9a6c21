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
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the least temperature divided by (a smaller one is 0 in float32)
# Below this temperature a logit divided by it may overflow float32 (|logit| up to ~1e4): `_temper`
# divides from the row's largest instead. Above it, one division as ever (the step's hot path: the
# largest's pass over every row would cost as much again, ~1 ms a step at 64 rows on 2 CPU cores).
STABLE_TEMPERATURE = 1e-6
BLOCK = 2048  # columns per block of `argmax` and `sample`


class SamplingParams(BaseModel):
    """How tokens are chosen. Identical for the draft and the target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict, as a request's other numbers (params.py): a bool is none (lax mode read true as 1); an
    # int is still a float. Finite, checked before the bounds, as the OpenAI route's fields: NaN is
    # "Input should be a finite number" on every entry point (it read as out of whichever bound it failed).
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy", strict=True, allow_inf_nan=False)
    # -1 or 0 = no top-k filter: -1 is the OpenAI ecosystem's "off" (vLLM's), 0 HF's; both taken on
    # every entry point (HTTP, gRPC, in process), held as 0 (one transform, one value on the round wire).
    top_k: int = Field(0, ge=-1, description="-1 or 0 = no top-k filter", strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    seed: int | None = Field(None, strict=True)

    @field_validator("top_k")
    @classmethod
    def _off_is_zero(cls, value: int) -> int:
        return max(value, 0)

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
        return _softmax(logits)
    if params.temperature != 1.0:
        logits = _temper(logits, params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = _softmax(logits)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _temper(logits: torch.Tensor, temperature: float, in_place: bool = False) -> torch.Tensor:
    """logits / temperature; below STABLE_TEMPERATURE from each row's largest: a tiny temperature
    then sends the others to -inf and keeps the largest at 0, where dividing the logits themselves
    overflows to inf - inf = NaN. (`in_place`: written over the logits.)"""
    if temperature >= STABLE_TEMPERATURE:
        return logits.div_(temperature) if in_place else logits / temperature
    largest = logits.amax(dim=-1, keepdim=True)
    divisor = max(temperature, FLOAT32_TINY)
    return logits.sub_(largest).div_(divisor) if in_place else (logits - largest) / divisor


def _softmax(logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """softmax over the last dimension; `in_place`: written over the logits where the kernel allows
    it (the CPU's, which reads each element before writing it; measured bit-equal to torch.softmax).
    One kernel on every path, so a row's distribution does not depend on which path its batch took."""
    if in_place and logits.device.type == "cpu":
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    probs = torch.softmax(logits, dim=-1)
    return logits.copy_(probs) if in_place else probs


def transform_of(params: SamplingParams) -> tuple[float, int, float]:
    """What the logits -> distribution transform reads (not the seed): rows that share it share one call."""
    return params.temperature, params.top_k, params.top_p


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    dropped = mass_before >= top_p
    dropped[..., 0] = False  # the most likely token stays, whatever top_p (one below float32's least is 0 there)
    sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def probs_by_params(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V], row n processed with params[n] (`probs_from_logits`);
    one call per distinct transform (`transform_of`)."""
    groups = rows_by([transform_of(p) for p in params])
    if len(groups) == 1:
        return probs_from_logits(logits, params[0])
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        probs[index] = probs_from_logits(logits[index], params[rows[0]])
    return probs


def rows_by(keys: list) -> dict:
    """{key: the indices of the rows with that key}, in first-seen order."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


def probs_in_place(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`probs_by_params`, written over logits [N, V] (and returned) where every row has one sampling
    without top-k or top-p: no new [N, V] tensor. A batch's rows over a full vocabulary are larger
    than the allocator keeps for reuse, so a new tensor is fresh memory whose page faults cost about
    as much as the softmax (docs/performance.md, "Host work per step")."""
    param = params[0]
    if len({transform_of(p) for p in params}) > 1 or param.top_k or param.top_p < 1.0:
        return probs_by_params(logits, params)
    if not param.greedy and param.temperature != 1.0:
        _temper(logits, param.temperature, in_place=True)
    return _softmax(logits, in_place=True)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not sum to 1), uniforms [N] in [0, 1) float64 ->
    tokens [N] long, token v drawn with probability probs[n, v] / sum probs[n]. One uniform per row
    from the row's own generator (`uniforms_from`) keeps a row's draw independent of its batch
    (torch.multinomial takes one generator a call: a call a row). By blocks, as `argmax`: the blocks'
    masses in one pass, then the CDF (fp64) inside the one block the point falls in, where a cumsum
    over the whole [N, V] would write a full-vocabulary row for every row (docs/performance.md,
    "Host work per step")."""
    rows, width = probs.shape
    block = min(BLOCK, width)
    main = width - width % block
    masses = probs[:, :main].reshape(rows, -1, block).sum(dim=-1)  # [N, V // block]
    if main < width:
        masses = torch.cat([masses, probs[:, main:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = masses.double().cumsum(dim=-1)  # [N, blocks]
    total = cdf[:, -1:]
    point = torch.minimum(uniforms.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, point, right=True).clamp(max=cdf.shape[1] - 1)  # [N, 1]: the block it falls in
    before = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp(min=0)), torch.zeros_like(point))  # [N, 1]
    columns = chosen * block + torch.arange(block, device=probs.device)  # [N, block]
    inside = probs.gather(1, columns.clamp(max=width - 1)).double() * (columns < width)  # [N, block]
    step = torch.searchsorted(before + inside.cumsum(dim=-1), point, right=True)  # [N, 1]
    # rounding between the block's mass and its own sum: never outside its tokens that have any mass
    positive = inside > 0
    first = torch.argmax(positive.to(torch.uint8), dim=-1, keepdim=True)
    last = (torch.arange(block, device=probs.device) * positive).amax(dim=-1, keepdim=True)
    return (chosen * block + torch.maximum(torch.minimum(step, last), first)).squeeze(-1)


def uniforms_from(generators: list[torch.Generator], count: int = 1) -> torch.Tensor:
    """[len(generators), count] float64 uniforms, row n from generators[n]."""
    return torch.stack([torch.rand(count, generator=g, dtype=torch.float64) for g in generators])


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [N, V] (the first index of each row's maximum), by blocks: the
    block maxima in one vectorized pass, then the argmax inside each row's first best block. On a CPU
    torch.argmax's kernel tracks indices element by element while amax runs at memory speed, so the
    blocks win several times over (docs/performance.md, "Host work per step"). On a GPU torch's
    kernel is one launch where the blocks take eight, and every drafting step and verification pays
    each launch on the host: there torch's runs."""
    rows, width = x.shape
    if width < 4 * BLOCK or x.device.type == "cuda":
        return torch.argmax(x, dim=-1)
    main = width - width % BLOCK
    blocks = x[:, :main].reshape(rows, -1, BLOCK).amax(dim=-1)  # [N, V // block]
    if main < width:
        blocks = torch.cat([blocks, x[:, main:].amax(dim=-1, keepdim=True)], dim=1)
    starts = torch.argmax(blocks, dim=-1) * BLOCK  # [N]: the first block holding the maximum
    # the last block may be short: its clamped columns repeat its last one, after the real ones
    columns = (starts[:, None] + torch.arange(BLOCK, device=x.device)).clamp(max=width - 1)  # [N, block]
    return starts + torch.argmax(x.gather(1, columns), dim=-1)


def choose_tokens(logits: torch.Tensor, probs: torch.Tensor | None, params: list[SamplingParams],
                  generators: list[torch.Generator]) -> list[int]:
    """One token per row: the argmax of logits [N, V] for greedy rows, else a draw from probs [N, V]
    (the rows' processed distributions) with one uniform from the row's generator."""
    tokens = argmax(logits) if any(p.greedy for p in params) else None  # [N]
    sampled = [n for n, p in enumerate(params) if not p.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        rows = probs if len(sampled) == len(params) else probs[index]
        draws = sample(rows, uniforms_from([generators[n] for n in sampled])[:, 0])
        tokens = draws if tokens is None else tokens.index_put((index,), draws)
    return tokens.tolist()


def choose_token(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from probs [V] (argmax when greedy): `choose_tokens` for one row."""
    return choose_tokens(probs[None], probs[None], [params], [generator])[0]
