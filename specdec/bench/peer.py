"""The peers: stock HF transformers assisted generation (`target.generate(assistant_model=draft)`)
on the very models our engine runs (same weights, same weight formats, same threads), so what
differs is the decoding loop and its schedule, not the kernels; and on the llama.cpp runtime,
llama-cpp-python's own prompt lookup decoding (`llamacpp-lookup`, `LlamaLookupPeer`) on the
target's GGUF file, the model-free draft's peer.

Two of its modes (transformers 5.x names; the assistant's schedule lives in the assistant model's
`generation_config`, which the candidate generator copies at the start of every `generate` call):
- `hf-heuristic`: `num_assistant_tokens_schedule="heuristic"` from `num_assistant_tokens` = 20
  (K += 2 after a round whose candidates were all accepted, else K -= 1), with the confidence rule
  off (`assistant_confidence_threshold=0`), so it is the heuristic schedule alone. HF carries K
  over from one `generate` call to the next; here it restarts at the initial K for every prompt,
  so a record does not depend on which prompts ran before it (a resumed run gives the same records).
- `hf-dynamic`: HF's default: `num_assistant_tokens=20`, schedule "constant", drafting stops
  once the draft's top probability falls below `assistant_confidence_threshold=0.4`. With
  scikit-learn installed HF also re-tunes that threshold from a ROC curve as it goes; without it the
  threshold stays fixed (`threshold_adaptation` in the record says which).

Counting: forward hooks on both models count passes and time them (draft and target time), and a
streamer receives each round's committed tokens, so the peer's records carry the same statistics
as ours: a round's candidates are the target pass's new positions minus one (the first pass also
holds the prompt), its accepted count the committed tokens minus the correction or bonus token.
Timing is the same as the engine's: wall time of the one `generate` call, prefill included.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging

from specdec.metrics import RequestStats
from specdec.params import FINISH_LENGTH, FINISH_STOP

HF_DEFAULT_ASSISTANT_TOKENS = 20  # transformers 5.x GenerationConfig default num_assistant_tokens
HF_DEFAULT_CONFIDENCE = 0.4  # transformers 5.x GenerationConfig default assistant_confidence_threshold


@dataclass(frozen=True)
class PeerMode:
    num_assistant_tokens: int
    schedule: str  # num_assistant_tokens_schedule
    confidence_threshold: float  # assistant_confidence_threshold; 0 = off


def peer_mode(name: str, value: float | int | None = None) -> PeerMode:
    if name == "hf-heuristic":
        return PeerMode(int(value or HF_DEFAULT_ASSISTANT_TOKENS), "heuristic", 0.0)
    if name == "hf-dynamic":
        return PeerMode(HF_DEFAULT_ASSISTANT_TOKENS, "constant", float(value or HF_DEFAULT_CONFIDENCE))
    raise ValueError(f"unknown peer {name!r}")


def threshold_adaptation() -> bool:
    """Whether HF re-tunes the confidence threshold (it does when scikit-learn imports)."""
    return importlib.util.find_spec("sklearn") is not None


@dataclass
class PeerResult:
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats


class _PassCounter:
    """Forward hooks that count and time a model's passes and note how many positions each fed."""

    def __init__(self, model: torch.nn.Module):
        self.passes, self.seconds, self.fed = 0, 0.0, []
        self._start = 0.0
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]

    def _before(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.fed.append(int(ids.shape[-1]) if ids is not None else 0)
        self._start = time.perf_counter()

    def _after(self, *_):
        self.seconds += time.perf_counter() - self._start
        self.passes += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _RoundStreamer:
    """A `generate` streamer: the first `put` is the prompt, each later one a round's committed tokens."""

    def __init__(self):
        self.rounds: list[list[int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.rounds.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class HFAssistedPeer:
    """HF assisted generation with our engine's loaded draft and target."""

    def __init__(self, draft_model, target_model, eos_token_ids: Sequence[int]):
        self.draft, self.target = draft_model, target_model
        self.eos_token_ids = sorted(eos_token_ids)

    def generate(self, prompt_ids: Sequence[int], mode: PeerMode, max_new_tokens: int, temperature: float,
                 seed: int) -> PeerResult:
        device = self.target.device
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        # Every sampling knob explicit: the models' own generation_config.json (Qwen ships top_k=20,
        # top_p=0.8, repetition_penalty=1.1) must not apply; ours uses none of them.
        sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                    if temperature > 0 else {"do_sample": False})
        saved = self.draft.generation_config
        self.draft.generation_config = copy.deepcopy(saved)
        self.draft.generation_config.num_assistant_tokens = mode.num_assistant_tokens
        self.draft.generation_config.num_assistant_tokens_schedule = mode.schedule
        self.draft.generation_config.assistant_confidence_threshold = mode.confidence_threshold
        draft_counter, target_counter = _PassCounter(self.draft), _PassCounter(self.target)
        streamer = _RoundStreamer()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "generation flags are not valid" notes about the models' defaults
        try:
            torch.manual_seed(seed)  # HF samples from the global generator
            start = time.perf_counter()
            output = self.target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=self.draft,
                max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=self.eos_token_ids,
                pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None, repetition_penalty=1.0,
                streamer=streamer, **sampling)
            wall = time.perf_counter() - start
        finally:
            hf_logging.set_verbosity(verbosity)
            draft_counter.remove()
            target_counter.remove()
            self.draft.generation_config = saved
        token_ids = output[0, input_ids.shape[1]:].tolist()
        stats = _peer_stats(len(prompt_ids), target_counter.fed, streamer.rounds)
        stats.generated_tokens = len(token_ids)
        stats.draft_forward_passes, stats.target_forward_passes = draft_counter.passes, target_counter.passes
        stats.draft_time_s, stats.target_time_s, stats.wall_time_s = draft_counter.seconds, target_counter.seconds, wall
        finish = FINISH_STOP if token_ids and token_ids[-1] in self.eos_token_ids else FINISH_LENGTH
        return PeerResult(token_ids, finish, stats)


def _peer_stats(prompt_tokens: int, target_fed: list[int], rounds: list[list[int]]) -> RequestStats:
    """One record_round per target pass: candidates = positions fed beyond the committed sequence,
    accepted = committed tokens minus the target's own (correction or bonus) token.

    Worked example: prompt of 10 tokens; the first pass feeds 14 positions (the prompt plus 4
    candidates) and the streamer gets 3 tokens: 4 candidates, 2 accepted. The next pass feeds 6
    positions (the last committed token plus 5 candidates): 5 candidates.
    """
    stats = RequestStats()
    for index, (fed, committed) in enumerate(zip(target_fed, rounds)):
        candidates = fed - (prompt_tokens if index == 0 else 1)
        accepted = max(min(len(committed) - 1, candidates), 0)
        stats.record_round(candidates, accepted)
    return stats


# llama-cpp-python's advice for its prompt lookup draft: 10 tokens "generally good for gpu, 2
# performs better for cpu-only machines" (its README): the CPU setting, what this peer runs by default.
LOOKUP_CPU_TOKENS = 2
LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's default max_ngram_size
LOOKUP_SLACK = 64  # context past a run's longest sequence: a step's draft tokens go past its end


class LlamaLookupPeer:
    """llama-cpp-python's `Llama(draft_model=LlamaPromptLookupDecoding(...))` on the target's GGUF
    file and threads, `context` positions (its logits buffer holds a row for each): its greedy (or temperature-only) decoding
    with the n-gram lookup of the prompt and output proposing up to `num_pred_tokens` a step. It
    counts nothing but tokens and wall time (its rounds happen inside `Llama.generate`)."""

    def __init__(self, gguf: str, threads: int | None, context: int, eos_token_ids: Sequence[int]):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.eos_token_ids = set(eos_token_ids)
        self._tokens = None
        self._lookup = LlamaPromptLookupDecoding
        # With a draft model llama-cpp-python keeps every position's logits, in a buffer of n_ctx rows
        # only where logits_all is asked for (else n_batch rows, overrun past 512 tokens: 0.3.36).
        self.llm = Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, logits_all=True,
                         draft_model=LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM,
                                                               num_pred_tokens=LOOKUP_CPU_TOKENS), verbose=False)

    def generate(self, prompt_ids: Sequence[int], num_pred_tokens: int, max_new_tokens: int, temperature: float,
                 seed: int) -> PeerResult:
        if self._tokens != num_pred_tokens:
            self.llm.draft_model = self._lookup(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=num_pred_tokens)
            self._tokens = num_pred_tokens
        self.llm.set_seed(seed)
        token_ids, finish = [], FINISH_LENGTH
        start = time.perf_counter()
        for token in self.llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0, reset=True):
            if token in self.eos_token_ids:
                finish = FINISH_STOP
                break
            token_ids.append(int(token))
            if len(token_ids) >= max_new_tokens:
                break
        stats = RequestStats(generated_tokens=len(token_ids), wall_time_s=time.perf_counter() - start)
        return PeerResult(token_ids, finish, stats)

    def close(self) -> None:
        """Free llama.cpp's model and context now (the target's weights, mapped a second time)."""
        self.llm.close()
