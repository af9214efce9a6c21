"""What a request does around the rounds, shared by the in-process engine and the served
coordinator: encode the prompt, validate the request, bound each round's candidates, and commit a
round's tokens (EOS, token budget, context, stop strings, streamable text).
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import jinja2

from specdec.errors import InvalidRequestError, one_line
from specdec.metrics import RequestStats
from specdec.params import DEFAULT_DRAFT, FINISH_LENGTH, FINISH_STOP, GenerationParams
from specdec.policies import PolicyTraits, check_model_free, policy_traits, resolve_policy

if TYPE_CHECKING:
    from specdec.cost_profile import CostProfile
    from specdec.protocol import Proposal, Role

CHAT_ROLES = ("system", "user", "assistant")


def is_token_id(value) -> bool:
    """An integer (Python's, numpy's, a torch scalar's: `operator.index`), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclass
class SampleState:
    """One sample being generated."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: str | None = None
    # Incremental detokenization (TGI's decode_token): `text` holds generated[:decoded]; the next
    # decode starts at `context`, the tokens before `decoded` that make the new ones decode as in the whole text.
    context: int = 0
    decoded: int = 0

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        """len(history), without building it (every session asks every step)."""
        return len(self.prompt) + len(self.generated)

    def since(self, position: int) -> list[int]:
        """history[position:], without building the whole history."""
        cut = position - len(self.prompt)
        return self.generated[cut:] if cut >= 0 else self.prompt[position:] + self.generated


# on_update(sample_index, new_token_ids, new_text, finish_reason): after every round that committed
# something, and once with the finish reason (which may come with the last tokens).
UpdateCallback = Callable[[int, list[int], str, str | None], None]


@dataclass(frozen=True)
class DraftTraits:
    """What the rules need to know of one of the engine's drafts."""

    has_head: bool = False  # an acceptance head is loaded for it: the default policy depends on it
    reads_features: bool = False  # a feature draft: each verification hands it the target's states (calls.py)
    model_free: bool = False  # the suffix draft (models/suffix.py): no passes, a one-hot q
    fused: bool = False  # a model draft with the suffix draft fused in (proposers.py `FusedProposer`)


@dataclass(eq=False)
class Request:
    """What a request's samples share; its params hold the resolved policy (a name, never the
    default) and the draft's name."""

    params: GenerationParams
    seed: int
    stats: RequestStats = field(default_factory=RequestStats)
    on_update: UpdateCallback | None = None
    reference: list[int] | None = None  # the oracle's hindsight
    traits: PolicyTraits = field(init=False)

    def __post_init__(self):
        self.traits = policy_traits(self.params.policy.name)


@dataclass(eq=False)
class LoopSample:
    """One sample while the round loop decodes it: a session on the workers. Its wire state lives
    with the calls (calls.py), its planning state with its lane's planner (planner.py)."""

    session_id: str
    index: int  # which of the request's samples
    request: Request
    sample: SampleState
    done: asyncio.Future  # the sample's outcome: set once its workers' caches are released
    round_index: int = 0  # rounds committed: with the request's seed, where a round's random numbers come from
    error: BaseException | None = None
    ahead: Proposal | None = None  # its next round, drafted while the last one verified (loop.py)

    @property
    def traits(self) -> PolicyTraits:
        return self.request.traits

    @property
    def draft(self) -> str:
        """The name of the draft that proposes this sample's rounds."""
        return self.request.params.draft

    @property
    def over(self) -> bool:
        """Finished, failed or cancelled: it leaves the loop at the next step boundary."""
        return self.sample.finish_reason is not None or self.error is not None or self.done.done()

    def fail(self, exc: BaseException) -> None:
        """The sample's first error stands (a later one is what the first caused)."""
        if self.error is None and not self.done.done():
            self.error = exc


class RoundObserver(Protocol):
    """Metrics sink (services/metrics.py)."""

    def on_round(self, num_candidates: int, num_accepted: int, policy: str, held: str | None) -> None:
        """A committed round; `held`: why the session did not call the draft (metrics.HELD), if so."""

    def on_call(self, role: Role, compute_ms: float, transport_ms: float, num_bytes: int) -> None: ...

    def on_request(self, stats: RequestStats, policy: str, outcome: str) -> None:
        """A finished request; `outcome`: "ok", "error", or "cancelled" (its client went away)."""

    def on_costs(self, profile: CostProfile, drafting: bool, draft: str) -> None: ...


class RequestRules:
    """The rules of a request for one target and its drafts: the tokenizer (may be None: token ids
    only), EOS ids, the context all the models hold and the shared vocabulary, and each draft's
    traits by name (the first is the default: a request that names none gets it)."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], max_context: int, vocab_size: int,
                 drafts: dict[str, DraftTraits] | None = None):
        self.tokenizer, self.eos_token_ids = tokenizer, frozenset(eos_token_ids)
        self.max_context, self.vocab_size = max_context, vocab_size
        self.drafts = dict(drafts) if drafts else {DEFAULT_DRAFT: DraftTraits()}

    # ----------------------------------------------------------------------------------------
    # Prompts

    def encode_prompt(self, prompt: str | Sequence[dict], chat_template: bool = True) -> list[int]:
        """A text as one user message (or as raw text), or a conversation (chat messages, as the
        editing set's multi-turn prompts are) through the chat template."""
        if not isinstance(prompt, str):  # without the template: the turns' contents joined, as a model without one
            return self.encode_messages(prompt, raw_fallback=True, template=chat_template)
        if chat_template:  # (a message of blanks only is refused as empty there)
            return self.encode_messages([{"role": "user", "content": prompt}], raw_fallback=True)
        if not prompt:  # raw text of blanks is tokens to continue, as OpenAI's completions take it
            raise InvalidRequestError("prompt is empty")
        return self._encode_raw(prompt)

    def encode_messages(self, messages: Sequence[dict], raw_fallback: bool = False, template: bool = True) -> list[int]:
        """A conversation through the chat template, generation prompt appended. Without a template
        (the tokenizer has none, or `template` is false): the contents joined by newlines when
        `raw_fallback`, else an error."""
        tokenizer = self._tokenizer()
        if not messages:
            raise InvalidRequestError("messages is empty")
        for message in messages:
            if not isinstance(message, dict):  # (a list of token ids: AttributeError before)
                raise InvalidRequestError(f"a message is an object with role and content, got {type(message).__name__}"
                                          " (token ids go to generate_ids)")
            if message.get("role") not in CHAT_ROLES:
                raise InvalidRequestError(f"message role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}")
        if not any(str(m.get("content", "")).strip() for m in messages):
            raise InvalidRequestError("prompt is empty")
        if not tokenizer.chat_template or not template:
            if not raw_fallback:
                raise InvalidRequestError("this model's tokenizer has no chat template: send a prompt")
            return self._encode_raw("\n".join(m["content"] for m in messages))
        try:
            ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        except jinja2.TemplateError as exc:  # the model's rules: raise_exception("roles must alternate ...")
            raise InvalidRequestError(f"the model's chat template refuses these messages: {one_line(exc)}") from None
        return list(ids)

    def _encode_raw(self, text: str) -> list[int]:
        """Raw text with the tokenizer's special tokens, as vLLM's completions and llama.cpp encode
        it: a Llama-family target gets the BOS it was trained behind (Qwen's tokenizer adds none).
        The chat template path does not come here: templates write their own BOS."""
        return list(self._tokenizer().encode(text, add_special_tokens=True))

    def _tokenizer(self):
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass token ids")
        return self.tokenizer

    def draft_name(self, params: GenerationParams) -> str:
        """The draft the request names (the first where it names none)."""
        name = params.draft or next(iter(self.drafts))
        if name not in self.drafts:
            raise InvalidRequestError(f"unknown draft {name!r}; this engine has {', '.join(map(repr, self.drafts))}")
        return name

    def resolved(self, params: GenerationParams) -> GenerationParams:
        """The params with the request's draft and policy named (the defaults where it names none)
        and the policy's flags checked (`resolve_policy`): resolved once, this is what travels with
        its rounds."""
        name = self.draft_name(params)
        return params.model_copy(update={"draft": name,
                                         "policy": resolve_policy(params.policy, self.drafts[name].has_head)})

    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> GenerationParams:
        """Reject a request before any model work; else its params, `resolved`."""
        params = self.resolved(params)
        name = params.policy.name
        traits = self.drafts[params.draft]
        if traits.model_free:
            check_model_free(name)
        if params.cache_scope is not None and not (traits.model_free or traits.fused):
            raise InvalidRequestError(f"a cache of earlier responses needs the suffix draft: draft {params.draft!r} "
                                      f"has none (--draft suffix or suffix+SRC)")
        if params.cache_scope is not None and traits.fused and not policy_traits(name).budgeted:
            # (proposers.py FusedProposer: other policies draft with the model alone; taken, the
            # option was half-honoured, the response written to the cache and nothing read)
            raise InvalidRequestError(f"draft {params.draft!r} reads a cache of earlier responses under "
                                      f"specdec++cost only: policy {name!r} drafts with its model alone")
        if params.policy.k is not None and params.policy.k > self.max_context:  # (no round drafts past it)
            raise InvalidRequestError(f"k must be at most the models' context of {self.max_context} tokens, "
                                      f"got {params.policy.k}")
        if policy_traits(name).greedy_only and not params.sampling.greedy:
            raise InvalidRequestError(f"policy {name!r} is defined for greedy decoding (temperature 0) only")
        if params.stop and self.tokenizer is None:  # (commit matches stop strings on the decoded text:
            # without a tokenizer they were ignored, the output ran past them and ended "length")
            raise InvalidRequestError("stop strings need a tokenizer: this engine has none")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the models' context holds {self.max_context}")
        if not all(is_token_id(t) for t in prompt_ids):  # (a float or a bool failed the whole step's pass)
            bad = next(t for t in prompt_ids if not is_token_id(t))
            raise InvalidRequestError(f"prompt token ids must be integers, got {bad!r}")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        return params

    # ----------------------------------------------------------------------------------------
    # Rounds

    def candidate_budget(self, seq: SampleState, params: GenerationParams, ahead: int = 0) -> int:
        """Most candidates worth drafting: a round commits K + 1 tokens, so never draft past the
        token budget or the context; `ahead` tokens after the history (a round drafted ahead, after
        the K + 1 of the round being verified) count as generated."""
        left = min(params.max_new_tokens - len(seq.generated), self.max_context - seq.length) - ahead
        return max(left - 1, 0)

    def commit(self, seq: SampleState, tokens: list[int], params: GenerationParams) -> tuple[list[int], str]:
        """Append the round's tokens up to the first stop condition; returns what is new for the
        caller (ids, and text that can no longer change)."""
        new_ids = []
        for token in tokens:
            seq.generated.append(token)
            new_ids.append(token)
            if token in self.eos_token_ids:
                seq.finish_reason = FINISH_STOP
                break
            if len(seq.generated) >= params.max_new_tokens or seq.length >= self.max_context:
                seq.finish_reason = FINISH_LENGTH
                break
        if self.tokenizer is None:
            return new_ids, ""
        new_text, held = self._decode_new(seq)
        seq.text += new_text
        if params.stop and self._truncate_at_stop_string(seq, new_ids, params.stop, held):
            seq.finish_reason = FINISH_STOP
        return new_ids, self._releasable_text(seq, params.stop)

    def _decode_new(self, seq: SampleState) -> tuple[str, str]:
        """(text for `seq.text`, text held back) of the generated tokens not in `seq.text` yet,
        decoded after their context and without its text. It is held back while it ends inside a
        character (U+FFFD) or adds nothing, unless the sample has finished. Decoding the whole text
        every round grew with its length."""
        decode = self.tokenizer.decode
        before = decode(seq.generated[seq.context:seq.decoded], skip_special_tokens=True)
        text = decode(seq.generated[seq.context:], skip_special_tokens=True)
        if not text.startswith(before):  # a tokenizer that cleans up spaces across the boundary: the whole text
            before, text = seq.text, decode(seq.generated, skip_special_tokens=True)
        if seq.finish_reason is None and (len(text) <= len(before) or text.endswith("\ufffd")):
            return "", text[len(before):]
        seq.context, seq.decoded = seq.decoded, len(seq.generated)
        return text[len(before):], ""

    def _truncate_at_stop_string(self, seq: SampleState, new_ids: list[int], stops: Sequence[str],
                                 held: str = "") -> bool:
        """Cut the ids after the token completing the first stop string, and the text (with what
        decoding `held` back) before the stop strings that text holds: what a round of one token at
        a time leaves, however many tokens the round commits (a stop starting earlier but completed
        by a later token of the round does not count)."""
        search_from = max(seq.emitted_chars - max(len(s) for s in stops), 0)
        found = seq.text + held
        hits = [i for i in (found.find(s, search_from) for s in stops) if i >= 0]
        if not hits:
            return False
        first_new = len(seq.generated) - len(new_ids)
        for keep in range(first_new + 1, len(seq.generated) + 1):
            text = self.tokenizer.decode(seq.generated[:keep], skip_special_tokens=True)
            completed = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
            if completed:
                del new_ids[keep - first_new:]
                del seq.generated[keep:]
                hits = completed
                break
        seq.text = found[:min(hits)]
        return True

    @staticmethod
    def _releasable_text(seq: SampleState, stops: Sequence[str]) -> str:
        """Text safe to stream: not a dangling partial UTF-8 character, and not a possible prefix
        of a stop string still being completed."""
        end = len(seq.text)
        if seq.finish_reason is None:
            end -= max((len(s) - 1 for s in stops), default=0)
            while end > seq.emitted_chars and seq.text[end - 1] == "\ufffd":
                end -= 1
        if end <= seq.emitted_chars:
            return ""
        new_text = seq.text[seq.emitted_chars:end]
        seq.emitted_chars = end
        return new_text
