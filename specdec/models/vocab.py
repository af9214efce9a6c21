"""A draft whose LM head scores only part of the vocabulary.

Any draft distribution q keeps decoding lossless: verification accepts y with probability
min(1, p(y) / q(y)) and otherwise draws from norm(max(0, p - q)), so the output is the target's
whatever q is (greedy: exact match against the target's argmax). A draft that gives q = 0 to tokens
a workload never uses loses acceptance only where the target picks one of them, and its step skips
that part of the largest matrix a small model has: the default 0.5B draft's 151,936 x 896 LM head is
about 27% of its weights, and a drafting step reads all of them (docs/performance.md, "Where a draft
step goes, and a trimmed draft vocabulary").

Vocabularies (`--draft-vocab`):
- `full`: every token (the stock head).
- `ascii`: the tokens whose text is printable ASCII or whitespace (code, English), every special and
  added token, and the single-byte tokens, so any text can still be spelled.
- a path to a JSON list of token ids (for instance the ids a deployment's own traffic uses).

A draft before a target whose embedding has another number of rows (padding past the tokenizer's
last id: Qwen2.5's 0.5B-3B have 151,936, its 7B-32B 152,064) scores only the ids below the smaller
of the two and the tokenizer's count (`shared_ids`), its logits cut there and widened to the
target's, -inf past them (`widen_logits`, models/runtime.py `DraftRole.fit_vocabulary`, on every
runtime): it never proposes an id the target has no row for, and q is the distribution it drew
from, at p's width.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import torch
from torch import nn

from specdec.errors import ModelSourceError
from specdec.files import file_setting

FULL, ASCII = "full", "ascii"
# The setting a bench run or dataset that records no `draft_vocab` was made with: the full vocabulary.
SETTINGS_BEFORE_DRAFT_VOCAB = {"draft_vocab": FULL}
_PRINTABLE = frozenset(string.printable)  # letters, digits, punctuation and whitespace
_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # sentencepiece's byte tokens


class TrimmedLMHead(nn.Module):
    """`lm_head` restricted to the rows `keep`; returns logits over the full vocabulary with -inf
    (q = 0) at every other id, so samplers and verification see the usual [.., V] shape."""

    def __init__(self, lm_head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        if not isinstance(lm_head, nn.Linear):  # a weight format already applied: trim first
            raise TypeError(f"can only trim a plain nn.Linear LM head, not {type(lm_head).__name__}")
        if len(keep) == 0 or int(keep.min()) < 0 or int(keep.max()) >= lm_head.out_features:
            raise ModelSourceError(f"a draft vocabulary must list token ids in [0, {lm_head.out_features})")
        self.vocab_size = lm_head.out_features
        keep = keep.to(device=lm_head.weight.device, dtype=torch.long)
        self.proj = nn.Linear(lm_head.in_features, len(keep), bias=lm_head.bias is not None,
                              device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(lm_head.weight[keep])  # a copy: the input embedding it was tied to stays whole
            if lm_head.bias is not None:
                self.proj.bias.copy_(lm_head.bias[keep])
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.proj(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.keep, scores)


def widen_logits(logits: torch.Tensor, shared: int, width: int) -> torch.Tensor:
    """logits [..., >= shared] -> [..., width]: the first `shared` as they are, -inf (q = 0) past them."""
    if logits.shape[-1] == shared == width:
        return logits
    return torch.nn.functional.pad(logits[..., :shared], (0, width - shared), value=float("-inf"))


def trim_lm_head(model: nn.Module, keep: list[int]) -> nn.Module:
    """Replace the model's output layer by a `TrimmedLMHead` over `keep` (before any weight format,
    so the smaller matrix is the one that gets quantized or reordered)."""
    model.lm_head = TrimmedLMHead(model.lm_head, torch.tensor(sorted(set(keep))))
    return model


def shared_ids(draft_rows: int, target_rows: int, tokens: int) -> int | None:
    """How many first ids a draft of `draft_rows` rows scores before a target of `target_rows`, whose
    tokenizer has `tokens` ids: where the rows differ (padding), those below the smaller and the
    tokenizer's count, so it proposes neither its own padding rows nor an id the target lacks; None
    where they are the same (the draft as it is)."""
    return None if draft_rows == target_rows else min(draft_rows, target_rows, tokens)


def tokenizer_ids(tokenizer) -> int:
    """The tokenizer's ids before the padding a GGUF lists as tokens past its last one
    (convert_hf_to_gguf.py's unused "[PAD<id>]": a Qwen2.5 GGUF's tokenizer, as transformers reads
    it, has 151,936 ids, its last 271 such): `shared_ids`' `tokens`, where it counted them, left a
    draft's own padding rows below a larger target's proposable."""
    count = len(tokenizer)
    while count and tokenizer.convert_ids_to_tokens(count - 1) == f"[PAD{count - 1}]":
        count -= 1
    return count


def ascii_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids below `vocab_size` (the model's rows) whose decoded text is printable ASCII, plus special,
    added and single-byte tokens. Ids the tokenizer does not know decode to "" and are left out."""
    ids = range(vocab_size)
    texts = tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    always = special_token_ids(tokenizer)
    return [i for i, text, piece in zip(ids, texts, pieces)
            if (text and _PRINTABLE.issuperset(text)) or i in always or is_byte_token(piece)]


def special_token_ids(tokenizer) -> set[int]:
    """Every special and added token's id: a trimmed vocabulary keeps them all (end of turn, ...)."""
    return {i for i in [*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder] if i is not None}


def is_byte_token(piece: str | None) -> bool:
    """A byte-level BPE base symbol (one character stands for one byte) or a byte-fallback token."""
    return piece is not None and (len(piece) == 1 or bool(_BYTE_FALLBACK.match(piece)))


def resolve_draft_vocab(vocab: str, vocab_size: int, load_tokenizer=None) -> list[int] | None:
    """The ids a draft keeps (None: all of them) for a `--draft-vocab` value; `load_tokenizer()`
    gives the draft's tokenizer, which only `ascii` needs."""
    if vocab == FULL:
        return None
    if vocab == ASCII:
        return ascii_token_ids(load_tokenizer(), vocab_size)
    ids = read_vocab_file(vocab)
    if not all(i < vocab_size for i in ids):
        raise ModelSourceError(f"--draft-vocab {vocab}: must be a non-empty JSON list of token ids in "
                               f"[0, {vocab_size})")
    return ids


def check_draft_vocab(vocab: str) -> None:
    """A `--draft-vocab` value checked before any model loads: a name, or a file that lists ids
    (their range is checked against the draft's vocabulary when it loads)."""
    if vocab not in (FULL, ASCII):
        read_vocab_file(vocab)


def read_vocab_file(vocab: str) -> list[int]:
    """The ids a `--draft-vocab` file lists: a non-empty JSON list of non-negative ints."""
    try:
        ids = json.loads(Path(vocab).read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"--draft-vocab {vocab!r}: expected 'full', 'ascii' or a JSON file listing token ids "
                               f"({type(exc).__name__})") from None
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        raise ModelSourceError(f"--draft-vocab {vocab}: must be a non-empty JSON list of token ids")
    return ids


def vocab_setting(vocab: str) -> str:
    """How a run records its draft vocabulary: the name, or the file's `file_setting` (an edited
    list is another vocabulary)."""
    return vocab if vocab in (FULL, ASCII) else file_setting(vocab)
