"""services/metrics.py: the series the coordinator records (Ray's metric classes replaced by a
recorder: what reaches them, with which labels)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from specdec.cost_profile import CostProfile


@pytest.fixture
def series(monkeypatch):
    """name -> {labels: value} of every series RayRoundMetrics records."""
    import services.metrics

    recorded: dict[str, dict] = defaultdict(dict)

    class Recorder:
        def __init__(self, name, description="", tag_keys=(), boundaries=None):
            self.name, self.tag_keys = name, tag_keys

        def _key(self, tags):
            assert set(tags or {}) == set(self.tag_keys), (self.name, tags)
            return tuple(sorted((tags or {}).items()))

        def inc(self, value=1, tags=None):
            key = self._key(tags)
            recorded[self.name][key] = recorded[self.name].get(key, 0) + value

        def observe(self, value, tags=None):
            self.inc(1, tags)

        def set(self, value, tags=None):
            recorded[self.name][self._key(tags)] = value

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(services.metrics.metrics, kind, Recorder)
    return recorded


def test_accepted_positions_past_16_share_one_label(series):
    """A round of 600 accepted candidates made 600 series (k is the client's)."""
    from services.metrics import RayRoundMetrics

    RayRoundMetrics().on_round(600, 600, "fixed")
    positions = {dict(key)["position"]: n for key, n in series["specdec_spec_decode_num_accepted_tokens_per_pos"].items()}
    assert len(positions) == 17 and positions["1"] == positions["16"] == 1 and positions["17+"] == 584


def test_each_drafts_costs_are_its_own_series_by_timing_bucket(series):
    """Two drafts' planners share the observer: the second overwrote the first's; and a bucket's
    median tokens moved as it was timed, each value a series of its own."""
    from services.metrics import RayRoundMetrics

    metrics = RayRoundMetrics()
    metrics.on_costs(CostProfile(t_draft_ms=5.0, t_target_ms={1: 30.0, 70: 40.0}), True, "default")
    metrics.on_costs(CostProfile(t_draft_ms=50.0, t_target_ms={1: 31.0, 77: 41.0}), False, "feature")
    pays = {dict(key)["draft"]: value for key, value in series["specdec_drafting_pays"].items()}
    assert pays == {"default": 1.0, "feature": 0.0}
    costs = {(dict(k)["draft"], dict(k)["role"], dict(k)["tokens"]): v for k, v in series["specdec_cost_profile_ms"].items()}
    assert costs[("default", "draft", "1")] == 5.0 and costs[("feature", "draft", "1")] == 50.0
    assert costs[("default", "verifier", "64")] == 40.0 and costs[("feature", "verifier", "64")] == 41.0  # (70, 77: one bucket)


def test_a_cancelled_request_is_not_an_error_and_an_oracles_reference_not_a_request(series, tiny_engine):
    import asyncio

    from services.metrics import RayRoundMetrics
    from specdec.loop import RoundLoop
    from specdec.params import build_params

    loop = RoundLoop(tiny_engine.loop.calls.transport, tiny_engine.rules, observer=RayRoundMetrics())

    async def scenario():
        await loop.generate([5, 72, 101], build_params(policy="oracle", max_new_tokens=4))
        task = asyncio.create_task(loop.generate([5, 72, 101], build_params(policy="fixed", k=2, max_new_tokens=64)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    requests = {(dict(k)["policy"], dict(k)["outcome"]): n for k, n in series["specdec_requests"].items()}
    assert requests == {("oracle", "ok"): 1, ("fixed", "cancelled"): 1}
