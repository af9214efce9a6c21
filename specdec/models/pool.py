"""A fixed set of cache slots shared by sessions: llama.cpp's sequences (models/llamacpp.py), the
static cache's rows (models/static.py `StaticKV`).

A session gets a slot at its first pass (`KVSession.handle`); when none is free, the least recently
used session outside the pass loses its own (its cache empties, so its next call re-prefills: a
cache is only a cache, models/runtime.py). A session dropped anywhere (released, evicted, failed)
hands its slot back through a finalizer, which only queues the id (`reclaim` frees it on the
runtime's own thread, before its next pass).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from specdec.models.cache import KVSession


class SlotPool:
    def __init__(self, size: int, free: Callable[[int], None] = lambda slot: None):
        """`free(slot)` empties a slot's cache (llama.cpp: remove the sequence's cells)."""
        self.size, self._free_cache = size, free
        self._free = list(range(size - 1, -1, -1))  # a stack of unused slots, 0 on top
        self._owners: OrderedDict[int, tuple[weakref.ref, weakref.finalize]] = OrderedDict()  # LRU first
        self._dropped: deque[int] = deque()  # slots of sessions gone; appended from any thread

    def attach(self, session: KVSession, keep: Iterable[KVSession]) -> bool:
        """Give the session a slot (its own, or a free or evicted one: never one of `keep`'s) and
        mark it recently used; False when every slot is kept."""
        if session.handle is not None and session.handle in self._owners:
            self._owners.move_to_end(session.handle)
            return True
        if not self._free and not self.evict_one(keep):
            return False
        slot = self._free.pop()
        session.handle = slot
        session.tokens.clear()
        finalizer = weakref.finalize(session, self._dropped.append, slot)
        self._owners[slot] = (weakref.ref(session), finalizer)
        return True

    def evict_one(self, keep: Iterable[KVSession]) -> bool:
        """Take the slot of the least recently used session outside `keep`; False if none."""
        kept = {id(session) for session in keep}
        for slot, (ref, _) in self._owners.items():
            session = ref()
            if session is None or id(session) not in kept:
                self._release(slot)
                if session is not None:
                    session.handle = None
                    session.tokens.clear()
                return True
        return False

    def reclaim(self) -> None:
        """Free the slots of sessions dropped since the last call."""
        while self._dropped:
            slot = self._dropped.popleft()
            if slot in self._owners and self._owners[slot][0]() is None:
                self._release(slot)

    def _release(self, slot: int) -> None:
        _, finalizer = self._owners.pop(slot)
        finalizer.detach()
        self._free_cache(slot)
        self._free.append(slot)
