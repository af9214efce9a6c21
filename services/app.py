"""The Ray Serve application: draft, verifier, coordinator and ingress deployments.

    Ingress (gRPC proxy: specdec.v1.Generation; HTTP: OpenAI routes)
      -> Coordinator (the round loop, many sessions)  --propose-->  Draft (draft model + head + policy)
                                                      --verify--->  Verifier (target, sharded)

Draft and verifier calls carry our protobuf messages (protos/specdec/v1) over Serve's
inter-deployment gRPC transport (`_by_reference=False`), routed by ConsistentHashRouter on the
session id so a session's rounds find its KV cache. `build_app` is the `import_path` target of
`serve run` / `serve deploy`; `specdec serve` calls it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import ray
from google.protobuf.message import DecodeError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from specdec.builder import build_draft, build_head, build_rules, build_target
from specdec.errors import InvalidRequestError
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc
from services.auth import MISSING_KEY, call_metadata, key_matches, metadata_authorization
from services.config import CONSISTENT_HASH_ROUTER, AppConfig, ReplicaConfig
from services.convert import Overloaded, Unavailable, one_line
from services.coordinator import Coordinator, Role
from services.draft_servicer import DraftServicer
from services.server import MAX_ROUND_MESSAGE_BYTES, start_server
from services.metrics import RayRoundMetrics, prometheus_text
from services.sessions import SessionStore
from services.verifier_servicer import VerifierServicer

logger = logging.getLogger(__name__)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads in a replica; None: every core. (Ray sets OMP_NUM_THREADS to a
    replica's num_cpus, 1 for a fractional one, which would leave a CPU model on one core.)"""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


class ServicerCall:
    """The grpc.ServicerContext a servicer sees when Serve, not a grpc.Server, calls it: an abort
    with INVALID_ARGUMENT becomes InvalidRequestError, which reaches the coordinator as itself."""

    def abort(self, code: grpc.StatusCode, details: str):
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequestError(details)
        raise RuntimeError(f"{code.name}: {details}")


class RoundReplica:
    """A replica hosting one round servicer, reachable two ways: through Serve (handle calls
    carrying the protobuf bytes) and on its own gRPC server (the `direct` transport).

    Every torch call, the model's loading included, runs on one thread (off the event loop): one
    forward at a time, with all the replica's intra-op threads. One thread also means one OpenMP
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

    def _load(self, config: AppConfig) -> DraftServicer | VerifierServicer:
        """Load the model and build the servicer; each role defines it, and it runs on the torch thread."""
        raise NotImplementedError

    def _start_grpc(self, api_key: str | None) -> None:
        """Bound to the Ray node's address (the cluster network), not every interface: these
        services are for the coordinator only (docs/reliability.md, "Access")."""
        host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        self._server, self._address = start_server(address=f"{host}:0", executor=self._executor,
                                                   api_key=api_key, **{self.role: self.servicer})

    async def address(self) -> str:
        """This replica's round gRPC server ("host:port"); routed like a round call, so it names
        the replica that owns the caller's session."""
        return self._address

    def __del__(self):
        if self._server is not None:
            self._server.stop(grace=None)

    async def _serve(self, method: Callable, request_type, payload: bytes) -> bytes:
        request = request_type.FromString(payload)
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self._executor, method, request, ServicerCall())
        return reply.SerializeToString()

    async def release(self, payload: bytes) -> bytes:
        return await self._serve(self.servicer.Release, common_pb2.SessionRef, payload)

    async def live_sessions(self) -> int:
        """Sessions whose cache this replica holds (tests and the load benchmark read it)."""
        return len(self.servicer.sessions)

    def check_health(self) -> None:
        """Serve calls this every few seconds: also when idle sessions' caches are freed."""
        self.servicer.sessions.evict_expired()


class Draft(RoundReplica):
    role = "draft"

    def _load(self, config: AppConfig) -> DraftServicer:
        set_threads(config.draft.threads)
        draft, _ = build_draft(config.models, progress=False)
        sessions = SessionStore(config.sessions.max_sessions, config.sessions.ttl_s)
        return DraftServicer(draft, build_head(config.models, draft), sessions, config.sparsify_below)

    async def propose(self, payload: bytes) -> bytes:
        return await self._serve(self.servicer.Propose, draft_pb2.ProposeRequest, payload)


class Verifier(RoundReplica):
    role = "verifier"

    def _load(self, config: AppConfig) -> VerifierServicer:
        set_threads(config.verifier.threads)
        load = None
        if config.target_shards > 1:
            from specdec.models.sharding import ShardingConfig, load_sharded

            sharding = ShardingConfig(shards=config.target_shards)
            load = lambda model_dir: load_sharded(model_dir, sharding)  # noqa: E731
        target, _ = build_target(config.models, progress=False, load=load)
        sessions = SessionStore(config.sessions.max_sessions, config.sessions.ttl_s)
        return VerifierServicer(target, sessions)

    async def verify(self, payload: bytes) -> bytes:
        return await self._serve(self.servicer.Verify, verifier_pb2.VerifyRequest, payload)


# ------------------------------------------------------------------------------------------------
# The coordinator

def own_request(call: Callable[[], DeploymentResponse]) -> DeploymentResponse:
    """Make a handle call as a request of its own, outside the caller's Serve request context.
    Ray 2.60 gives a child call its parent's internal request id and the request router indexes
    pending requests by that id, so the n samples of one request, routing concurrently, would
    collide and all but one wait forever."""
    return contextvars.Context().run(call)


class ServeRoundTransport:
    """Round calls through deployment handles: gRPC transport, session affinity."""

    retryable = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)

    def __init__(self, draft: DeploymentHandle, verifier: DeploymentHandle, grpc_transport: bool = True):
        self._handles = {"draft": draft.options(_by_reference=not grpc_transport),
                         "verifier": verifier.options(_by_reference=not grpc_transport)}

    def _handle(self, role: Role, session_id: str) -> DeploymentHandle:
        return self._handles[role].options(session_id=session_id)  # affinity is per hop: set it every call

    async def propose(self, session_id: str, request: draft_pb2.ProposeRequest) -> draft_pb2.Proposal:
        reply = await own_request(lambda: self._handle("draft", session_id).propose.remote(request.SerializeToString()))
        return draft_pb2.Proposal.FromString(reply)

    async def verify(self, session_id: str, request: verifier_pb2.VerifyRequest) -> verifier_pb2.Verdict:
        reply = await own_request(lambda: self._handle("verifier", session_id).verify.remote(request.SerializeToString()))
        return verifier_pb2.Verdict.FromString(reply)

    async def release(self, role: Role, session_id: str) -> None:
        payload = common_pb2.SessionRef(session_id=session_id).SerializeToString()
        await own_request(lambda: self._handle(role, session_id).release.remote(payload))


class ReplicaGone(Exception):
    """A direct round call found no replica at the address it had (retryable)."""


class DirectRoundTransport:
    """Round calls straight to the replica's own gRPC server (our Draft/Verifier services). Serve
    still picks the replica: a session's first call asks the deployment, through the consistent
    hash router, for the address of the replica that owns the session; later rounds go straight
    there. A replica that stops answering is forgotten and the session asks again."""

    retryable = (ReplicaGone, RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
    CALL_TIMEOUT_S = 300.0  # a long prompt's prefill on CPU takes seconds; a hung replica is a bug

    def __init__(self, draft: DeploymentHandle, verifier: DeploymentHandle, api_key: str | None = None):
        self._handles = {"draft": draft, "verifier": verifier}
        self._addresses: dict[tuple[Role, str], str] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._metadata = call_metadata(api_key)

    async def _address(self, role: Role, session_id: str) -> str:
        key = (role, session_id)
        if key not in self._addresses:
            handle = self._handles[role].options(session_id=session_id)
            self._addresses[key] = await own_request(lambda: handle.address.remote())
        return self._addresses[key]

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=[("grpc.max_send_message_length", MAX_ROUND_MESSAGE_BYTES)])
        return self._channels[address]

    async def _call(self, role: Role, session_id: str, method: str, request):
        address = await self._address(role, session_id)
        stub = (draft_pb2_grpc.DraftStub if role == "draft" else verifier_pb2_grpc.VerifierStub)(self._channel(address))
        try:
            return await getattr(stub, method)(request, timeout=self.CALL_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(exc.details()) from None
            self._addresses.pop((role, session_id), None)
            if exc.code() == grpc.StatusCode.UNAVAILABLE and address in self._channels:
                await self._channels.pop(address).close()
            raise ReplicaGone(f"{role} at {address}: {exc.code().name}") from None

    async def propose(self, session_id: str, request: draft_pb2.ProposeRequest) -> draft_pb2.Proposal:
        return await self._call("draft", session_id, "Propose", request)

    async def verify(self, session_id: str, request: verifier_pb2.VerifyRequest) -> verifier_pb2.Verdict:
        return await self._call("verifier", session_id, "Verify", request)

    async def release(self, role: Role, session_id: str) -> None:
        try:
            await self._call(role, session_id, "Release", common_pb2.SessionRef(session_id=session_id))
        finally:
            self._addresses.pop((role, session_id), None)


def round_transport(kind: str, draft: DeploymentHandle, verifier: DeploymentHandle, api_key: str | None = None):
    if kind == "direct":
        return DirectRoundTransport(draft, verifier, api_key)
    return ServeRoundTransport(draft, verifier, grpc_transport=kind == "serve-grpc")


class CoordinatorDeployment:
    """A Serve replica is an async Ray actor: this one runs the loop for every session routed to it."""

    def __init__(self, draft: DeploymentHandle, verifier: DeploymentHandle, config: AppConfig):
        rules = build_rules(config.models, progress=False)
        transport = round_transport(config.round_transport, draft, verifier, config.key)
        self.coordinator = Coordinator(transport, rules, config.policy,
                                       observer=RayRoundMetrics())

    async def generate(self, payload: bytes) -> bytes:
        response = await self.coordinator.generate(generation_pb2.GenerateRequest.FromString(payload))
        return response.SerializeToString()

    async def generate_stream(self, payload: bytes) -> AsyncIterator[bytes]:
        async for chunk in self.coordinator.generate_stream(generation_pb2.GenerateRequest.FromString(payload)):
            yield chunk.SerializeToString()

    async def live_sessions(self) -> int:
        """Samples this replica is decoding (tests and the load benchmark read it)."""
        return len(self.coordinator.sessions)


# ------------------------------------------------------------------------------------------------
# The ingress

def user_error(exc: BaseException) -> str:
    """The one-line message of a user error raised in another replica (Ray wraps it: the original
    is `.cause`; its str() would carry the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return one_line(str(cause if cause is not None else exc))


# A coordinator replica that died (or none up yet): the request's work is lost, not wrong.
COORDINATOR_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


@contextlib.contextmanager
def coordinator_errors():
    """The coordinator's failures as the GenerationBackend's errors: user errors keep their one-line
    reason, backpressure becomes Overloaded, a lost replica Unavailable (retriable)."""
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidRequestError(user_error(exc)) from None
    except BackPressureError:
        raise Overloaded("the server is at capacity; retry later") from None
    except COORDINATOR_LOST as exc:
        logger.warning("coordinator lost: %s", type(exc).__name__)
        raise Unavailable("the replica serving this request failed; retry") from None


class CoordinatorBackend:
    """The coordinator behind a handle, as services.openai_api's GenerationBackend."""

    def __init__(self, handle: DeploymentHandle):
        self._handle = handle

    async def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        with coordinator_errors():
            payload = await self._handle.generate.remote(request.SerializeToString())
        return generation_pb2.GenerateResponse.FromString(payload)

    async def generate_stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateChunk]:
        stream = self._handle.options(stream=True).generate_stream.remote(request.SerializeToString())
        try:
            with coordinator_errors():
                async for payload in stream:
                    yield generation_pb2.GenerateChunk.FromString(payload)
        except (GeneratorExit, asyncio.CancelledError):
            # The consumer stopped early (the client went away): cancel the coordinator's work, which
            # frees its sessions. Best effort: the call may have ended meanwhile (cancel() then
            # raises its outcome).
            with contextlib.suppress(Exception):
                stream.cancel()
            raise


def parse_request(request: bytes | generation_pb2.GenerateRequest, max_bytes: int) -> generation_pb2.GenerateRequest:
    """The public request as the proxy hands it over (bytes: services/public_grpc.py), checked for
    size before it is parsed."""
    size = len(request) if isinstance(request, bytes) else request.ByteSize()
    if size > max_bytes:
        raise InvalidRequestError(f"the request is {size} bytes; the limit is {max_bytes}")
    if not isinstance(request, bytes):
        return request
    try:
        return generation_pb2.GenerateRequest.FromString(request)
    except DecodeError as exc:
        reason = str(exc).rpartition(": ")[2] or "wire format was corrupt"
        raise InvalidRequestError(f"the request is not a valid specdec.v1.GenerateRequest ({reason})") from None


class Unauthenticated(Exception):
    """A call without the configured API key."""


class GrpcIngress:
    """The public gRPC service (specdec.v1.Generation) on Serve's gRPC proxy: the proxy calls these
    methods by RPC name. Errors carry a status code and a one-line reason, never a traceback.
    The API key is checked here: Serve's gRPC proxy (Ray 2.60) takes no server interceptors, and
    hands the call's metadata to the servicer."""

    def __init__(self, coordinator: DeploymentHandle, config: AppConfig):
        self._backend = CoordinatorBackend(coordinator)
        self._api_key, self._max_bytes = config.key, config.max_request_bytes

    def _admit(self, request: bytes | generation_pb2.GenerateRequest, grpc_context) -> generation_pb2.GenerateRequest:
        if not key_matches(self._api_key, metadata_authorization(grpc_context.invocation_metadata())):
            raise Unauthenticated(MISSING_KEY)
        return parse_request(request, self._max_bytes)

    async def Generate(self, request: bytes | generation_pb2.GenerateRequest, grpc_context) -> generation_pb2.GenerateResponse:
        try:
            return await self._backend.generate(self._admit(request, grpc_context))
        except Exception as exc:  # noqa: BLE001 - mapped to a status, logged when it is a bug
            code, details = grpc_status(exc)
            grpc_context.set_code(code)
            grpc_context.set_details(details)
            return generation_pb2.GenerateResponse()

    async def GenerateStream(self, request: bytes | generation_pb2.GenerateRequest,
                             grpc_context) -> AsyncIterator[generation_pb2.GenerateChunk]:
        try:
            async for chunk in self._backend.generate_stream(self._admit(request, grpc_context)):
                yield chunk
        except Exception as exc:  # noqa: BLE001
            code, details = grpc_status(exc)
            grpc_context.set_code(code)
            grpc_context.set_details(details)
            raise RuntimeError(details) from None  # Serve keeps the code and details set above


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, user_error(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    logger.exception("request failed")
    return grpc.StatusCode.INTERNAL, "internal error"


def ingress_class(config: AppConfig) -> type:
    """The ingress: GrpcIngress plus the OpenAI HTTP routes, in one deployment (one Serve app, so
    gRPC clients need no `application` metadata)."""
    def make_http_app():
        from services.openai_api import create_app

        def backend():
            app_name = serve.get_replica_context().app_name
            return CoordinatorBackend(serve.get_deployment_handle("Coordinator", app_name=app_name))
        return create_app(backend, config.model_name, prometheus_text, api_key=config.key,
                          max_body_bytes=config.max_request_bytes)

    @serve.ingress(make_http_app)
    class Ingress(GrpcIngress):
        pass

    return Ingress


# ------------------------------------------------------------------------------------------------
# Builders

def _deployment(cls: type, name: str, replicas: ReplicaConfig, sticky: bool = False, **options):
    if replicas.autoscaling:
        options["autoscaling_config"] = replicas.autoscaling
    else:
        options["num_replicas"] = replicas.num_replicas
    if sticky:
        options["request_router_config"] = RequestRouterConfig(request_router_class=CONSISTENT_HASH_ROUTER)
    # Serve's inter-deployment gRPC (round_transport serve-grpc) receives at most 4 MiB by default.
    # No OMP_WAIT_POLICY: PASSIVE made every parallel region wake a sleeping thread, and a 2-thread
    # draft step then cost as much as a 1-thread one; libgomp's default short spin is faster here
    # even though the draft and the verifier take turns on the same cores (docs/benchmarks.md).
    env = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MAX_ROUND_MESSAGE_BYTES)}
    if replicas.threads:
        env["OMP_NUM_THREADS"] = str(replicas.threads)
    actor_options = {"num_cpus": replicas.num_cpus, "num_gpus": replicas.num_gpus, "runtime_env": {"env_vars": env}}
    if replicas.resources:
        actor_options["resources"] = dict(replicas.resources)
    for option in ("health_check_period_s", "health_check_timeout_s",
                   "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s"):
        if getattr(replicas, option) is not None:
            options[option] = getattr(replicas, option)
    # Per-call access logs cost ~1 ms a round call on these hot paths; Serve's metrics count calls.
    return serve.deployment(cls, name=name, max_ongoing_requests=replicas.max_ongoing_requests,
                            ray_actor_options=actor_options, logging_config={"enable_access_log": False},
                            **options)


def build_app(args: dict | AppConfig | None = None) -> serve.Application:
    """`serve run services.app:build_app [key=value ...]` or a config file's `args:`."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    draft = _deployment(Draft, "Draft", config.draft, sticky=True).bind(config)
    verifier = _deployment(Verifier, "Verifier", config.verifier, sticky=True).bind(config)
    # At capacity a request is refused at once (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED),
    # whether the proxies' queue for the ingress or the ingress's queue for a coordinator is full.
    bounded = {"max_queued_requests": config.max_queued_requests,
               "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=1)}
    coordinator = _deployment(CoordinatorDeployment, "Coordinator", config.coordinator,
                              **bounded).bind(draft, verifier, config)
    return _deployment(ingress_class(config), "Ingress", config.ingress, **bounded).bind(coordinator, config)
