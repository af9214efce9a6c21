"""A served loop's live cap following the replicas running (services/replicas.py LoopHost._follow),
outside Serve: Serve's status and the loop stand in, the arithmetic is services/config.py's."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from ray.serve.schema import ReplicaState

import services.replicas as replicas
from services.config import LiveCap
from specdec.loop import BatchConfig


class FakeLoop:
    """What the follower reads of a RoundLoop: its batch, live sessions and retired count."""

    def __init__(self, batch: BatchConfig, live: int = 0):
        self.batch, self.live_sessions, self.retired = batch, live, 0

    def set_live_limits(self, batch: BatchConfig) -> None:
        self.batch = self.batch.model_copy(update={"max_live_sessions": batch.max_live_sessions,
                                                   "max_live_positions": batch.max_live_positions})


def host(cap: LiveCap, live: int) -> replicas.LoopHost:
    loop_host = replicas.LoopHost()
    loop_host.live_cap, loop_host.asked = cap, BatchConfig()
    loop_host.coordinator = SimpleNamespace(loop=FakeLoop(cap.batch(loop_host.asked), live))
    return loop_host


def status(running: int) -> dict:
    return {"Draft": SimpleNamespace(replica_states={ReplicaState.RUNNING: running}),
            "Verifier": SimpleNamespace(replica_states={ReplicaState.RUNNING: running})}


CAP = LiveCap(held=64, positions=None, holders=("Draft", "Verifier"), fewest=1, most=8, loops=8)


class Status:
    """Serve's status, one read at a time: each read waits for the replicas running the test gives."""

    def __init__(self):
        self.asked, self.answered, self.answers = 0, 0, asyncio.Queue()

    async def deployments(self) -> dict:
        self.asked += 1
        return status(await self.answers.get())

    async def read(self, running: int) -> None:
        """Answers the follower's read with `running`, once it asks, and waits until it asks again
        (its cap set from this one)."""
        while self.asked == self.answered:
            await asyncio.sleep(0)
        self.answered += 1
        self.answers.put_nowait(running)
        while self.asked == self.answered:
            await asyncio.sleep(0)


@pytest.fixture
def serve_status(monkeypatch) -> Status:
    serve_status = Status()
    monkeypatch.setattr(replicas, "app_deployments", serve_status.deployments)
    monkeypatch.setattr(replicas, "LIVE_CAP_REFRESH_S", 0)
    return serve_status


DOWN = None  # a read of Serve's status that fails


def follow_reads(monkeypatch, loop_host: replicas.LoopHost, answers: list) -> list:
    """Runs the follower of `loop_host` through reads of Serve's status answering `answers` in turn
    (replicas running, or DOWN) and stops it after the last; returns the answers it read."""
    from specdec.errors import Unavailable

    answers, asked = list(answers), []

    async def deployments():
        if not answers:  # (no more reads answered)
            await asyncio.Event().wait()
        asked.append(answer := answers.pop(0))
        if answer is DOWN:
            raise Unavailable("Serve's controller did not answer in 5 s")
        return status(answer)

    monkeypatch.setattr(replicas, "app_deployments", deployments)
    monkeypatch.setattr(replicas, "LIVE_CAP_REFRESH_S", 0)

    async def scenario():
        loop_host._follow_replicas()
        while answers:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        loop_host._following.cancel()

    asyncio.run(scenario())
    return asked

def test_the_first_read_moves_a_busy_loop_to_the_replicas_running_at_once(serve_status):
    """The follower starts with the loop's first request: the sessions live by its first read were
    placed on the replicas running then (8 here, the loop's cap still at the fewest), not on fewer
    ones, so nothing holds the cap back. Before, a coordinator added under load (its first requests
    arriving together) kept its fewest-replica cap (8) until its sessions left, 10 s at a time."""
    loop_host = host(CAP, live=8)
    loop = loop_host.coordinator.loop
    assert loop.batch.max_live_sessions == 8

    async def scenario():
        loop_host._follow_replicas()
        await serve_status.read(8)
        loop_host._following.cancel()

    asyncio.run(scenario())
    assert loop.batch.max_live_sessions == CAP.batch(BatchConfig(), 8).max_live_sessions == 42


def test_a_first_read_that_failed_leaves_the_move_at_once_to_the_first_that_answers(monkeypatch):
    """A controller that does not answer the follower's first read (restarting as the coordinator
    starts): the first read that answers is its first, and moves the cap at once. Before, the failed
    read counted as the first, and a busy loop kept its fewest-replica cap until its sessions left."""
    loop_host = host(CAP, live=8)
    assert follow_reads(monkeypatch, loop_host, [DOWN, 8]) == [DOWN, 8]
    assert loop_host.coordinator.loop.batch.max_live_sessions == CAP.batch(BatchConfig(), 8).max_live_sessions == 42

def test_later_reads_raise_a_busy_loops_cap_as_its_sessions_leave(serve_status):
    """After the first read the ramp holds: replicas added later take new sessions only, while the
    live ones stay where they are."""
    loop_host = host(CAP, live=8)
    loop = loop_host.coordinator.loop

    async def scenario():
        loop_host._follow_replicas()
        caps = []
        for running, retired in ((1, 0), (8, 0), (8, 3), (8, 0)):
            loop.retired += retired
            await serve_status.read(running)
            caps.append(loop.batch.max_live_sessions)
        loop_host._following.cancel()
        return caps

    assert asyncio.run(scenario()) == [8, 8, 11, 11]  # one replica; eight, none left; 3 left: 8 + 3


def test_a_status_read_that_hangs_is_waited_for_not_started_again(monkeypatch):
    """Serve's status blocks while its controller restarts (its calls are retried until it is back).
    Each read that timed out left its thread blocked, and the follower started another every 15 s
    (/health, each probe): a coordinator's 5 default-executor threads (num_cpus 0) were all taken
    within 75 s, and its prompts tokenized off the event loop waited for the controller. One read is
    in flight at a time, on a thread of its own; the callers meanwhile wait for it."""
    import services.ingress as ingress
    from specdec.errors import Unavailable

    started, back = [], threading.Event()

    def blocking_status():
        started.append(threading.get_ident())
        back.wait(30)
        return SimpleNamespace(applications={"app": SimpleNamespace(deployments=status(2))})

    monkeypatch.setattr(ingress.serve, "status", blocking_status)
    monkeypatch.setattr(ingress.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(ingress, "READY_TIMEOUT_S", 0.05)

    async def scenario():
        for _ in range(3):
            with pytest.raises(Unavailable):
                await ingress.app_deployments()
        assert len(started) == 1
        in_use = await asyncio.to_thread(lambda: "the default executor answers")
        back.set()
        return in_use, await ingress.app_deployments()

    in_use, deployments = asyncio.run(scenario())
    assert in_use == "the default executor answers"
    assert deployments["Draft"].replica_states[ReplicaState.RUNNING] == 2


def test_a_status_that_cannot_be_read_is_logged_once_and_its_return_once(monkeypatch, caplog):
    """While Serve's controller restarts every read fails: the follower logged a warning with a full
    traceback each time (every LIVE_CAP_REFRESH_S, for as long as it lasted). Now one line with the
    reason when reading starts failing, one when it answers again, nothing in between; the cap
    stays as it was meanwhile."""
    import logging

    loop_host = host(CAP, live=0)
    loop = loop_host.coordinator.loop
    with caplog.at_level(logging.DEBUG, logger=replicas.logger.name):
        follow_reads(monkeypatch, loop_host, [8, DOWN, DOWN, DOWN, 8, 8, DOWN, 8])
    records = [r for r in caplog.records if r.name == replicas.logger.name]
    shown = [r for r in records if r.levelno >= logging.INFO]
    failing = "the live cap cannot follow the replicas (kept as it is): Serve's controller did not answer in 5 s"
    again = "the live cap follows the replicas again"
    assert [(r.levelname, r.getMessage()) for r in shown] == [("WARNING", failing), ("WARNING", again),
                                                              ("WARNING", failing), ("WARNING", again)]
    assert not any(r.exc_info for r in shown)
    # the traceback at debug level, once per outage
    assert [r.levelname for r in records if r.exc_info] == ["DEBUG", "DEBUG"]
    assert loop.batch.max_live_sessions == CAP.batch(BatchConfig(), 8).max_live_sessions
