"""Bounded per-session state on a replica: an LRU + TTL store.

A replica's session state (KV cache, history, policy) is a cache of the coordinator's history, so
dropping an entry only costs a re-prefill (the next call answers `session_missing` and the caller
resends the full history). That is what lets the store bound its memory: at most `max_sessions`
entries, and none idle for longer than `ttl_s`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_MAX_SESSIONS = 256  # KV caches of short chats on one replica; the config may change it
DEFAULT_TTL_S = 600.0  # a session idle for 10 minutes is abandoned (its client went away)
SWEEP_INTERVAL_S = 1.0  # how often get and put drop the expired entries


class SessionStore(Generic[T]):
    """Thread-safe map session id -> state, least recently used first.

    Worked example (max_sessions=2): put a, put b, get a, put c -> b is evicted (a was used more
    recently). With ttl_s=10: an entry last used at t=0 is gone from t=10 on.
    """

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.max_sessions, self.ttl_s, self._clock = max_sessions, ttl_s, clock
        self._entries: OrderedDict[str, tuple[T, float]] = OrderedDict()  # id -> (state, last used)
        self._lock = threading.Lock()
        self._swept = float("-inf")  # when the expired entries were last dropped

    def get(self, session_id: str) -> T | None:
        """The session's state (and mark it used), or None when absent or expired."""
        with self._lock:
            now = self._clock()
            self._sweep(now)
            found = self._entries.get(session_id)
            if found is None or now - found[1] >= self.ttl_s:
                return None
            self._entries[session_id] = (found[0], now)
            self._entries.move_to_end(session_id)
            return found[0]

    def put(self, session_id: str, state: T) -> None:
        """Insert or replace; evicts expired entries, then the least recently used beyond the cap."""
        with self._lock:
            now = self._clock()
            self._sweep(now)
            self._entries[session_id] = (state, now)
            self._entries.move_to_end(session_id)
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)

    def pop(self, session_id: str) -> T | None:
        """Remove and return the session's state (None when absent)."""
        with self._lock:
            found = self._entries.pop(session_id, None)
            return None if found is None else found[0]

    def evict_expired(self) -> int:
        """Drop every entry idle for ttl_s or longer; returns how many were dropped."""
        with self._lock:
            return self._evict_expired(self._clock())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._entries

    def _sweep(self, now: float) -> None:
        """`_evict_expired` at most once a second of the clock: every session of a step gets and puts
        its entry, and an entry's own expiry is checked where it is read."""
        if now - self._swept >= SWEEP_INTERVAL_S:
            self._swept = now
            self._evict_expired(now)

    def _evict_expired(self, now: float) -> int:
        # Entries are ordered by last use, so the expired ones are a prefix.
        dropped = 0
        while self._entries:
            _, last_used = next(iter(self._entries.values()))
            if now - last_used < self.ttl_s:
                break
            self._entries.popitem(last=False)
            dropped += 1
        return dropped
