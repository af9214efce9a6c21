"""A feature draft's greedy drafting steps as one chain on its static cache (docs/feature-draft.md,
"On a GPU"): K steps over B sessions, each feeding the draft's own state with the token the step
before chose, with no host work between them. On CUDA the chain is captured as one graph per bucket
(sessions, steps, gathered positions) and replayed: one launch for a drafting phase where step by
step costs K launches of a few dozen kernels each and a host sync per step.

    from `start` (the round's first step): s_0 and y_1; then for j = 1..K
        s_j     = Layer(W_fuse [norm_e(E y_j); norm_g(s_{j-1})])   at position p + j - 1
        y_{j+1} = argmax full_logits(s_j)        (the first index of the maximum: the smallest id)

Step j's logits and state are what `FeatureDraftRuntime.step` returns for the token y_j: the round
loop reads them in its place while every row drafting is greedy (rounds.propose), so a greedy row
draws the same tokens either way. A row whose policy stops before the chain's end leaves positions
past its stop in its cache, as any drafted candidate that is not accepted: scratch, rolled back by
the next round's `start`. The chain's K is a bucket's: steps past what the rows wanted are drafted
and never read (on a GPU a fraction of a millisecond each: docs/performance.md, "On a GPU").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.feature_draft import FeatureDraft
from specdec.models.static import StaticBatch, StaticKV, bucket, capture, static_attention


@dataclass
class ChainInputs:
    """Where a chain of B sessions starts; a captured chain's copy is padded to its bucket."""

    rows: torch.Tensor  # [B] long: each session's row of the static cache (pads: the scratch row)
    starts: torch.Tensor  # [B] long: the position y_1 is fed at (the session's length)
    real: torch.Tensor  # [B] bool: False for a pad, whose keys go to the scratch position
    state: torch.Tensor  # [B, H] s_0: the draft's output state at the session's last position
    tokens: torch.Tensor  # [B] long: y_1


@dataclass
class ChainOutputs:
    """K steps over B sessions."""

    scores: torch.Tensor  # [K, B, V_trim] each step's scores of the draft's trimmed vocabulary (its dtype)
    states: torch.Tensor  # [K, B, H] s_1..s_K in the draft's dtype
    tokens: torch.Tensor  # [K, B] long: y_2..y_{K+1}, each step's argmax over the target's vocabulary


def run_chain(draft: FeatureDraft, kv: StaticKV, inputs: ChainInputs, steps: int, length: int) -> ChainOutputs:
    """The module docstring's K = `steps` steps, eagerly; every step gathers `length` positions a row
    (at least the longest start + steps)."""
    state, tokens, scores, states, chosen = inputs.state, inputs.tokens, [], [], []
    for j in range(steps):
        positions = torch.where(inputs.real, inputs.starts + j, kv.capacity)[:, None]  # [B, 1]
        batch = StaticBatch.of(inputs.rows, positions, length, kv.capacity)

        def attend(q, k, v, batch=batch):
            out, _ = static_attention(draft.layer.self_attn, q, k, v, None, scaling=draft.scale, static=batch,
                                      static_kv=kv)
            return out.transpose(1, 2)  # static_attention returns [B, 1, heads, D]

        x = draft.fused_input(state, tokens)[:, None]  # [B, 1, H]
        state = draft.block(x, positions.clamp(max=kv.capacity - 1), attend)[:, 0]  # [B, H]
        trimmed = draft.logits(state)  # [B, V_trim]: what a captured chain keeps (V: 5x more, in float)
        tokens = draft.argmax(trimmed)
        scores.append(trimmed)
        states.append(state)
        chosen.append(tokens)
    return ChainOutputs(torch.stack(scores), torch.stack(states), torch.stack(chosen))


def chain_bucket(kv: StaticKV, sessions: int, steps: int, longest: int) -> tuple[int, int, int] | None:
    """The bucket (sessions, steps, gathered length) a chain of `steps` steps from starts up to
    `longest` is padded to and replayed as; None where it is larger than every bucket, or where the
    bucket's steps would run past the cache's capacity (it runs eagerly)."""
    steps = bucket(steps, kv.options.graph_tokens)
    if steps is None or longest + steps > kv.capacity:
        return None
    return kv.graph_bucket(sessions, steps, longest + steps)

class CapturedChain:
    """`run_chain` for one bucket (B sessions, K steps, L gathered positions) captured as a CUDA graph
    over fixed inputs; `run` copies a smaller chain into them (the rest: pads on the scratch row) and
    replays. Off CUDA nothing is captured and `run` runs the padded chain eagerly (the tests' check
    of the padding)."""

    def __init__(self, draft: FeatureDraft, kv: StaticKV, sessions: int, steps: int, length: int, warmup: int = 2):
        device, hidden = draft.embed.device, draft.layer_config.hidden_size
        self.draft, self.kv, self.steps, self.length, self.graph = draft, kv, steps, length, None
        self.inputs = ChainInputs(torch.full((sessions,), kv.pool.size, device=device),
                                  torch.zeros(sessions, dtype=torch.long, device=device),
                                  torch.zeros(sessions, dtype=torch.bool, device=device),
                                  torch.zeros((sessions, hidden), dtype=draft.dtype, device=device),
                                  torch.zeros(sessions, dtype=torch.long, device=device))
        if device.type == "cuda":
            self.graph, self.outputs = capture(lambda: run_chain(draft, kv, self.inputs, steps, length), device,
                                               kv._graph_pool, warmup)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def run(self, inputs: ChainInputs, steps: int) -> ChainOutputs:
        """A chain of b <= B sessions and `steps` <= K -> its outputs [steps, b, ...]."""
        b, fixed = len(inputs.rows), self.inputs
        fixed.rows.fill_(self.kv.pool.size)
        fixed.real.zero_()
        for name in ("rows", "starts", "real", "state", "tokens"):
            getattr(fixed, name)[:b] = getattr(inputs, name)
        out = run_chain(self.draft, self.kv, fixed, self.steps, self.length) if self.graph is None else self.outputs
        if self.graph is not None:
            self.graph.replay()
        return ChainOutputs(out.scores[:steps, :b], out.states[:steps, :b], out.tokens[:steps, :b])


def chain(draft: FeatureDraft, kv: StaticKV, captured: dict[tuple[int, int, int], CapturedChain], inputs: ChainInputs,
          steps: int, longest: int) -> ChainOutputs:
    """`steps` steps from `inputs` (starts up to `longest`): replayed from the bucket's graph where the
    cache has graphs (captured at the bucket's first use, kept in `captured`), else eagerly."""
    key = chain_bucket(kv, len(inputs.rows), steps, longest) if kv.graphs else None
    if key is None:
        return run_chain(draft, kv, inputs, steps, longest + steps)
    if key not in captured:
        captured[key] = CapturedChain(draft, kv, *key)
    return captured[key].run(inputs, steps)
