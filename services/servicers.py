"""The round services (protos/specdec/v1 draft.proto, verifier.proto): thin. Convert the batch from
protobuf, call the worker (specdec/workers.py), convert the answers back. An item that does not
convert is refused on its own; the others are served. A failure of the whole call (a bug) answers
with services/errors.py's status (INTERNAL, "internal error"), never a traceback.

The worker's model runs on `torch_executor` when one is given (a replica's one torch thread, so the
process holds one OpenMP team: services/replicas.py); Release never waits for it. Verify calls
that wait for that thread together (several coordinators, or lanes, calling one verifier) run as
one pass when it frees (`VerifyBatcher`): on a GPU a pass costs about the same for 1 session as
for 64, so each caller's pass of its own few sessions cost a whole pass.

The coordinator's per-step calls arrive on streams kept open across steps (`ProposeStream`,
`VerifyStream`): a unary call pays for a new HTTP/2 stream, its headers and a server thread's
hand-off every time, a stream message for none of that. Each open stream holds one of the
server's threads, so a servicer takes at most MAX_STREAMS (the server has that many threads more
than its unary calls need: services/server.py) and refuses the next; the caller then calls unary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from specdec.cost_profile import PassTiming
from specdec.metrics import MS_PER_S
from specdec.protocol import VerifyItem
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.workers import DraftWorker, VerifierWorker
from services.convert import (convert_items, merge_answers, plan_from_proto, propose_item_from_proto,
                              proposal_to_proto, timings_to_proto, verdict_to_proto, verify_item_from_proto)
from services.errors import grpc_status

logger = logging.getLogger(__name__)

MAX_STREAMS = 16  # a replica's open round streams: 8 lanes (loop.py BatchConfig) of two coordinators
STREAMS_REFUSED = "round streams: this replica holds its most"


class RoundServicer:
    """What both round services share: the worker's sessions, Release, the batch's conversions."""

    def __init__(self, worker: DraftWorker | VerifierWorker, torch_executor: Executor | None = None):
        self.worker, self._executor = worker, torch_executor
        self.round_calls = 0  # being served, waiting for the torch thread included (services/autoscaling.py)
        self.streams = self.streams_opened = 0  # round streams open now, and ever
        self._calls_lock = threading.Lock()  # gRPC calls arrive on the server's threads

    @property
    def sessions(self):
        return self.worker.sessions

    def Release(self, request: common_pb2.SessionRefs, context) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.worker.release(list(request.session_ids)))

    def _stream(self, requests: Iterator, call: Callable, context) -> Iterator:
        """`call` for each message of a stream, its answers in order, while the stream is open;
        refused (before any message) where the servicer holds MAX_STREAMS."""
        with self._calls_lock:
            refused = self.streams >= MAX_STREAMS
            self.streams += not refused
            self.streams_opened += not refused
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, STREAMS_REFUSED)

        def closed() -> None:
            with self._calls_lock:
                self.streams -= 1

        # Counted free when the RPC ends, however it ends: a stream cancelled before its first
        # answer was asked for never runs its generator, so a `finally` there never ran (sixteen of
        # them, and the replica refused every stream).
        if not context.add_callback(closed):  # (it ended already)
            closed()
        context.send_initial_metadata(())  # accepted: the caller writes only once it knows
        return (call(request, context) for request in requests)

    def _on_torch(self, run: Callable[[], object]):
        """`run()` on the torch thread (here without one), its result."""
        return self._executor.submit(run).result() if self._executor else run()

    def _serve(self, messages, convert: Callable, run: Callable[[list], tuple[list, list[PassTiming]]],
               reply: Callable[[list, list[PassTiming], float], Message], context) -> Message:
        """`reply` of (the answers for `messages`, in order; the passes timed for them; the
        milliseconds it took). `run` gets the items that converted and answers them with the timings
        of their passes, taken on the torch thread (other calls' passes run there too). A call that
        fails as a whole aborts with its status (a Serve handle call, without a gRPC context, raises),
        building the reply included: an answer that did not convert back (a bug), raised past here,
        was gRPC's UNKNOWN with the exception's text, which the coordinator takes for a replica gone
        (it retried the sessions for a minute, then failed them as UNAVAILABLE)."""
        start = time.perf_counter()
        with self._calls_lock:
            self.round_calls += 1
        try:
            items, refused = convert_items(messages, convert)
            answers, timings = run(items)
            ms = (time.perf_counter() - start) * MS_PER_S
            return reply(merge_answers(len(messages), answers, refused), timings, ms)
        except Exception as exc:
            if context is None:
                raise
            context.abort(*grpc_status(exc))
        finally:
            with self._calls_lock:
                self.round_calls -= 1


class DraftServicer(RoundServicer, draft_pb2_grpc.DraftServicer):
    worker: DraftWorker

    def Propose(self, request: draft_pb2.ProposeBatch, context) -> draft_pb2.ProposalBatch:
        def run(items):
            return self._on_torch(lambda: (self.worker.propose(items, plan_from_proto(request)),
                                           self.worker.take_timings()))

        return self._serve(request.items, propose_item_from_proto, run,
                           lambda answers, timings, ms: draft_pb2.ProposalBatch(
                               proposals=[proposal_to_proto(a) for a in answers], draft_ms=ms,
                               passes=timings_to_proto(timings)), context)

    def ProposeStream(self, requests, context):
        return self._stream(requests, self.Propose, context)


@dataclass
class _WaitingVerify:
    items: list[VerifyItem]
    probe_tokens: int
    done: Future = field(default_factory=Future)  # (answers, timings)


class VerifyBatcher:
    """Verify calls that wait for the torch thread together run as one pass when it frees, as a
    serving engine's continuous batching does: the first call schedules a run there, and every call
    arriving before it starts joins it. A call arriving alone runs alone, at once: nothing waits for
    company. Each call gets its own verdicts and the timings of the pass they shared (the pass a
    caller waited for; its own probe's besides). Sessions never meet: each row has its own cache
    and its own seeded generator. A shared pass that fails runs each call again alone, so that one
    caller's failure is not another's (a row whose history had moved on then answers
    session-missing, and its caller resends its history)."""

    def __init__(self, worker: VerifierWorker, executor: Executor | None):
        self.worker, self._executor = worker, executor
        self._lock = threading.Lock()
        self._waiting: list[_WaitingVerify] = []
        self.share = True  # False: each call alone (benchmarks/shared_passes.py's baseline)
        self.calls = self.passes = 0  # Verify calls answered, and the passes they took
        self.shared_calls = 0  # calls that shared their pass with another

    def verify(self, items: list[VerifyItem], probe_tokens: int) -> tuple[list, list[PassTiming]]:
        call = _WaitingVerify(items, probe_tokens)
        with self._lock:
            self._waiting.append(call)
            first = len(self._waiting) == 1
        if first:
            if not self._executor:
                self._run()
            else:
                try:
                    self._executor.submit(self._run).add_done_callback(self._never_ran)
                except RuntimeError as exc:  # (the replica stopping: its executor shut down)
                    self._fail_waiting(exc)
        return call.done.result()

    def _never_ran(self, run: Future) -> None:
        if run.cancelled():  # (an executor shut down with its pending work cancelled)
            self._fail_waiting(RuntimeError("the verifier's torch thread stopped"))

    def _fail_waiting(self, exc: BaseException) -> None:
        """Fail the calls waiting for a run that will not come."""
        with self._lock:
            calls, self._waiting = self._waiting, []
        for call in calls:
            call.done.set_exception(exc)

    def _run(self) -> None:
        with self._lock:
            calls, self._waiting = self._waiting, []
        self.calls += len(calls)
        failure: BaseException | None = None
        try:
            for group in [calls] if len(calls) == 1 else self._passes(calls):  # (alone: nothing to cut)
                if len(group) == 1 or not self.share:
                    for call in group:
                        self._alone(call)
                else:
                    self._shared(group)
        except BaseException as exc:  # (a bug here ends on the executor's future, which no one reads)
            failure = exc
            raise
        finally:  # whatever went wrong, no caller waits for good, and its error names why
            for call in calls:
                if not call.done.done():
                    error = RuntimeError("the verification pass did not answer")
                    error.__cause__ = failure
                    call.done.set_exception(error)

    @staticmethod
    def _passes(calls: list[_WaitingVerify]) -> list[list[_WaitingVerify]]:
        """The calls in order, cut where a call names a session that one before it in the pass does
        (a call retried while the one it gave up on still waits): a pass holds a session once."""
        groups, held = [], set()
        for call in calls:
            ids = {item.session_id for item in call.items}
            if not groups or ids & held:
                groups.append([])
                held = set()
            groups[-1].append(call)
            held |= ids
        return groups

    def _shared(self, calls: list[_WaitingVerify]) -> None:
        try:
            self.passes += 1
            answers = self.worker.verify([item for call in calls for item in call.items])
            shared = self.worker.take_timings()
        except Exception:  # noqa: BLE001 - each call alone, below, fails on its own if it does
            logger.warning("a shared verification pass failed: its %d calls run alone", len(calls), exc_info=True)
            # the start-up probe's timings, if this was the first pass, go to the first call answered
            probes = [timing for timing in self.worker.take_timings() if timing.probe]
            for call in calls:
                probes = self._alone(call, probes)
            return
        self.shared_calls += len(calls)
        start = 0
        for call in calls:
            own = answers[start:start + len(call.items)]
            start += len(call.items)
            try:
                probed = []
                if call.probe_tokens > 0:
                    self.worker.probe((call.probe_tokens,))
                    probed = self.worker.take_timings()
                call.done.set_result((own, shared + probed))
            except Exception as exc:  # noqa: BLE001 - its probe failed: its call fails, as alone
                call.done.set_exception(exc)

    def _alone(self, call: _WaitingVerify, carried: list[PassTiming] = ()) -> list[PassTiming]:
        """Run `call` as a pass of its own, its answer with `carried` timings before its own; returns
        what is still to carry (all of it where the call failed)."""
        self.passes += 1
        try:
            call.done.set_result((self.worker.verify(call.items, call.probe_tokens),
                                  list(carried) + self.worker.take_timings()))
            return []
        except Exception as exc:  # noqa: BLE001 - handed to its caller, which answers its status
            self.worker.take_timings()
            call.done.set_exception(exc)
            return list(carried)


class VerifierServicer(RoundServicer, verifier_pb2_grpc.VerifierServicer):
    worker: VerifierWorker

    def __init__(self, worker: VerifierWorker, torch_executor: Executor | None = None):
        super().__init__(worker, torch_executor)
        self.batcher = VerifyBatcher(worker, torch_executor)

    def Verify(self, request: verifier_pb2.VerifyBatch, context) -> verifier_pb2.VerdictBatch:
        vocab = self.worker.target.vocab_size
        return self._serve(request.items, lambda msg: verify_item_from_proto(msg, vocab),
                           lambda items: self.batcher.verify(items, request.probe_tokens),
                           lambda answers, timings, ms: verifier_pb2.VerdictBatch(
                               verdicts=[verdict_to_proto(a) for a in answers], target_ms=ms,
                               passes=timings_to_proto(timings)), context)

    def VerifyStream(self, requests, context):
        return self._stream(requests, self.Verify, context)
