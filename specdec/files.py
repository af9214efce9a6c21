"""Small file helpers the runs share: how a file a run reads is recorded, writing a file so that a
run killed mid-write leaves the old one or the new one, never half of either, and a lock a run
holds on what it writes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
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


@contextmanager
def held(path: str | Path, error: type[Exception], what: str, instead: str) -> Iterator[None]:
    """The lock file `path` held by this process for the block. Where another process holds it,
    `error("<what> by <that process>; wait for it to end, or <instead>")` at once; where it cannot
    be locked (NFS without its lock service, another user's file), `error` saying so. An flock: the
    kernel lets go of it however the process ends, so a run killed leaves nothing to clean up. On
    NFS it holds between the hosts that mount it only where they lock through the server."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.open("a+")
    except OSError as exc:
        raise error(f"{path}: cannot lock it ({exc.strerror or exc})") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise error(f"{what} by {holder}; wait for it to end, or {instead}") from None
        except OSError as exc:
            raise error(f"{path}: cannot lock it ({exc.strerror or exc})") from None
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        yield
