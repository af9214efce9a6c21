"""The public entry points: the gRPC service specdec.v1.Generation on Serve's gRPC proxy and the
OpenAI-compatible HTTP routes (services/openai_api.py), in one deployment in front of the
coordinator. Errors reach clients as services/errors.py's table says: a status code and a line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

from google.protobuf.message import DecodeError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import DeploymentStatus, ReplicaState

from specdec.errors import InvalidRequestError, Overloaded, Unavailable
from specdec.v1 import generation_pb2
from services.auth import MISSING_KEY, key_matches, metadata_authorization
from services.config import AppConfig
from services.errors import Unauthenticated, grpc_status, user_error

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 5.0  # /health's wait for Serve's status
# A coordinator replica that died (or none up yet): the request's work is lost, not wrong.
COORDINATOR_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


@contextlib.contextmanager
def coordinator_errors():
    """The coordinator's failures as the GenerationBackend's errors: a user error raised in the
    coordinator comes out as itself (not Ray's wrapper), backpressure becomes Overloaded, a lost
    replica Unavailable (retriable)."""
    try:
        yield
    except BackPressureError:
        raise Overloaded("the server is at capacity; retry later") from None
    except COORDINATOR_LOST as exc:
        logger.warning("coordinator lost: %s", type(exc).__name__)
        raise Unavailable("the replica serving this request failed; retry") from None
    except Exception as exc:  # noqa: BLE001 - unwrapped when it is a user error, else re-raised as is
        cause = user_error(exc)
        if cause is exc:
            raise
        raise cause from None


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


def not_serving(deployments: dict) -> list[str]:
    """The deployments (serve.status()'s, by name) with no replica running where they should have one:
    one that died and is being replaced, or still loading. A deployment autoscaled to zero replicas
    (min_replicas 0) is HEALTHY with none, and starts one for the next request."""
    return sorted(name for name, deployment in deployments.items()
                  if not deployment.replica_states.get(ReplicaState.RUNNING)
                  and deployment.status != DeploymentStatus.HEALTHY)


# serve.status() blocks while Serve's controller restarts (its calls are retried until it is back):
# one read at a time, on a thread of its own, which the callers in the meantime wait for. A read per
# caller left a blocked thread each time it timed out, and /health's probes and the live cap's
# follower (services/replicas.py) took every thread of a replica's default executor within a minute
# or two (5 where the replica reserves no CPU), where its prompts are tokenized.
_STATUS_READS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve-status")
_status_read: Future | None = None


async def app_deployments() -> dict:
    """serve.status()'s deployments of this replica's app, by name; raises Unavailable where Serve's
    controller does not answer in READY_TIMEOUT_S (none does while it restarts)."""
    global _status_read
    app_name = serve.get_replica_context().app_name
    if _status_read is None or _status_read.done():
        _status_read = _STATUS_READS.submit(serve.status)
    try:  # (shielded: a caller that stops waiting leaves the read to the others)
        status = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(_status_read)), READY_TIMEOUT_S)
    except TimeoutError:
        raise Unavailable(f"Serve's controller did not answer in {READY_TIMEOUT_S:g} s") from None
    return status.applications[app_name].deployments


async def app_ready() -> None:
    """Raises Unavailable, naming them, where deployments of this replica's app cannot serve (Serve's
    own /-/healthz says only that its proxy answers)."""
    if waiting := not_serving(await app_deployments()):
        raise Unavailable(f"no replica of {', '.join(waiting)} is running yet")


def ingress_class(config: AppConfig) -> type:
    """The ingress: GrpcIngress plus the OpenAI HTTP routes, in one deployment (one Serve app, so
    gRPC clients need no `application` metadata)."""
    from services.metrics import prometheus_text

    def make_http_app():
        from services.openai_api import create_app

        def backend():  # (the deployment bound to the ingress, by its name: the builder has no `self`)
            app_name = serve.get_replica_context().app_name
            return CoordinatorBackend(serve.get_deployment_handle(config.loop_deployment, app_name=app_name))
        return create_app(backend, config.model_name, prometheus_text, api_key=config.key,
                          max_body_bytes=config.max_request_bytes, readiness=app_ready)

    @serve.ingress(make_http_app)
    class Ingress(GrpcIngress):
        pass

    return Ingress
