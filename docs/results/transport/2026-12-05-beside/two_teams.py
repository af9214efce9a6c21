"""A/B: the beside benchmark with the in-process loop on the main thread (two OpenMP teams) vs all on one thread."""
import asyncio, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from benchmarks import transport as T
from benchmarks.models import VOCAB
from services.transports import BesideTransport
from specdec.calls import LocalTransport
from specdec.engine import SpecDecEngine
from specdec.loop import BatchConfig, RoundLoop
from specdec.workers import VerifierWorker

if __name__ == "__main__":
    pair, cells = T.tiny_pair(VOCAB), [(0.0, 1)]
    if sys.argv[1] == "two":
        engine = SpecDecEngine(*pair.runtimes(), batch=BatchConfig(max_sessions_per_step=1))
        executor = ThreadPoolExecutor(max_workers=1)
        local = LocalTransport({}, VerifierWorker(pair.runtimes()[1]), executor)
        with T.replicas(pair, torch.get_num_threads(), None, False, True) as (addresses, pipes):
            transport = BesideTransport(local, T.grpc_transport(addresses["draft"], None))
            served = RoundLoop(T.Clock(transport), engine.rules, engine.loop.batch.model_copy(update={"overlap": "off"}))
            rows = asyncio.run(T.measure(engine, served, pipes, cells, 4, 160, VOCAB, lambda k, r: None))
    else:
        rows = T.compare(pair, cells, 4, 160, VOCAB, beside=True)
    T.print_row("T=0@1", rows["T=0@1"])
