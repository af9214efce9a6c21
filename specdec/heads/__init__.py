"""Acceptance heads shipped with the package, one directory per default model pair.

`default-pair/` was trained for the default draft (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF) by
`specdec train-head --config cluster/training/default-pair.yaml --sweep`; its report is
docs/training.md. A head records the identity of its draft, so loading it for another draft fails.
"""

from __future__ import annotations

from pathlib import Path

from specdec.drafts import draft_dir
from specdec.head import CONFIG_FILE, WEIGHTS_FILE

HEADS_DIR = Path(__file__).resolve().parent
SHIPPED = {"default": HEADS_DIR / "default-pair"}  # draft source -> its shipped head
AUTO, NONE = "auto", "none"


DRAFT_HEAD = "head"  # a head kept in its draft's directory (a feature draft's: docs/feature-draft.md)


def resolve_head(head: str | None, draft: str) -> str | None:
    """The head directory an engine loads: `auto` is the head shipped for `draft`, else the one in
    the draft's own directory (`head/`), else None; `none` or empty means no head, anything else is
    a path."""
    if not head or head == NONE:
        return None
    if head == AUTO:
        for found in (SHIPPED.get(draft), draft_dir(draft) / DRAFT_HEAD):
            if found is not None and (found / CONFIG_FILE).is_file() and (found / WEIGHTS_FILE).is_file():
                return str(found)
        return None
    return head
