"""The round services (protos/specdec/v1 draft.proto, verifier.proto): thin. Convert the batch from
protobuf, call the worker (specdec/workers.py), convert the answers back. An item that does not
convert is refused on its own; the others are served. A failure of the whole call (a bug) answers
with services/errors.py's status (INTERNAL, "internal error"), never a traceback.

The worker's model runs on `torch_executor` when one is given (a replica's one torch thread, so the
process holds one OpenMP team: services/replicas.py); Release never waits for it.

The coordinator's per-step calls arrive on streams kept open across steps (`ProposeStream`,
`VerifyStream`): a unary call pays for a new HTTP/2 stream, its headers and a server thread's
hand-off every time, a stream message for none of that. Each open stream holds one of the
server's threads, so a servicer takes at most MAX_STREAMS (the server has that many threads more
than its unary calls need: services/server.py) and refuses the next; the caller then calls unary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

import grpc

from specdec.metrics import MS_PER_S
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.workers import DraftWorker, VerifierWorker
from services.convert import (convert_items, merge_answers, plan_from_proto, propose_item_from_proto,
                              proposal_to_proto, timings_to_proto, verdict_to_proto, verify_item_from_proto)
from services.errors import grpc_status

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

    def _serve(self, messages, convert: Callable, run: Callable[[list], list], context) -> tuple[list, float]:
        """(the answers for `messages`, in order; the milliseconds it took). A call that fails as a
        whole aborts with its status (a Serve handle call, without a gRPC context, raises)."""
        start = time.perf_counter()
        with self._calls_lock:
            self.round_calls += 1
        try:
            items, refused = convert_items(messages, convert)
            answers = self._executor.submit(run, items).result() if self._executor else run(items)
            return merge_answers(len(messages), answers, refused), (time.perf_counter() - start) * MS_PER_S
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
        answers, ms = self._serve(request.items, propose_item_from_proto,
                                  lambda items: self.worker.propose(items, plan_from_proto(request)), context)
        return draft_pb2.ProposalBatch(proposals=[proposal_to_proto(a) for a in answers], draft_ms=ms,
                                       passes=timings_to_proto(self.worker.take_timings()))

    def ProposeStream(self, requests, context):
        return self._stream(requests, self.Propose, context)


class VerifierServicer(RoundServicer, verifier_pb2_grpc.VerifierServicer):
    worker: VerifierWorker

    def Verify(self, request: verifier_pb2.VerifyBatch, context) -> verifier_pb2.VerdictBatch:
        vocab = self.worker.target.vocab_size
        answers, ms = self._serve(request.items, lambda msg: verify_item_from_proto(msg, vocab),
                                  lambda items: self.worker.verify(items, request.probe_tokens), context)
        return verifier_pb2.VerdictBatch(verdicts=[verdict_to_proto(a) for a in answers], target_ms=ms,
                                         passes=timings_to_proto(self.worker.take_timings()))

    def VerifyStream(self, requests, context):
        return self._stream(requests, self.Verify, context)
