"""The in-process speculative decoding engine.

One round is the paper's MDP step, named as in the loop below:
    propose -> the draft extends its cache with the committed tokens, then drafts y_1..y_K,
               asking the stopping policy after every token (Algorithm 2);
    verify  -> one target pass over the unseen committed tokens plus y_1..y_K, then Algorithm 1;
    commit  -> y_1..y_n and the correction/bonus token join the history; caches roll back;
    decide  -> stop on EOS, the token budget or a stop string, else the next round.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.errors import IncompatibleModelsError, InvalidRequestError
from specdec.head import AcceptanceHead
from specdec.metrics import RequestStats
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.policies import PolicyConfig, StoppingPolicy, make_policy, validate_policy
from specdec.policies.target_only import TargetOnly
from specdec.rounds import SEED_BITS, propose, round_generator, verify
from specdec.sampling import MAX_SAMPLES_PER_REQUEST, SamplingParams

FINISH_STOP, FINISH_LENGTH = "stop", "length"  # OpenAI's finish reasons


class GenerationParams(BaseModel):
    """Everything about a request but the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=1)
    n: int = Field(1, ge=1, le=MAX_SAMPLES_PER_REQUEST)
    stop: tuple[str, ...] = ()
    chat_template: bool = True
    sampling: SamplingParams = SamplingParams()
    policy: PolicyConfig = PolicyConfig()


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
        raise InvalidRequestError(validation_message(exc)) from None


def validation_message(exc: ValidationError) -> str:
    """The first pydantic error as one line: `max_new_tokens: Input should be greater than or equal to 1`."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"] if part not in ("sampling", "policy"))
    return f"{where.replace('_', '-') or 'request'}: {error['msg']}"


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}


@dataclass
class GenerationResult:
    completions: list[Completion]
    stats: RequestStats
    prompt_tokens: int

    def to_dict(self) -> dict:
        return {"completions": [c.to_dict() for c in self.completions], "stats": self.stats.to_dict()}


# on_update(sample_index, new_token_ids, new_text): called after every round with what it committed.
UpdateCallback = Callable[[int, list[int], str], None]


@dataclass
class _Sequence:
    """One sample being generated."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: str | None = None

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated


class SpecDecEngine:
    def __init__(
        self,
        draft: DraftRuntime,
        target: TargetRuntime,
        tokenizer=None,
        head: AcceptanceHead | None = None,
        eos_token_ids: Sequence[int] = (),
    ):
        if draft.vocab_size != target.vocab_size:
            raise IncompatibleModelsError(
                f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size} tokens); "
                "speculative decoding needs one shared vocabulary")
        self.draft, self.target, self.tokenizer, self.head = draft, target, tokenizer, head
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = min(draft.max_context, target.max_context)

    # ----------------------------------------------------------------------------------------
    # Requests

    def encode_prompt(self, prompt: str, chat_template: bool = True) -> list[int]:
        if not prompt or not prompt.strip():
            raise InvalidRequestError("prompt is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass token ids")
        if chat_template and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                return_dict=False)
        else:
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(ids)

    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Reject a request before any model work."""
        validate_policy(params.policy, has_head=self.head is not None)
        if params.policy.name == "oracle" and not params.sampling.greedy:
            raise InvalidRequestError("policy 'oracle' is defined for greedy decoding (temperature 0) only")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the models' context holds {self.max_context}")
        if any(not 0 <= t < self.target.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.target.vocab_size})")

    def generate(self, prompt: str, params: GenerationParams = GenerationParams(),
                 on_update: UpdateCallback | None = None) -> GenerationResult:
        return self.generate_ids(self.encode_prompt(prompt, params.chat_template), params, on_update)

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams = GenerationParams(),
                     on_update: UpdateCallback | None = None) -> GenerationResult:
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        seed = params.sampling.seed if params.sampling.seed is not None else secrets.randbits(SEED_BITS)
        reference = None
        if params.policy.name == "oracle":  # the hindsight the oracle needs; not timed
            reference = self._decode(prompt_ids, TargetOnly(), params, seed, 0, RequestStats()).generated
        stats = RequestStats()
        completions = []
        start = time.perf_counter()
        for index in range(params.n):
            policy = make_policy(params.policy, head=self.head, reference=reference)
            notify = (lambda ids, text, i=index: on_update(i, ids, text)) if on_update else None
            seq = self._decode(prompt_ids, policy, params, seed, index, stats, notify)
            completions.append(Completion(seq.text, seq.generated, seq.finish_reason or FINISH_LENGTH))
        stats.wall_time_s = time.perf_counter() - start
        return GenerationResult(completions, stats, prompt_tokens=len(prompt_ids))

    # ----------------------------------------------------------------------------------------
    # The loop

    def _decode(self, prompt_ids: list[int], policy: StoppingPolicy, params: GenerationParams, seed: int,
                sample_index: int, stats: RequestStats,
                notify: Callable[[list[int], str], None] | None = None) -> _Sequence:
        seq = _Sequence(prompt_ids)
        draft_session, target_session = self.draft.new_session(), self.target.new_session()
        round_index = 0
        while seq.finish_reason is None:
            history = seq.history
            start = time.perf_counter()
            proposal = propose(self.draft, draft_session, history, policy, self._candidate_budget(seq, params),
                               len(seq.generated), params.sampling,
                               round_generator(seed, sample_index, round_index, "draft"))
            verify_start = time.perf_counter()
            verdict = verify(self.target, target_session, history, proposal.candidates, proposal.draft_probs,
                             params.sampling, round_generator(seed, sample_index, round_index, "target"))
            stats.draft_time_s += verify_start - start
            stats.target_time_s += time.perf_counter() - verify_start
            stats.draft_forward_passes += proposal.forward_passes
            policy.end_round(len(proposal.candidates), verdict.num_accepted)
            stats.record_round(len(proposal.candidates), verdict.num_accepted)
            new_ids, new_text = self._commit(seq, verdict.committed(proposal.candidates), params)
            stats.generated_tokens += len(new_ids)
            round_index += 1
            if notify and (new_ids or new_text):
                notify(new_ids, new_text)
        return seq

    def _candidate_budget(self, seq: _Sequence, params: GenerationParams) -> int:
        """Most candidates worth drafting: a round commits K + 1 tokens, so never draft past the
        token budget or the context."""
        left = min(params.max_new_tokens - len(seq.generated), self.max_context - len(seq.history))
        return max(left - 1, 0)

    def _commit(self, seq: _Sequence, tokens: list[int], params: GenerationParams) -> tuple[list[int], str]:
        """Append the round's tokens up to the first stop condition; returns what is new for the
        caller (ids, and text that can no longer change)."""
        new_ids = []
        for token in tokens:
            seq.generated.append(token)
            new_ids.append(token)
            if token in self.eos_token_ids:
                seq.finish_reason = FINISH_STOP
                break
            if len(seq.generated) >= params.max_new_tokens or len(seq.history) >= self.max_context:
                seq.finish_reason = FINISH_LENGTH
                break
        if self.tokenizer is None:
            return new_ids, ""
        seq.text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        if params.stop and self._truncate_at_stop_string(seq, new_ids, params.stop):
            seq.finish_reason = FINISH_STOP
        return new_ids, self._releasable_text(seq, params.stop)

    def _truncate_at_stop_string(self, seq: _Sequence, new_ids: list[int], stops: Sequence[str]) -> bool:
        """Cut the text before the first stop string, and the ids after the token completing it."""
        search_from = max(seq.emitted_chars - max(len(s) for s in stops), 0)
        hits = [i for i in (seq.text.find(s, search_from) for s in stops) if i >= 0]
        if not hits:
            return False
        first_new = len(seq.generated) - len(new_ids)
        for keep in range(first_new + 1, len(seq.generated) + 1):
            text = self.tokenizer.decode(seq.generated[:keep], skip_special_tokens=True)
            if any(s in text[search_from:] for s in stops):
                del new_ids[keep - first_new:]
                del seq.generated[keep:]
                break
        seq.text = seq.text[:min(hits)]
        return True

    @staticmethod
    def _releasable_text(seq: _Sequence, stops: Sequence[str]) -> str:
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
