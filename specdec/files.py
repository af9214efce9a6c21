"""Small file helpers the runs share: how a file a run reads is recorded, and writing a file so
that a run killed mid-write leaves the old one or the new one, never half of either."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def file_setting(path: str | Path) -> str:
    """How a run records a file it reads (a vocabulary, a prompt list): its absolute path and a
    content hash, so that an edited file is another setting."""
    path = Path(path).expanduser().resolve()
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        digest = "missing"
    return f"{path}#{digest}"


def write_atomically(path: str | Path, text: str) -> None:
    """`path` holds `text`, written under a temporary name of its own (two writers never share one;
    the file takes the umask's mode, as a plain write) and renamed over it."""
    with written_together(path) as (partial,):
        partial.write_text(text, encoding="utf-8")


@contextmanager
def written_together(*paths: str | Path) -> Iterator[list[Path]]:
    """Temporary names for `paths`, to write them under; once all are written, each is renamed over
    its path, one right after the other (a model's weights and its config: a run killed while
    writing them left new weights beside the old config, or weights cut short)."""
    partials = [Path(p).with_name(f"{Path(p).name}.{os.getpid()}-{threading.get_ident()}.partial") for p in paths]
    try:
        yield partials
        for partial, path in zip(partials, paths):
            os.replace(partial, path)
    finally:
        for partial in partials:
            partial.unlink(missing_ok=True)
