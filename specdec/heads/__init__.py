"""Acceptance heads shipped with the package, one directory per default model pair.

`default-pair/` was trained for the default draft (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF) by
`specdec train-head --config cluster/training/default-pair.yaml --sweep`; its report is
docs/training.md. A head records the identity of its draft, so loading it for another draft fails.
"""

from __future__ import annotations

from pathlib import Path

from specdec.head import CONFIG_FILE, WEIGHTS_FILE

HEADS_DIR = Path(__file__).resolve().parent
SHIPPED = {"default": HEADS_DIR / "default-pair"}  # draft source -> its shipped head
AUTO, NONE = "auto", "none"


def resolve_head(head: str | None, draft: str) -> str | None:
    """The head directory an engine loads: `auto` is the head shipped for `draft` (None when there
    is none), `none` or empty means no head, anything else is a path."""
    if not head or head == NONE:
        return None
    if head == AUTO:
        shipped = SHIPPED.get(draft)
        if shipped is None or not (shipped / CONFIG_FILE).is_file() or not (shipped / WEIGHTS_FILE).is_file():
            return None
        return str(shipped)
    return head
