"""The round services (protos/specdec/v1 draft.proto, verifier.proto): thin. Convert the batch from
protobuf, call the worker (specdec/workers.py), convert the answers back. An item that does not
convert is refused on its own; the others are served.
"""

from __future__ import annotations

import time

import grpc

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.workers import DraftWorker, VerifierWorker
from services.convert import (convert_items, merge_answers, propose_item_from_proto, proposal_to_proto,
                              verdict_to_proto, verify_item_from_proto)

MS_PER_S = 1000.0


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, worker: DraftWorker):
        self.worker = worker

    @property
    def sessions(self):
        return self.worker.sessions

    def Propose(self, request: draft_pb2.ProposeBatch, context: grpc.ServicerContext) -> draft_pb2.ProposalBatch:
        start = time.perf_counter()
        items, refused = convert_items(request.items, propose_item_from_proto)
        answers = merge_answers(len(request.items), self.worker.propose(items), refused)
        return draft_pb2.ProposalBatch(proposals=[proposal_to_proto(a) for a in answers],
                                       draft_ms=(time.perf_counter() - start) * MS_PER_S)

    def Release(self, request: common_pb2.SessionRefs, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.worker.release(list(request.session_ids)))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, worker: VerifierWorker):
        self.worker = worker

    @property
    def sessions(self):
        return self.worker.sessions

    def Verify(self, request: verifier_pb2.VerifyBatch, context: grpc.ServicerContext) -> verifier_pb2.VerdictBatch:
        start = time.perf_counter()
        vocab = self.worker.target.vocab_size
        items, refused = convert_items(request.items, lambda msg: verify_item_from_proto(msg, vocab))
        answers = merge_answers(len(request.items), self.worker.verify(items), refused)
        return verifier_pb2.VerdictBatch(verdicts=[verdict_to_proto(a) for a in answers],
                                         target_ms=(time.perf_counter() - start) * MS_PER_S)

    def Release(self, request: common_pb2.SessionRefs, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.worker.release(list(request.session_ids)))
