"""The llama.cpp runtime: the batched draft and target interface of models/runtime.py on llama.cpp's
CPU kernels, reading a GGUF file as it is (no conversion, no fp32 copy).

One llama.cpp context per model holds every session as a sequence (`seq_id`) of one unified KV
cache. A pass is one or more `llama_decode` calls over a batch whose tokens carry their session's
sequence id and position, the same ragged layout as the torch runtime: a drafting step of 8
sessions is 8 tokens, a verification of K = 3 and K = 9 is 4 + 10 tokens. Outputs (logits, and for
the draft the final hidden state: embeddings with pooling NONE, taken after the output norm as
transformers' last_hidden_state) are read only at the positions a feed asks for; llama.cpp computes
them at every token of a pass while hidden states are on, so the draft runs a long pass's unread
tokens (a prefill, a catch-up) with them off first. Rollback is `llama_memory_seq_rm` from the kept
length on; a recurrent or hybrid model (Mamba, LFM2), whose state llama.cpp cannot cut back, loses
the session's whole sequence instead and re-prefills it at its next pass.

Sequences and cache cells are finite, and a session's cache is only a cache (models/runtime.py):
a session gets a sequence from the runtime's slot pool (models/pool.py) at its first pass; when none
is free, or a pass finds no room in the cache, the least recently used sessions outside the pass
lose theirs (their next call re-prefills).

llama.cpp's numerics depend on how many tokens share a pass (its matrix kernels differ by batch
size), so a verification pass over K + 1 tokens can score a token slightly differently from
plain one-token decoding; docs/performance.md reports how often that changes a greedy token.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.errors import ModelSourceError, SpecDecError
from specdec.models.pool import SlotPool
from specdec.models.runtime import MAX_THREADS, DraftRole, Feed, KVSession, PassOutputs, Runtime, TargetRole

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
DEFAULT_SEQUENCES = 64
DEFAULT_CONTEXT = 8192  # cache cells shared by every session of a model (f16 keys and values)
C_INT32_MAX = 2**31 - 1  # past it ctypes cuts a number of llama.cpp's context settings to its low bits
DEFAULT_BATCH = 512  # tokens per llama_decode call; a larger pass takes several
NO_KV_SLOT = 1  # llama_decode: no room in the cache for the batch
# With hidden states on (the draft), llama.cpp outputs logits and hidden states at every token of a
# pass, read or not. A pass with at least this many unread tokens (a prefill, a catch-up) runs them
# first with hidden states off, then the read ones: one more pass over the weights, against the
# output layer (a third of the default draft's weights) over each unread token: it pays from a few
# unread tokens on (docs/performance.md, "A draft for llama.cpp's fast kernels").
SILENT_PASS_MIN_TOKENS = 4
# llama.cpp's AMX kernels crash on Q4_K weights (ggml-org/llama.cpp#20824, closed unfixed); a build
# compiled with AMX (-march=native on an AMX CPU) then runs without its extra (repacked) buffers.
AMX_BUILD_MARK = "AMX_INT8 = 1"
NO_AMX_CMAKE_ARGS = "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"


class LlamaCppError(SpecDecError):
    """llama.cpp failed a pass (not a bad request: the runtime's own failure)."""


_library = None


def library():
    """llama_cpp's ctypes bindings, initialised once, with llama.cpp's logging silenced."""
    global _library
    if _library is None:
        try:
            import llama_cpp
        except ImportError:
            raise ModelSourceError("the llamacpp runtime needs llama-cpp-python "
                                   "(pip install llama-cpp-python==0.3.36, built from source)") from None
        llama_cpp.llama_backend_init()
        # Kept on the module: ctypes would free a callback llama.cpp still calls.
        llama_cpp._specdec_quiet_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(llama_cpp._specdec_quiet_log, ctypes.c_void_p())
        _library = llama_cpp
    return _library


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def amx_build() -> bool:
    return AMX_BUILD_MARK in library().llama_print_system_info().decode(errors="replace")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's or a Slurm job's
    cpuset), which torch's default threads follow too. os.cpu_count() counts the machine's, and
    llama.cpp's threads wait for each other spinning: more threads than cores slow every pass."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # (no affinity outside Linux)
        return os.cpu_count() or 1


class LlamaCppOptions(BaseModel):
    """A llama.cpp context's settings (the `llamacpp` section of an engine config)."""

    model_config = ConfigDict(extra="forbid")

    # None: every core the process may run on (available_cores)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    sequences: int = Field(DEFAULT_SEQUENCES, ge=1, le=MAX_SEQUENCES)  # sessions with a cache at once
    # cache cells shared by all sessions; one session's limit too (llama.cpp's fields are 32-bit)
    context: int = Field(DEFAULT_CONTEXT, ge=16, le=C_INT32_MAX)
    batch: int = Field(DEFAULT_BATCH, ge=1, le=C_INT32_MAX)  # tokens per llama_decode call

    @model_validator(mode="after")
    def _room_for_every_sequence(self) -> LlamaCppOptions:
        # llama.cpp aborts the process when a pass's outputs, one per sequence at least, outgrow its
        # batch (which it caps at the context)
        if min(self.context, self.batch) < self.sequences:
            raise ValueError(f"a context and a batch of at least {self.sequences} tokens (one per sequence) are "
                             f"needed, got context {self.context} and batch {self.batch}; lower sequences or raise them")
        return self


MADV_DONTNEED = 4  # Linux


def release_mapped_pages(path: Path) -> int:
    """Drop this process's resident pages of `path`'s read-only mappings (Linux; elsewhere nothing);
    returns the bytes of mappings advised. llama.cpp maps a GGUF shared and read-only with
    MAP_POPULATE, then copies most weights into repacked buffers of its own: without this the
    mapped copy stays resident beside them (the default pair's 1.6 GB twice). Pages still read (the
    tensors left in the mapping: embeddings, norms) fault back in from the page cache."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    target, released = str(Path(path).resolve()), 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target and "w" not in fields[1]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start, MADV_DONTNEED) == 0:
                released += end - start
    return released


class LlamaCppModel:
    """One GGUF model and its llama.cpp context: decode calls over tokens of many sequences."""

    context = model = None

    def __init__(self, path: Path, options: LlamaCppOptions, hidden: bool):
        lib = library()
        self.lib, self.path, self.hidden = lib, Path(path), hidden
        model_params = lib.llama_model_default_params()
        if amx_build():
            model_params.use_extra_bufts = False
            print(f"specdec: this llama.cpp build has AMX kernels, which crash on Q4_K weights; running "
                  f"without repacked weights (slower). Rebuild with CMAKE_ARGS='{NO_AMX_CMAKE_ARGS}'",
                  file=sys.stderr)
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self.model:
            raise ModelSourceError(f"llama.cpp cannot load {self.path}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = options.context, options.sequences, True
        params.n_batch = params.n_ubatch = options.batch
        params.n_threads = params.n_threads_batch = self.threads = options.threads or available_cores()
        params.embeddings = hidden
        params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        self.context = lib.llama_init_from_model(self.model, params)
        if not self.context:
            lib.llama_model_free(self.model)
            raise ModelSourceError(f"llama.cpp cannot create a context for {self.path} "
                                   f"({options.context} cells, {options.sequences} sequences)")
        self.memory = lib.llama_get_memory(self.context)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.n_embd = lib.llama_model_n_embd(self.model)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.model)
        # The cells asked for: llama.cpp rounds its context up to a multiple of 256, and the builder,
        # the CLI's checks and a served coordinator limit sessions to `options.context` as given.
        self.n_ctx = min(lib.llama_n_ctx(self.context), options.context)
        # (llama.cpp caps a batch at its context: a chunk longer than the batch it took aborts the process)
        self.n_batch = min(lib.llama_n_batch(self.context), lib.llama_n_ubatch(self.context))
        self.hidden_on = hidden
        self._batch = lib.llama_batch_init(options.batch, 0, 1)
        release_mapped_pages(self.path)

    def decode(self, seqs: list[int], positions: list[int], tokens: list[int], outputs: list[bool]) -> int:
        """One llama_decode over len(tokens) <= n_batch tokens; returns llama.cpp's status."""
        batch = self._batch
        for i, (seq, pos, token, out) in enumerate(zip(seqs, positions, tokens, outputs)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(tokens)
        return self.lib.llama_decode(self.context, batch)

    def set_hidden(self, on: bool) -> None:
        """Hidden states on (every token of a pass is an output) or off (only the flagged ones)."""
        if on != self.hidden_on:
            self.lib.llama_set_embeddings(self.context, on)
            self.hidden_on = on

    def logits(self, index: int) -> np.ndarray:
        """[V] fp32 logits of the batch's token `index` (flagged as an output), copied."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.context, index), shape=(self.n_vocab,)).copy()

    def embedding(self, index: int) -> np.ndarray:
        """[H] the final hidden state of the batch's token `index`, copied."""
        return np.ctypeslib.as_array(self.lib.llama_get_embeddings_ith(self.context, index), shape=(self.n_embd,)).copy()

    def remove(self, seq: int, start: int) -> bool:
        """Drop sequence `seq`'s positions from `start` on; False where llama.cpp cannot cut it there
        (a recurrent or hybrid model: one state per sequence), which leaves it as it was."""
        return self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def close(self) -> None:
        """Free the batch, context and model (a second call does nothing)."""
        if self.context:
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.context)
            self.lib.llama_model_free(self.model)
            self.context = self.model = self.memory = None

    def __del__(self):
        self.close()


class LlamaCppRuntime(Runtime):
    """A GGUF model on llama.cpp serving many sessions per pass (see the module docstring)."""

    kind = "llamacpp"

    def __init__(self, path: str | Path, identity: str = "", name: str = "",
                 options: LlamaCppOptions = LlamaCppOptions(), hidden: bool = False):
        self.llama = LlamaCppModel(Path(path), options, hidden)
        self.identity, self.name = identity, name
        self.forward_passes = 0
        self.sequences = self.max_pass_sessions = options.sequences
        self.max_cached_positions = self.llama.n_ctx
        self.pool = SlotPool(options.sequences, free=lambda seq: self.llama.remove(seq, 0))  # sessions' sequences

    def close(self) -> None:
        """Free the llama.cpp model and context now (engine.close()): the slot pool's free callback
        holds the runtime in a reference cycle, so they would wait for the garbage collector."""
        self.llama.close()

    def _check_open(self) -> None:
        if not self.llama.context:  # (llama.cpp would read freed memory)
            raise LlamaCppError(f"the llama.cpp model {self.llama.path.name} was closed; build the engine again")

    @property
    def vocab_size(self) -> int:
        return self.llama.n_vocab

    @property
    def hidden_size(self) -> int:
        return self.llama.n_embd

    @property
    def max_context(self) -> int:
        return min(self.llama.n_ctx_train, self.llama.n_ctx)

    def new_session(self) -> KVSession:
        return KVSession()  # a sequence is attached at its first pass

    def rollback(self, session: KVSession, length: int) -> None:
        self._check_open()
        if length < len(session.tokens):
            if session.handle is not None and not self.llama.remove(session.handle, length):
                # A recurrent or hybrid model's state (Mamba, LFM2) holds every position it has seen:
                # left as it is, the rejected candidates stay in it and the next pass's positions
                # break the sequence. The whole sequence goes (that never fails) and re-prefills.
                self.llama.remove(session.handle, 0)
                length = 0
            del session.tokens[length:]

    @torch.inference_mode()
    def _forward(self, feeds: list[Feed]) -> PassOutputs:
        self._check_open()
        for feed in feeds:  # llama.cpp aborts the process on a sequence longer than its cache
            if len(feed.session.tokens) + len(feed.tokens) > self.llama.n_ctx:
                raise LlamaCppError(f"a session of {len(feed.session.tokens) + len(feed.tokens)} positions does not "
                                    f"fit llama.cpp's cache of {self.llama.n_ctx} (raise the llamacpp context)")
        self.pool.reclaim()
        logits: list[np.ndarray] = []
        hidden: list[np.ndarray] = []
        # A pass of more sessions than sequences runs as several; a group may take the sequences
        # of the groups before it (their outputs are read), never of its own or later ones.
        for start in range(0, len(feeds), self.sequences):
            self._forward_group(feeds[start:start + self.sequences], feeds[start:], logits, hidden)
        flat_logits = torch.from_numpy(np.stack(logits)) if logits else torch.empty((0, self.vocab_size))
        flat_hidden = torch.from_numpy(np.stack(hidden)) if hidden else torch.empty((len(logits), 0))
        return PassOutputs(flat_logits, flat_hidden, PassOutputs.bounds_of(feeds))

    def _forward_group(self, feeds: list[Feed], protected: list[Feed], logits: list[np.ndarray],
                       hidden: list[np.ndarray]) -> None:
        """Run one group's feeds, appending their output rows to `logits` and `hidden`, feed by feed."""
        for feed in feeds:  # groups fit the sequences: a session always gets one
            if not self.pool.attach(feed.session, [f.session for f in protected]):
                raise LlamaCppError("no llama.cpp sequence to spare")
        # The pass as flat token entries: (feed index, token, wanted as an output).
        entries = [(f, token, j >= len(feed.tokens) - feed.num_outputs)
                   for f, feed in enumerate(feeds) for j, token in enumerate(feed.tokens)]
        n = self.llama.n_batch
        for chunk in [part[start:start + n] for part in self._parts(entries) for start in range(0, len(part), n)]:
            if self.llama.hidden:  # off for a chunk of unread tokens only
                self.llama.set_hidden(any(wanted for _, _, wanted in chunk))
            self._decode(feeds, chunk, protected)
            for i, (_, _, wanted) in enumerate(chunk):
                if wanted:  # read tokens come feed by feed, each feed's in order (_parts keeps it)
                    logits.append(self.llama.logits(i))
                    if self.llama.hidden:
                        hidden.append(self.llama.embedding(i))
        self.forward_passes += 1

    def _parts(self, entries: list[tuple[int, int, bool]]) -> list[list[tuple[int, int, bool]]]:
        """The pass as one part, or with hidden states on as its unread tokens then its read ones
        (SILENT_PASS_MIN_TOKENS); a feed's read tokens are its last, so each part keeps every
        session's positions in order."""
        silent = [entry for entry in entries if not entry[2]]
        if not self.llama.hidden or len(silent) < SILENT_PASS_MIN_TOKENS:
            return [entries]
        return [silent, [entry for entry in entries if entry[2]]]

    def _decode(self, feeds: list[Feed], chunk: list[tuple[int, int, bool]], protected: list[Feed]) -> None:
        """Decode one chunk, making room in the cache when it is full; extends the sessions' tokens."""
        while True:
            seqs, positions, tokens, outputs = [], [], [], []
            offsets: dict[int, int] = {}
            for f, token, wanted in chunk:
                session = feeds[f].session
                seqs.append(session.handle)
                positions.append(len(session.tokens) + offsets.get(f, 0))
                offsets[f] = offsets.get(f, 0) + 1
                tokens.append(token)
                outputs.append(wanted)
            status = self.llama.decode(seqs, positions, tokens, outputs)
            if status == 0:
                for f, token, _ in chunk:
                    feeds[f].session.tokens.append(token)
                return
            if status != NO_KV_SLOT or not self.pool.evict_one([f.session for f in protected]):
                raise LlamaCppError(f"llama.cpp decode failed (status {status}) for {len(tokens)} tokens of "
                                    f"{len(offsets)} sessions; the cache holds {self.llama.n_ctx} positions")


class LlamaCppDraftRuntime(DraftRole, LlamaCppRuntime):
    """The draft on llama.cpp: logits and the final hidden state the head reads."""

    def __init__(self, path: str | Path, identity: str = "", name: str = "",
                 options: LlamaCppOptions = LlamaCppOptions()):
        super().__init__(path, identity, name, options, hidden=True)


class LlamaCppTargetRuntime(TargetRole, LlamaCppRuntime):
    """The target on llama.cpp: logits only."""
