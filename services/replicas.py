"""The deployments that hold state: the draft and verifier replicas (a model, its KV-cache
sessions, and a gRPC server of their own) and the coordinator (the round loop for every session
routed to it). services/app.py binds them into the application. A feature draft placed beside its
target (AppConfig.feature_draft_placement) runs in the verifier's replicas, linked to the verifier
(specdec/workers.py `FeatureLink`), its Draft service on the same gRPC server. With the loop beside
the verifier (AppConfig.loop_placement "verifier") each Verifier replica runs the round loop for the
requests sent to it, and no Coordinator replica is deployed.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from ray.serve.schema import ReplicaState

from specdec.builder import build_draft, build_head, build_rules, build_target, draft_configs, resolve_dtype
from specdec.calls import LocalTransport, RoundTransport
from specdec.errors import one_line
from specdec.loop import BatchConfig
from specdec.params import DEFAULT_DRAFT
from specdec.sessions import SessionStore
from specdec.v1 import draft_pb2, generation_pb2, verifier_pb2
from specdec.workers import DraftWorker, FeatureLink, VerifierWorker
from services.autoscaling import ROUND_CALLS
from services.config import AppConfig, LiveCap, toward
from services.convert import sparsifier
from services.coordinator import Coordinator
from services.ingress import app_deployments
from services.metrics import RayRoundMetrics
from services.server import start_server
from services.servicers import DraftServicer, VerifierServicer
from services.transports import BesideTransport, round_transport

logger = logging.getLogger(__name__)

# How often a loop whose session-holding replicas autoscale reads how many run (LiveCap): their
# replicas start in tens of seconds at the soonest (Serve's upscale delay, a model's loading).
LIVE_CAP_REFRESH_S = 10.0
# How often a replica being stopped looks whether its sessions are all released (RoundReplica.__del__).
DRAIN_POLL_S = 0.2


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads in a replica; None: every core. (Ray sets OMP_NUM_THREADS to a
    replica's num_cpus, 1 for a fractional one, which would leave a CPU model on one core.)"""
    torch.set_num_threads(threads or os.cpu_count() or 1)


class LoopHost:
    """A replica that runs the round loop (`coordinator`): the ingress's handle calls these, the
    request and its answer as protobuf bytes. Where the replicas holding its sessions autoscale, its
    live cap follows how many of them run (services/config.py LiveCap), from its first request on."""

    coordinator: Coordinator | None
    live_cap: LiveCap
    asked: BatchConfig  # the config's batch, before the cap
    _following: asyncio.Task | None = None

    def _run_loop(self, config: AppConfig, transport: RoundTransport, cap: LiveCap) -> None:
        self.live_cap, self.asked = cap, config.models.batch
        self.coordinator = coordinator(config, transport, cap.batch(self.asked))

    async def generate(self, payload: bytes) -> bytes:
        self._follow_replicas()
        response = await self.coordinator.generate(generation_pb2.GenerateRequest.FromString(payload))
        return response.SerializeToString()

    async def generate_stream(self, payload: bytes) -> AsyncIterator[bytes]:
        self._follow_replicas()
        async for chunk in self.coordinator.generate_stream(generation_pb2.GenerateRequest.FromString(payload)):
            yield chunk.SerializeToString()

    async def live_limits(self) -> tuple[int, int | None]:
        """(max_live_sessions, max_live_positions) of this replica's loop now (tests read it)."""
        batch = self.coordinator.loop.batch
        return batch.max_live_sessions, batch.max_live_positions

    def _follow_replicas(self) -> None:
        if self._following is None and self.live_cap.most > self.live_cap.fewest:
            self._following = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        """Every LIVE_CAP_REFRESH_S, the loop's cap toward the one for the holders' replicas running
        (raised as its sessions leave: services/config.py `toward`); kept as it was while Serve's
        controller does not answer: said once when reading starts failing and once when it is back
        (a controller restart fails every read until then)."""
        loop, retired, first, failing = self.coordinator.loop, 0, True, False
        while True:
            try:
                deployments = await app_deployments()
                running = min(deployments[name].replica_states.get(ReplicaState.RUNNING, 0)
                              for name in self.live_cap.holders)
                target = self.live_cap.batch(self.asked, running)
                # The first read comes with the loop's first requests: the sessions live by then were
                # placed on the replicas running now, not on fewer, so the cap moves at once (a
                # coordinator added under load kept the fewest replicas' cap until its sessions left).
                loop.set_live_limits(target if first else toward(loop.batch, target, loop.live_sessions,
                                                                  loop.retired - retired))
                retired = loop.retired
            except Exception as exc:  # noqa: BLE001 - the cap stays as it was; the next read may do
                if not failing:
                    logger.warning("the live cap cannot follow the replicas (kept as it is): %s", one_line(exc))
                    logger.debug("the live cap's read of the replicas failed", exc_info=True)
                failing = True
            else:
                if failing:  # (a warning too: where the outage was seen, so is its end)
                    logger.warning("the live cap follows the replicas again")
                failing = first = False  # (a first read that failed: the first that does not moves the cap at once)
            await asyncio.sleep(LIVE_CAP_REFRESH_S)


class RoundReplica:
    """A replica hosting one round servicer, reachable two ways: through Serve (handle calls
    carrying the protobuf bytes) and on its own gRPC server (the `direct` transport).

    Every torch call, the model's loading included, runs on one thread (off the event loop): one
    batch at a time, with all the replica's intra-op threads. One thread also means one OpenMP
    team in the process. libgomp gives each calling thread a team of its own, and once a process
    holds more OpenMP threads than cores it stops spinning between parallel regions; loading on
    the actor's thread and running on another made two teams, and a 2-thread replica ran its
    draft steps no faster than a 1-thread one (docs/benchmarks.md, "Served vs in-process")."""

    servicer: DraftServicer | VerifierServicer
    role: str

    def __init__(self, config: AppConfig):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-torch")
        self._server = None
        self._address = ""
        self.servicer = self._executor.submit(self._load, config).result()
        self._start_grpc(config.key)

    @property
    def servicers(self) -> dict[str, DraftServicer | VerifierServicer]:
        """What this replica serves, by role."""
        return {self.role: self.servicer}

    def _load(self, config: AppConfig) -> DraftServicer | VerifierServicer:
        """Load the model and build the servicer (its batches run on this same torch thread); each
        role defines it, and it runs on the torch thread."""
        raise NotImplementedError

    def _start_grpc(self, api_key: str | None) -> None:
        """Bound to the Ray node's address (the cluster network), not every interface: these
        services are for the coordinator only (docs/reliability.md, "Access")."""
        host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        self._server, self._address = start_server(address=f"{host}:0", api_key=api_key, **self.servicers)

    async def address(self) -> str:
        """This replica's round gRPC server ("host:port"); routed like a round call, so it names
        the replica that owns the caller's session."""
        return self._address

    def __del__(self):
        """Serve calls this when it stops the replica (downscale, upgrade, the app deleted), once
        the calls that passed through Serve have ended, and awaits what it returns. The `direct`
        transport's round calls do not pass through it: a coordinator's generations go on calling
        this server for the sessions it holds, and stopped at once it failed them where there is no
        other replica (the app deleted: Ctrl-C of `specdec serve`). So it serves until it holds no
        session and no round call (each request releases its sessions as it ends; abandoned ones
        expire), then stops its server; Serve ends it at its graceful_shutdown_timeout_s whatever it
        holds. Collected outside an event loop (a replica built without Serve), it stops at once."""
        if self._server is None:
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            server, self._server = self._server, None
            server.stop(grace=None)
            return None
        return self._drain()

    async def _drain(self) -> None:
        while self._draining():
            await asyncio.sleep(DRAIN_POLL_S)
        server, self._server = self._server, None  # (the collector's __del__ after Serve's does nothing)
        server.stop(grace=DRAIN_POLL_S)

    def _draining(self) -> bool:
        """Whether a round call is being served or a session's cache held (expired ones dropped)."""
        self.check_health()
        return any(servicer.round_calls or len(servicer.sessions) for servicer in self.servicers.values())

    async def _serve(self, method: Callable, request_type, payload: bytes) -> bytes:
        """A handle call (the `serve-grpc` and `actor` transports): off the event loop, the servicer
        hands the batch to the torch thread. The answer names this replica (`replica`): the router
        may have sent the call elsewhere than the replica the caller took for its sessions'."""
        reply = await asyncio.to_thread(method, request_type.FromString(payload), None)
        reply.replica = self._address
        return reply.SerializeToString()

    async def live_sessions(self) -> int:
        """Sessions whose cache this replica holds, a draft's beside the verifier included (tests and
        the load benchmark read it)."""
        return sum(len(servicer.sessions) for servicer in self.servicers.values())

    def check_health(self) -> None:
        """Serve calls this every few seconds: also when idle sessions' caches are freed."""
        for servicer in self.servicers.values():
            servicer.sessions.evict_expired()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve samples this for the deployment's autoscaling policy (services/autoscaling.py): the
        round calls this replica is serving, which the `direct` transport's never pass through Serve."""
        return {ROUND_CALLS: float(sum(servicer.round_calls for servicer in self.servicers.values()))}


class Draft(RoundReplica):
    """One of the drafts (`name`: DEFAULT_DRAFT, or a name of `models.drafts`)."""

    role = "draft"

    def __init__(self, config: AppConfig, name: str = DEFAULT_DRAFT):
        self.name = name
        super().__init__(config)

    def _load(self, config: AppConfig) -> DraftServicer:
        set_threads(config.draft.threads)
        return DraftServicer(draft_worker(config, self.name, config.draft.threads), self._executor)

    async def propose(self, payload: bytes) -> bytes:
        return await self._serve(self.servicer.Propose, draft_pb2.ProposeBatch, payload)


class Verifier(RoundReplica, LoopHost):
    """The target, and the feature draft placed beside it if any (`colocated`: its name)."""

    role = "verifier"

    def __init__(self, config: AppConfig, colocated: Sequence[str] = (), drafts: dict | None = None,
                 cap: LiveCap | None = None):
        """`drafts`: the other drafts' deployment handles by name, and `cap` its live cap, where the
        round loop runs here (AppConfig.loop_placement "verifier"; None: it runs on the Coordinator's
        replicas)."""
        self.colocated = list(colocated)
        self.draft_servicer: DraftServicer | None = None
        super().__init__(config)
        self.coordinator: Coordinator | None = None
        if drafts is not None:
            local = {name: self.draft_servicer.worker for name in self.colocated}
            self._run_loop(config, BesideTransport(LocalTransport(local, self.servicer.worker, self._executor),
                                                   round_transport(config.round_transport, drafts, None, config.key)),
                           cap)

    @property
    def servicers(self) -> dict[str, DraftServicer | VerifierServicer]:
        return {"verifier": self.servicer} | ({"draft": self.draft_servicer} if self.draft_servicer else {})

    def _load(self, config: AppConfig) -> VerifierServicer:
        set_threads(config.verifier.threads)
        load = None
        if config.target_shards > 1:
            from specdec.models.sharding import ShardingConfig, load_sharded

            sharding = ShardingConfig(shards=config.target_shards)
            dtype = resolve_dtype(config.models.dtype, torch.device(sharding.resolve_devices()[0]))
            load = lambda model_dir: load_sharded(model_dir, sharding, dtype)  # noqa: E731
        target, _ = build_target(config.models.model_copy(update={"threads": config.verifier.threads}),
                                 progress=False, load=load)
        sessions = SessionStore(config.sessions.max_sessions, config.sessions.ttl_s)
        worker = VerifierWorker(target, sessions)
        worker.probe_at_first_batch()  # its timings seed the coordinator's live costs with the first reply
        if self.colocated:  # on this torch thread too: one OpenMP team for both models
            [name] = self.colocated  # AppConfig.colocated_drafts: one at most
            draft = draft_worker(config, name, config.verifier.threads)
            worker.link = FeatureLink([draft])
            self.draft_servicer = DraftServicer(draft, self._executor)
        return VerifierServicer(worker, self._executor)

    async def verify(self, payload: bytes) -> bytes:
        return await self._serve(self.servicer.Verify, verifier_pb2.VerifyBatch, payload)

    def check_health(self) -> None:
        super().check_health()
        if (link := self.servicer.worker.link) is not None:  # states waiting for sessions both let go
            link.keep(self.servicer.sessions)

    async def propose(self, payload: bytes) -> bytes:
        """The colocated draft's Propose, as a handle call."""
        return await self._serve(self.draft_servicer.Propose, draft_pb2.ProposeBatch, payload)


def draft_worker(config: AppConfig, name: str, threads: int | None) -> DraftWorker:
    """Draft `name`'s worker (plus its head), its own sessions; the replica's torch thread runs it."""
    models = draft_configs(config.models)[name].model_copy(update={"threads": threads})
    draft, _ = build_draft(models, progress=False)
    sessions = SessionStore(config.sessions.max_sessions, config.sessions.ttl_s)
    worker = DraftWorker(draft, build_head(models, draft, name), sessions, sparsifier(config.sparsify_below))
    worker.probe_at_first_batch()  # its timings seed the coordinator's live costs with the first reply
    return worker


def coordinator(config: AppConfig, transport: RoundTransport, batch: BatchConfig) -> Coordinator:
    """The round loop over `transport`, wherever it runs (`batch`: the config's, capped for it)."""
    rules = build_rules(config.models, progress=False, devices=config.model_devices())
    return Coordinator(transport, rules, config.policy, observer=RayRoundMetrics(), batch=batch, api_key=config.key)


class CoordinatorDeployment(LoopHost):
    """A Serve replica is an async Ray actor: this one runs the round loop for every session routed to it."""

    def __init__(self, drafts: dict, verifier, config: AppConfig, colocated: Sequence[str], cap: LiveCap):
        """`drafts`: each draft's deployment handle by name; `colocated`: the draft served by the
        verifier's replicas; `cap`: its loop's live cap."""
        self._run_loop(config, round_transport(config.round_transport, drafts, verifier, config.key, colocated), cap)

    async def live_sessions(self) -> int:
        """Samples this replica is decoding (tests and the load benchmark read it)."""
        return self.coordinator.live_sessions
