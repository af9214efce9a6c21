"""SessionStore: the bounded LRU + TTL store of a worker's per-session state."""

from __future__ import annotations

import pytest

from specdec.sessions import SessionStore


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_evicts_least_recently_used():
    store: SessionStore[int] = SessionStore(max_sessions=2)
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1
    store.put("c", 3)
    assert "b" not in store and store.get("a") == 1 and store.get("c") == 3 and len(store) == 2
    for i in range(100):
        store.put(str(i), i)
    assert len(store) == 2


def test_store_expires_idle_sessions():
    clock = FakeClock()
    store: SessionStore[str] = SessionStore(max_sessions=10, ttl_s=10.0, clock=clock)
    store.put("a", "A")
    clock.now = 5.0
    store.put("b", "B")
    clock.now = 9.0
    assert store.get("a") == "A"  # touched: idle time restarts
    clock.now = 15.0
    assert store.evict_expired() == 1 and "b" not in store
    clock.now = 19.0
    assert store.get("a") is None and len(store) == 0


def test_store_pop_and_replace():
    store: SessionStore[int] = SessionStore(max_sessions=3)
    store.put("a", 1)
    store.put("a", 2)
    assert len(store) == 1 and store.pop("a") == 2 and store.pop("a") is None
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)
