"""Round transports: how the coordinator's batched calls reach the draft and verifier workers
(specdec/calls.py's RoundTransport; the in-process one is specdec.calls.LocalTransport).

A batch is split by the replica that owns each session, and the groups go out at once, one call
each. Over gRPC a Propose or Verify goes as a message on a stream kept open to that replica
(`RoundStreams`), the unary call where the replica holds no more streams or serves none (a replica
of an earlier version, during a rolling upgrade). Each draft (by name, `EngineConfig.drafts`) is a
service of its own: its replicas hold only its sessions, and a Propose goes to the draft it names.
A group whose replica does not answer (gone, restarting, unreachable, hung past the call timeout)
comes back `Unreachable` and its sessions forget their replica: the loop retries them, in full,
wherever Serve's router sends them next. Any other failure of a call comes back `Failed`: that
call's sessions fail, the other replicas' go on.

    GrpcTransport     our gRPC services at fixed addresses (a draft each, one verifier: tests, benchmarks)
    DirectTransport   our gRPC services on each replica's own server; Serve's consistent-hash
                      router names a session's replica once (its first round), then calls go there
    HandleTransport   every call through a Serve deployment handle ("serve-grpc": Serve's
                      inter-deployment gRPC carrying our protobuf bytes; "actor": Ray actor calls)
    BesideTransport   the loop in the verifier's replica (AppConfig.loop_placement "verifier"): the
                      target and a draft beside it called in the process, the other drafts by one
                      of the above
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import replace
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import Message

from specdec.calls import LocalTransport
from specdec.metrics import MS_PER_S
from specdec.params import DEFAULT_DRAFT
from specdec.protocol import BatchReply, CallTiming, Failed, ProposeItem, Role, StepPlan, Unreachable, VerifyItem
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.auth import call_metadata
from services.convert import (convert_items, merge_answers, plan_to_proto, proposal_from_proto,
                              propose_item_to_proto, timings_from_proto, unpacked_for_verifier, verdict_from_proto,
                              verify_item_to_proto)
from services.errors import from_grpc
from services.server import CHANNEL_KEEPALIVE, MAX_ROUND_MESSAGE_BYTES
from services.servicers import STREAMS_REFUSED

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 300.0  # a long prompt's prefill on CPU takes seconds; a hung replica is a bug
# A probe sent without items (the loop's curve probe) is routed as a session of this id: any
# verifier replica times it; they run on alike hardware.
PROBE_ROUTING_KEY = "probe"
# A replica answering these is not gone: the call's sessions fail instead of being retried
# (RESOURCE_EXHAUSTED: a message over the size limit would be over it again).
FINAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.RESOURCE_EXHAUSTED)
STUBS = {"draft": draft_pb2_grpc.DraftStub, "verifier": verifier_pb2_grpc.VerifierStub}
STREAMED = {"Propose": "ProposeStream", "Verify": "VerifyStream"}  # the round calls that go on a stream
REPLIES = {"Propose": draft_pb2.ProposalBatch, "Verify": verifier_pb2.VerdictBatch, "Release": common_pb2.ReleaseResponse}


class ReplicaGone(Exception):
    """A round call found no replica where it went (the loop retries its sessions)."""


class RoundStreams:
    """The round streams open to replicas: idle ones by (address, method), taken by one call at a
    time (a lane's step makes one call per replica, and lanes step at once). A stream whose call did
    not end with its reply (an error, a timeout, a cancelled request) is closed, never reused: its
    reply could still come. A replica that refused a new stream gets unary calls for a while; one
    that serves no streams (UNIMPLEMENTED: a version from before them, during a rolling upgrade)
    gets them until it is gone."""

    REFUSED_FOR_S = 30.0

    def __init__(self):
        self._idle: dict[tuple[str, str], list[grpc.aio.StreamStreamCall]] = {}
        self._refused: dict[str, float] = {}  # address -> when it refused
        self._unstreamed: set[str] = set()  # addresses whose replica serves no round streams

    def open(self, address: str) -> bool:
        """Whether calls to `address` go on streams now."""
        if address in self._unstreamed:
            return False
        refused = self._refused.get(address)
        return refused is None or time.monotonic() - refused > self.REFUSED_FOR_S

    async def call(self, stub, address: str, method: str, request: Message, timeout_s: float, metadata) -> Any:
        """One request on a stream of `method` to `address`: the reply, or raises grpc.aio.AioRpcError
        (or TimeoutError); None where the replica refused a new stream or serves none (call it unary)."""
        idle = self._idle.setdefault((address, method), [])
        while idle and idle[-1].done():  # ended while idle: its replica went or restarted
            idle.pop()
        stream, answered = (idle.pop() if idle else None), False
        try:
            if stream is None:
                # A new stream is written to once the replica accepts it (its initial metadata): a
                # write racing a refusal (too many streams, no API key) fails as INTERNAL and hides
                # the replica's status, which a read of the ended call raises.
                stream = getattr(stub, STREAMED[method])(metadata=metadata)
                await asyncio.wait_for(stream.initial_metadata(), timeout_s)
                if stream.done():
                    await stream.read()
            try:
                await stream.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                # The stream broke before the replica had the batch (its replica went between two
                # steps): gRPC's core says INTERNAL, or that the call ended; the replica is gone.
                raise stream_ended() from None
            reply = await asyncio.wait_for(stream.read(), timeout_s)
            if reply is grpc.aio.EOF:  # ended without a status to say why: the replica is going
                raise stream_ended()
            answered = True
            return reply
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.details() == STREAMS_REFUSED:
                self._refused[address] = time.monotonic()
                return None
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an earlier version's replica: not gone, and
                self._unstreamed.add(address)                # its unary calls answer
                return None
            raise
        finally:
            if answered:
                idle.append(stream)
            elif stream is not None:
                stream.cancel()

    def drop(self, address: str) -> None:
        """Close the idle streams to `address` and forget its refusal (its replica is gone: one of
        another version may come there)."""
        for key in [key for key in self._idle if key[0] == address]:
            for stream in self._idle.pop(key):
                stream.cancel()
        self._refused.pop(address, None)
        self._unstreamed.discard(address)

    def close(self) -> None:
        for streams in self._idle.values():
            for stream in streams:
                stream.cancel()
        self._idle.clear()


def stream_ended() -> grpc.aio.AioRpcError:
    """A round stream that broke under a call: its replica is gone (UNAVAILABLE: retried elsewhere)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the round stream ended")


class Service(NamedTuple):
    """A deployment that serves round calls: the verifier, or one of the drafts by name."""

    role: Role
    draft: str = DEFAULT_DRAFT

    def __str__(self) -> str:
        return self.role if self.draft == DEFAULT_DRAFT else f"{self.role} {self.draft!r}"


def service(role: Role, draft: str = DEFAULT_DRAFT) -> Service:
    """Which deployment serves a role's calls (there is one verifier)."""
    return Service(role, DEFAULT_DRAFT if role == "verifier" else draft)


VERIFIER = service("verifier")  # the one verifier deployment


class GrpcTransport:
    """Batched round calls over grpc.aio to the replica that owns each session; here one fixed
    address per role."""

    # Raised by `_send` or `_owner` when the replica is gone: its sessions come back Unreachable.
    retryable: tuple[type[BaseException], ...] = (ReplicaGone,)

    def __init__(self, draft_address: str | dict[str, str] | None = None, verifier_address: str | None = None,
                 api_key: str | None = None, timeout_s: float = CALL_TIMEOUT_S):
        """`draft_address`: the default draft's, or each draft's by name."""
        drafts = draft_address if isinstance(draft_address, dict) else {DEFAULT_DRAFT: draft_address}
        self._fixed = {service("draft", name): address for name, address in drafts.items()}
        self._fixed[VERIFIER] = verifier_address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams = RoundStreams()
        self._metadata, self.timeout_s = call_metadata(api_key), timeout_s
        self._in_flight: Counter[str] = Counter()  # calls under way, by address
        self._gone: set[str] = set()  # addresses with calls under way whose latest found no replica
        self._closing: set[asyncio.Task] = set()  # channels let go, closing (kept: tasks are weakly held)

    # ----------------------------------------------------------------------------------------
    # The calls

    async def propose(self, items: list[ProposeItem], plan: StepPlan = StepPlan(),
                      draft: str = DEFAULT_DRAFT) -> BatchReply:
        return await self._batched(
            service("draft", draft), items, lambda group: plan_to_proto(  # the other replicas' sessions share the step too
                replace(plan, other_sessions=plan.other_sessions + len(items) - len(group)),
                [propose_item_to_proto(i) for i in group]),
            lambda reply: ([proposal_from_proto(p) for p in reply.proposals], reply.draft_ms))

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> BatchReply:
        """A probe goes with the first item's group, or alone (routed as PROBE_ROUTING_KEY)."""
        if not items and probe_tokens:
            owner = await self._owner_or_none(VERIFIER, PROBE_ROUTING_KEY)
            if owner is None:
                return BatchReply([], [], [])
            request = verifier_pb2.VerifyBatch(probe_tokens=probe_tokens)
            try:
                reply = await self._send(VERIFIER, owner, "Verify", request, PROBE_ROUTING_KEY)
            except self.retryable:
                # Forgotten as a session's replica is (`_batched`): kept, every later probe went to
                # the gone replica (each failed, or hung its lane's step for the call timeout).
                self._forget(VERIFIER, PROBE_ROUTING_KEY)
                raise
            return BatchReply([], [], timings_from_proto(reply.passes))
        return await self._batched(
            VERIFIER, items, lambda group: verifier_pb2.VerifyBatch(
                items=[verify_item_to_proto(i) for i in group], probe_tokens=probe_tokens if group[0] is items[0] else 0),
            lambda reply: ([verdict_from_proto(v) for v in reply.verdicts], reply.target_ms))

    async def release(self, role: Role, session_ids: list[str], draft: str = DEFAULT_DRAFT) -> None:
        """Best effort, per replica: a session whose replica is unknown has nothing to free there."""
        served_by, groups = service(role, draft), {}
        for session_id in session_ids:
            owner = self._known_owner(served_by, session_id)
            if owner is not None:
                groups.setdefault(owner, []).append(session_id)
            self._forget_released(served_by, session_id)
        results = await asyncio.gather(
            *(self._send(served_by, owner, "Release", common_pb2.SessionRefs(session_ids=ids), ids[0])
              for owner, ids in groups.items()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.debug("release on the %s failed: %s", served_by, result)

    async def _batched(self, served_by: Service, items: list, to_request: Callable[[list], Message],
                       from_reply: Callable[[Message], tuple[list, float]]) -> BatchReply:
        """One call per replica of the `served_by` deployment (`service`) that owns some of the items."""
        role = served_by.role
        answers: list = [None] * len(items)
        groups: dict[str | None, list[int]] = {}
        for i, owner in enumerate(await asyncio.gather(*(self._owner_or_none(served_by, it.session_id) for it in items))):
            groups.setdefault(owner, []).append(i)
        calls, passes = [], []

        def carried(i: int) -> bool:
            try:
                to_request([items[i]])
                return True
            except Exception as exc:  # noqa: BLE001
                logger.warning("%s item of session %s not sent: %s", role, items[i].session_id, exc)
                answers[i] = Failed(exc)
                return False

        async def call(owner: str | None, indices: list[int]) -> None:
            group = [items[i] for i in indices]
            if owner is None:  # no replica to be found now
                for i in indices:
                    answers[i] = Unreachable(f"no {served_by} replica")
                return
            try:
                request = to_request(group)
            except Exception:  # noqa: BLE001 - an item the wire cannot carry fails its session only
                indices = [i for i in indices if carried(i)]
                if not indices:
                    return
                group = [items[i] for i in indices]
                request = to_request(group)
            start = time.perf_counter()
            try:
                reply = await self._send(served_by, owner, "Propose" if role == "draft" else "Verify", request,
                                         group[0].session_id)
                group_answers, compute_ms = from_reply(reply)
                if len(group_answers) != len(indices):
                    raise RuntimeError(f"the {role} at {owner} answered {len(group_answers)} of {len(indices)} items")
            except self.retryable as exc:
                for i, item in zip(indices, group):
                    self._forget(served_by, item.session_id)
                    answers[i] = Unreachable(str(exc) or type(exc).__name__)
                return
            except Exception as exc:  # noqa: BLE001 - this replica's call failed for good: its sessions only
                logger.warning("%s call to %s failed: %s", role, owner, exc)
                for i in indices:
                    answers[i] = Failed(exc)
                return
            wall_s = time.perf_counter() - start
            for i, answer in zip(indices, group_answers):
                answers[i] = answer
            passes.extend(timings_from_proto(reply.passes))
            calls.append(CallTiming(indices, compute_ms / MS_PER_S, wall_s, request.ByteSize() + reply.ByteSize()))

        await asyncio.gather(*(call(owner, indices) for owner, indices in groups.items()))
        return BatchReply(answers, calls, passes)

    # ----------------------------------------------------------------------------------------
    # Replicas

    async def _owner(self, served_by: Service, session_id: str) -> str:
        """The address of the replica of `served_by` (`service`) that holds (or will hold) the session."""
        return self._fixed[served_by]

    def _known_owner(self, served_by: Service, session_id: str) -> str | None:
        return self._fixed[served_by]

    def _forget(self, served_by: Service, session_id: str) -> None:
        """The session's replica is gone or it left: look it up again next time."""

    def _forget_released(self, served_by: Service, session_id: str) -> None:
        """The session left `served_by`."""
        self._forget(served_by, session_id)

    async def _owner_or_none(self, served_by: Service, session_id: str) -> str | None:
        try:
            return await self._owner(served_by, session_id)
        except self.retryable:
            return None

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=[("grpc.max_send_message_length", MAX_ROUND_MESSAGE_BYTES),
                                  ("grpc.max_receive_message_length", MAX_ROUND_MESSAGE_BYTES), *CHANNEL_KEEPALIVE])
        return self._channels[address]

    async def _send(self, served_by: Service, owner: str, method: str, request: Message, routing_key: str) -> Any:
        """The call to `owner`, raising ReplicaGone where no replica answered there. Once no call to
        an address is under way and the latest found its replica gone, its channel and streams are
        let go: kept, each gone replica's channel tried to reconnect every two minutes or so for the
        coordinator's life (the address is not called again: its sessions moved) and its streams
        stayed listed. A later call to that address opens them again."""
        self._in_flight[owner] += 1
        try:
            reply = await self._call(served_by, owner, method, request)
            self._gone.discard(owner)
            return reply
        except Exception as exc:  # (any other: a final status, a replica answered there)
            (self._gone.add if isinstance(exc, ReplicaGone) else self._gone.discard)(owner)
            raise
        finally:
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]
                if owner in self._gone:
                    self._let_go(owner)

    async def _call(self, served_by: Service, owner: str, method: str, request: Message) -> Any:
        stub = STUBS[served_by.role](self._channel(owner))
        try:
            if method in STREAMED and self._streams.open(owner):
                reply = await self._streams.call(stub, owner, method, request, self.timeout_s, self._metadata)
                if reply is not None:
                    return reply
            return await getattr(stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:  # the channel stays while other calls share it (`_send`)
            if exc.code() in FINAL_CODES:
                raise from_grpc(exc.code(), exc.details()) from None
            raise ReplicaGone(f"{served_by} at {owner}: {exc.code().name}") from None
        except TimeoutError:
            raise ReplicaGone(f"{served_by} at {owner}: no answer in {self.timeout_s:g} s") from None

    def _let_go(self, address: str) -> None:
        self._gone.discard(address)
        self._streams.drop(address)
        if (channel := self._channels.pop(address, None)) is not None:
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._streams.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing)


def own_request(call: Callable[[], Any]) -> Any:
    """Make a handle call as a request of its own, outside the caller's Serve request context.
    Ray 2.60 gives a child call its parent's internal request id and the request router indexes
    pending requests by that id, so concurrent calls from one request would collide and all but
    one wait forever."""
    return contextvars.Context().run(call)


def _serve_retryable() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return ReplicaGone, RayActorError, ReplicaUnavailableError, DeploymentUnavailableError


class DirectTransport(GrpcTransport):
    """Our gRPC services on each replica's own server. Serve still picks the replica: a session's
    first call asks the deployment, through the consistent hash router, for the address of the
    replica that owns the session; later rounds go straight there. A draft served by the
    verifier's replicas (`colocated`) goes where the session's verifier is."""

    def __init__(self, draft, verifier, api_key: str | None = None, colocated: Sequence[str] = ()):
        """`draft`: the default draft's deployment handle, or each draft's by name; `colocated`: the
        drafts the verifier's replicas serve (their calls go through its handle)."""
        super().__init__(api_key=api_key)
        self.retryable = _serve_retryable()
        drafts = draft if isinstance(draft, dict) else {DEFAULT_DRAFT: draft}
        self._colocated = {service("draft", name) for name in colocated}
        self._handles = {service("draft", name): handle for name, handle in drafts.items()}
        self._handles |= {colocated_draft: verifier for colocated_draft in self._colocated}
        self._handles[VERIFIER] = verifier
        self._owners: dict[tuple[Service, str], str] = {}
        self._sharing = [VERIFIER, *self._colocated]  # the services whose sessions share a replica

    def _beside(self, served_by: Service) -> list[Service]:
        """The services whose sessions share a replica with `served_by`'s, itself included."""
        return self._sharing if served_by in self._sharing else [served_by]

    async def _owner(self, served_by: Service, session_id: str) -> str:
        # Kept for each service apart, each forgotten by its own release: one kept for both, the
        # first release forgot it and the other sent none (its sessions waited for their TTL).
        if (owner := self._owners.get((served_by, session_id))) is None:
            if (owner := self._known_owner(served_by, session_id)) is None:
                owner = await self._look_up(served_by, session_id)
            self._owners[served_by, session_id] = owner
        return owner

    async def _look_up(self, served_by: Service, session_id: str) -> str:
        """Ask the router which replica a session goes to (a colocated draft's: the verifier's)."""
        handle = self._handles[served_by].options(session_id=session_id)
        return await own_request(lambda: handle.address.remote())

    def _known_owner(self, served_by: Service, session_id: str) -> str | None:
        """Its own, else the replica of a service beside it (a draft beside the verifier goes where the
        session's verifier is, and the other way round)."""
        for each in self._beside(served_by):
            if (owner := self._owners.get((each, session_id))) is not None:
                return owner
        return None

    def _forget(self, served_by: Service, session_id: str) -> None:
        for each in self._beside(served_by):  # the replica is gone, for the services beside it too
            self._owners.pop((each, session_id), None)

    def _forget_released(self, served_by: Service, session_id: str) -> None:
        self._owners.pop((served_by, session_id), None)


class HandleTransport(DirectTransport):
    """Every round call through the deployment handle, carrying our protobuf bytes over Serve's
    gRPC transport (`grpc_transport`) or as Ray actor calls. The consistent hash router places a
    call by one session id (strictly: no fallback to another replica, services/app.py), so a group
    goes by an id the router last sent to the replica holding the group's sessions (`_routes`).
    Once a replica is added or replaced the ring changes, and a call may land elsewhere (a group
    routed by its first session's id moved whole each time that session changed, and left its
    copies until their TTL). A reply names the replica that answered (`replica`); where that is not
    the group's, each of its sessions is looked up by its own id, as a new one is, and its copies
    elsewhere are released. Releases go straight to the owner's own gRPC server. A call given up on
    (the call timeout, its caller cancelled) is cancelled on its replica."""

    RELEASE_TIMEOUT_S = 5.0  # a moved session's old copy: best effort, its TTL frees it otherwise

    def __init__(self, draft, verifier, api_key: str | None = None, grpc_transport: bool = True,
                 colocated: Sequence[str] = ()):
        drafts = draft if isinstance(draft, dict) else {DEFAULT_DRAFT: draft}
        super().__init__({name: handle.options(_by_reference=not grpc_transport) for name, handle in drafts.items()},
                         verifier and verifier.options(_by_reference=not grpc_transport), api_key,
                         colocated=colocated)
        self._routes: dict[str, str] = {}  # a replica's address -> a session id the router last sent there
        self._releases: set[asyncio.Task] = set()  # old copies being released (kept: tasks are weakly held)

    async def _look_up(self, served_by: Service, session_id: str) -> str:
        owner = await super()._look_up(served_by, session_id)
        self._routes[owner] = session_id
        return owner

    async def _send(self, served_by: Service, owner: str, method: str, request: Message, routing_key: str) -> Any:
        if method not in STREAMED:  # a Release: to the replica that holds the sessions
            return await super()._send(served_by, owner, method, request, routing_key)
        key = self._routes.get(owner, routing_key)
        handle = self._handles[served_by].options(session_id=key)  # affinity is per hop: set it every call
        try:
            response = own_request(lambda: getattr(handle, method.lower()).remote(request.SerializeToString()))
            payload = await asyncio.wait_for(response, self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:  # (raised by the wait: `response` is set)
            # Given up on (no answer in time, or its caller cancelled): cancelled on its replica as
            # well. Cancelling only the wait left a Ray actor call (`actor`) running there.
            response.cancel()
            if not isinstance(exc, TimeoutError):
                raise
            self._routes.pop(owner, None)
            raise ReplicaGone(f"{served_by}: no answer in {self.timeout_s:g} s") from None
        except self.retryable:
            self._routes.pop(owner, None)
            raise
        reply = REPLIES[method].FromString(payload)
        answered = reply.replica or owner  # (a replica of an earlier version names none)
        if answered == owner:
            self._routes[owner] = key
        else:
            if self._routes.get(owner) == key:
                del self._routes[owner]  # that id leads elsewhere now
            await self._moved(served_by, owner, answered, [item.session_id for item in request.items])
        return reply

    async def _moved(self, served_by: Service, owner: str, answered: str, session_ids: list[str]) -> None:
        """The router sent the sessions of `owner` to `answered`, which rebuilt their caches: the
        ring changed. Each session now belongs where its own id leads (looked up). Its copy at
        `owner` is a round behind and is released, as is the one at `answered` unless the session
        stays there (in the background, best effort: a replica may be gone). A lookup that fails
        leaves the session to be looked up next time."""
        beside = self._beside(served_by)  # a draft beside the verifier moves with it
        moving = [s for s in session_ids if any(self._owners.get((each, s)) == owner for each in beside)]
        homes = await asyncio.gather(*(self._look_up(served_by, s) for s in moving), return_exceptions=True)
        stale: dict[tuple[Service, str], list[str]] = {}
        for session_id, home in zip(moving, homes):
            home = None if isinstance(home, BaseException) else home
            for each in beside:
                if self._owners.get((each, session_id)) != owner:
                    continue
                if home is None:
                    del self._owners[each, session_id]
                else:
                    self._owners[each, session_id] = home
                for address in {owner} | ({answered} - {home}):
                    stale.setdefault((each, address), []).append(session_id)
        for (each, address), ids in stale.items():
            task = asyncio.create_task(self._release_at(each, address, ids))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release_at(self, served_by: Service, address: str, session_ids: list[str]) -> None:
        try:
            await asyncio.wait_for(self._send(served_by, address, "Release",
                                              common_pb2.SessionRefs(session_ids=session_ids), session_ids[0]),
                                   self.RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the copies then wait for their TTL
            logger.debug("release of moved sessions on the %s at %s failed: %s", served_by, address, exc)

    async def close(self) -> None:
        await asyncio.gather(*self._releases)  # (each bounded, each swallowing its own failure)
        await super().close()


class BesideTransport:
    """The round loop beside the verifier, in its replica (AppConfig.loop_placement "verifier"): the
    target, and a feature draft placed beside it, are called in the process on the replica's torch
    thread (`local`: LocalTransport with its executor); the other drafts' calls go to their replicas
    (`remote`). A step with a model draft makes one call across processes where the coordinator's
    makes two, and with the feature draft beside its target none."""

    def __init__(self, local: LocalTransport, remote: GrpcTransport):
        self.local, self.remote = local, remote

    def _carrier(self, role: Role, draft: str) -> LocalTransport | GrpcTransport:
        return self.local if role == "verifier" or draft in self.local.drafts else self.remote

    async def propose(self, items: list[ProposeItem], plan: StepPlan = StepPlan(),
                      draft: str = DEFAULT_DRAFT) -> BatchReply:
        return await self._carrier("draft", draft).propose(items, plan, draft)

    async def verify(self, items: list[VerifyItem], probe_tokens: int = 0) -> BatchReply:
        """A q_i that does not unpack (a draft replica's bug) refuses its item alone, as the Verifier
        service would."""
        vocab = self.local.verifier.target.vocab_size
        converted, refused = convert_items(items, lambda item: unpacked_for_verifier(item, vocab))
        reply = await self.local.verify(converted, probe_tokens)
        if not refused:
            return reply
        kept = [i for i in range(len(items)) if i not in refused]
        calls = [replace(call, indices=[kept[j] for j in call.indices]) for call in reply.calls]
        return BatchReply(merge_answers(len(items), reply.answers, refused), calls, reply.passes)

    async def release(self, role: Role, session_ids: list[str], draft: str = DEFAULT_DRAFT) -> None:
        await self._carrier(role, draft).release(role, session_ids, draft)

    async def close(self) -> None:
        await self.remote.close()


def round_transport(kind: str, draft, verifier, api_key: str | None = None, colocated: Sequence[str] = ()
                    ) -> GrpcTransport:
    """`colocated`: the drafts the verifier's replicas serve (`draft` has no handle for them);
    `verifier` None: the drafts' calls only (the loop beside the verifier: `BesideTransport`)."""
    if kind == "direct":
        return DirectTransport(draft, verifier, api_key, colocated=colocated)
    return HandleTransport(draft, verifier, api_key, grpc_transport=kind == "serve-grpc", colocated=colocated)
