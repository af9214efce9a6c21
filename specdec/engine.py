"""The in-process speculative decoding engine: the round loop (specdec/loop.py) over the draft and
verifier workers in this process. Every prompt and sample given at once shares the batch.

One round is the paper's MDP step:
    propose -> the draft extends its cache with the committed tokens, then drafts y_1..y_K,
               asking the stopping policy after every token (Algorithm 2);
    verify  -> one target pass over the unseen committed tokens plus y_1..y_K, then Algorithm 1;
    commit  -> y_1..y_n and the correction/bonus token join the history; caches roll back;
    decide  -> stop on EOS, the token budget or a stop string, else the next round.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from specdec.cost_profile import CostProfile
from specdec.errors import IncompatibleModelsError
from specdec.head import AcceptanceHead
from specdec.calls import LocalTransport
from specdec.loop import BatchConfig, Completion, GenerationResult, RoundLoop
from specdec.models.runtime import DraftRole, TargetRole
from specdec.params import DEFAULT_DRAFT, GenerationParams, named_drafts
from specdec.sequences import DraftTraits, RequestRules, UpdateCallback
from specdec.workers import DraftWorker, VerifierWorker

T = TypeVar("T")

__all__ = ["Completion", "GenerationResult", "SpecDecEngine", "UpdateCallback"]


def check_vocabularies(draft_vocab: int, target_vocab: int) -> None:
    """Verification compares q with p id by id: the draft's logits must be as wide as the target's.
    A draft whose embedding has other padding rows than its target's is fitted to it when built
    (models/runtime.py `DraftRole.fit_vocabulary`); which pairs share a vocabulary is decided from
    their tokenizers (builder.py `check_shared_vocabulary`)."""
    if draft_vocab != target_vocab:
        raise IncompatibleModelsError(
            f"the draft scores {draft_vocab} tokens, the target {target_vocab}; a draft with other padding rows "
            "must be fitted to its target (DraftRole.fit_vocabulary, as the builder does)")


def check_pair(draft: DraftRole, target: TargetRole) -> None:
    """One vocabulary; a feature draft's states as wide as the target's, whose every verification
    then also returns the states it reads."""
    check_vocabularies(draft.vocab_size, target.vocab_size)
    if draft.reads_features:
        if draft.hidden_size != target.hidden_size:
            raise IncompatibleModelsError(f"the feature draft reads states of width {draft.hidden_size}, the "
                                          f"target's are {target.hidden_size}")
        target.read_features(draft.target_layers)


class SpecDecEngine:
    """`draft` and `head` are the default draft (DEFAULT_DRAFT); `more_drafts` names others, each
    with its head (None: none), that requests pick by name (`GenerationParams.draft`)."""

    def __init__(
        self,
        draft: DraftRole,
        target: TargetRole,
        tokenizer=None,
        head: AcceptanceHead | None = None,
        eos_token_ids: Sequence[int] = (),
        batch: BatchConfig = BatchConfig(),
        more_drafts: Mapping[str, tuple[DraftRole, AcceptanceHead | None]] = {},
    ):
        drafts = named_drafts((draft, head), more_drafts)
        for each, _ in drafts.values():
            check_pair(each, target)
        self.draft, self.target, self.tokenizer, self.head = draft, target, tokenizer, head
        self._lock = threading.Lock()  # one generate call at a time (`_run`)
        self.rules = RequestRules(tokenizer, eos_token_ids, min(*(d.max_context for d, _ in drafts.values()),
                                                                target.max_context),
                                  target.vocab_size, {name: DraftTraits(h is not None, d.reads_features, d.model_free,
                                                                                    d.suffix is not None)
                                                      for name, (d, h) in drafts.items()})
        self.max_context = self.rules.max_context
        self.draft_workers = {name: DraftWorker(d, h) for name, (d, h) in drafts.items()}
        self.draft_worker, self.verifier_worker = self.draft_workers[DEFAULT_DRAFT], VerifierWorker(target)
        # The loop decodes at most the sessions every runtime holds a cache for (static rows, llama.cpp
        # sequences; past them each step would evict the caches of sessions waiting their turn), and
        # the positions a shared cache holds (llama.cpp's).
        roles = (target, *(d for d, _ in drafts.values()))
        batch = batch.within(min((r.max_pass_sessions for r in roles if r.max_pass_sessions), default=None),
                             min((r.max_cached_positions for r in roles if r.max_cached_positions), default=None))
        self.loop = RoundLoop(LocalTransport(self.draft_workers, self.verifier_worker), self.rules, batch)
        # Costs measured here: a short probe of every model (the drafts', then the target's) seeds
        # each draft's live profile.
        drafted = {}
        for name, worker in self.draft_workers.items():
            worker.probe()
            drafted[name] = worker.take_timings()
        self.verifier_worker.probe()
        verified = self.verifier_worker.take_timings()
        for name, timings in drafted.items():
            self.loop.costs[name].observe(timings + verified)

    def close(self) -> None:
        """Release now what the models hold beyond Python's memory (captured graphs, models/static.py
        `capture`; llama.cpp's models and contexts); the engine is not used after."""
        for worker in self.draft_workers.values():
            worker.draft.close()
        self.target.close()

    def cost_profile(self) -> CostProfile | None:
        """The costs the default policy plans with now (measured here unless given by hand)."""
        return self.loop.planners[0].profile()  # the default draft's, lane 0

    @property
    def drafting(self) -> bool:
        """Whether the last priced step (of some lane) found a round that pays: the draft is on."""
        return any(planner.drafting for planner in self.loop.planners)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.rules.eos_token_ids

    def encode_prompt(self, prompt: str | Sequence[dict], chat_template: bool = True) -> list[int]:
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
        """One request (its n samples share the batch). `reference`: the oracle's hindsight, the
        target's greedy tokens for this prompt and budget, when the caller has them already (the
        bench reuses target-only's); else decoded here, untimed."""
        return self._run(lambda: self.loop.generate(prompt_ids, params, on_update, reference))

    def generate_many(self, prompts: Sequence[Sequence[int]],
                      params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
                      on_update=None, references: Sequence[Sequence[int] | None] | None = None,
                      ) -> list[GenerationResult]:
        """Every prompt at once, in one batch (a request each; results in order). `params`: one for
        all, or one per prompt. `on_update(prompt_index, sample_index, ids, text, finish_reason)`.
        A failed request raises its error after the others finish."""
        references = references or [None] * len(prompts)
        each = [params] * len(prompts) if isinstance(params, GenerationParams) else list(params)
        if not len(each) == len(references) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many params and references, got {len(each)} and "
                             f"{len(references)}")

        async def run_all() -> list[GenerationResult]:
            def update_for(i: int):
                return (lambda index, ids, text, finish: on_update(i, index, ids, text, finish)) if on_update else None

            results = await asyncio.gather(
                *(self.loop.generate(p, q, update_for(i), r) for i, (p, q, r) in enumerate(zip(prompts, each, references))),
                return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        return self._run(run_all)

    def _run(self, work: Callable[[], Awaitable[T]]) -> T:
        """The loop's `work()` run to its end. One call at a time: the loop serves one event loop at
        a time, so another thread's call waits its turn. Where this thread runs an event loop
        already (Jupyter, an async app, where `asyncio.run` refuses), on a thread of its own; an
        async caller that wants to share the batch awaits `engine.loop.generate` instead."""
        with self._lock:
            try:
                try:
                    asyncio.get_running_loop()
                except RuntimeError:
                    return asyncio.run(work())
                with ThreadPoolExecutor(1, thread_name_prefix="specdec-engine") as pool:
                    return pool.submit(lambda: asyncio.run(work())).result()
            except BaseException:  # cut short (Ctrl-C cancels the releases too): no request is live now
                self._release_all()
                raise

    def _release_all(self) -> None:
        """Every session the workers hold, and the loop's wire state of them: orphans once no call runs."""
        for worker in (*self.draft_workers.values(), self.verifier_worker):
            worker.release(worker.sessions.ids())
        self.loop.calls.forget_all()
