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
from dataclasses import dataclass

from specdec.errors import IncompatibleModelsError
from specdec.head import AcceptanceHead
from specdec.metrics import RequestStats
from specdec.models.runtime import DraftRuntime, TargetRuntime
from specdec.params import FINISH_LENGTH, GenerationParams
from specdec.policies import StoppingPolicy, make_policy
from specdec.policies.target_only import TargetOnly
from specdec.rounds import SEED_BITS, propose, round_generator, verify
from specdec.sequences import RequestRules, SampleState

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
        self.rules = RequestRules(tokenizer, eos_token_ids, min(draft.max_context, target.max_context),
                                  target.vocab_size, has_head=head is not None)
        self.max_context = self.rules.max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.rules.eos_token_ids

    # ----------------------------------------------------------------------------------------
    # Requests

    def encode_prompt(self, prompt: str, chat_template: bool = True) -> list[int]:
        return self.rules.encode_prompt(prompt, chat_template)

    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Reject a request before any model work."""
        self.rules.validate(prompt_ids, params)

    def generate(self, prompt: str, params: GenerationParams = GenerationParams(),
                 on_update: UpdateCallback | None = None) -> GenerationResult:
        return self.generate_ids(self.encode_prompt(prompt, params.chat_template), params, on_update)

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams = GenerationParams(),
                     on_update: UpdateCallback | None = None,
                     reference: Sequence[int] | None = None) -> GenerationResult:
        """`reference`: the oracle's hindsight, the target's greedy tokens for this prompt and
        budget, when the caller has them already (the bench reuses target-only's); else decoded
        here, untimed."""
        prompt_ids = list(prompt_ids)
        self.validate(prompt_ids, params)
        seed = params.sampling.seed if params.sampling.seed is not None else secrets.randbits(SEED_BITS)
        if params.policy.name != "oracle":
            reference = None
        elif reference is None:
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
                notify: Callable[[list[int], str], None] | None = None) -> SampleState:
        seq = SampleState(prompt_ids)
        draft_session, target_session = self.draft.new_session(), self.target.new_session()
        round_index = 0
        while seq.finish_reason is None:
            history = seq.history
            start = time.perf_counter()
            proposal = propose(self.draft, draft_session, history, policy, self.rules.candidate_budget(seq, params),
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
            new_ids, new_text = self.rules.commit(seq, verdict.committed(proposal.candidates), params)
            stats.generated_tokens += len(new_ids)
            round_index += 1
            if notify and (new_ids or new_text):
                notify(new_ids, new_text)
        return seq
