"""The served application's configuration: `serve run` / `serve deploy` pass a config file's
`args:` here (services.app:build_app), `specdec serve` builds it from its flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from ray.serve.config import AutoscalingConfig

from specdec.builder import MAX_THREADS, EngineConfig, draft_configs
from specdec.models.feature_files import is_feature_draft
from specdec.errors import InvalidRequestError
from specdec.loop import BatchConfig
from specdec.policies import PolicyConfig, resolve_policy
from services.auth import check_api_key, env_api_key
from services.coordinator import check_served_policy
from specdec.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_TTL_S

# The public gRPC service, for Serve's gRPC proxy (`grpc_options.grpc_servicer_functions`): the
# requests reach the ingress as bytes, so that it answers a malformed one (services/public_grpc.py).
GRPC_SERVICER_FUNCTIONS = ["services.public_grpc.add_generation_servicer"]
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"


class ReplicaConfig(BaseModel):
    """One deployment's replicas. `num_cpus`/`num_gpus`/`resources` are Ray's logical resources per
    replica: a replica starts only on a node with all of them free, which is how draft and
    verifier replicas are placed on the nodes meant for them (docs/operations.md, "Placement").
    `threads` is the CPU threads of its model (torch intra-op or llama.cpp; None: all cores). The health-check
    and graceful-shutdown fields are Serve's deployment options of the same names (None: Serve's
    default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_replicas: int = Field(1, ge=1)
    # {min_replicas, max_replicas, target_ongoing_requests, ...}: Serve's autoscaling_config;
    # replaces num_replicas when set.
    autoscaling: dict | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # Custom resources, e.g. {"draft_node": 1}: the node types that advertise them host the replicas.
    resources: dict[str, float] = {}
    max_ongoing_requests: int = Field(16, ge=1)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    # Environment variables of its replicas' processes (Ray's runtime_env env_vars), e.g. OpenMP's
    # (docs/serving.md, "Configuration", measures GOMP_SPINCOUNT where replicas share cores).
    env: dict[str, str] = {}
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    # A replica being stopped (downscale, upgrade) stops taking requests, then waits this long
    # between checks for in-flight ones, and at most graceful_shutdown_timeout_s in all.
    graceful_shutdown_wait_loop_s: float | None = Field(None, gt=0)
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0)

    @field_validator("autoscaling")
    @classmethod
    def _serve_autoscaling(cls, value: dict | None) -> dict | None:
        if value is None:
            return None
        # Serve's model checks the values but ignores unknown keys; a misspelt key would be lost.
        unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown autoscaling keys {unknown}; Serve's autoscaling_config takes "
                             f"{sorted(AutoscalingConfig.model_fields)}")
        try:
            AutoscalingConfig.model_validate(value)
        except (ImportError, AttributeError) as error:  # Serve imports a named policy as it checks it
            raise ValueError(f"policy: cannot import its policy_function ({error})") from None
        if any(isinstance(v, float) and not math.isfinite(v) for v in value.values()):
            raise ValueError("autoscaling values must be finite numbers")  # (Serve's model takes inf)
        return value

    def replicas(self) -> tuple[int, int, int]:
        """(at start, fewest, most): `num_replicas` thrice, or with autoscaling its initial, min and
        max replicas, Serve's defaults where unset."""
        if not self.autoscaling:
            return (self.num_replicas,) * 3
        scaling = AutoscalingConfig.model_validate(self.autoscaling)
        return scaling.initial_replicas or scaling.min_replicas, scaling.min_replicas, scaling.max_replicas

    @model_validator(mode="after")
    def _one_way_to_size(self) -> ReplicaConfig:
        # (Serve refuses both at deploy time; the config dropped num_replicas without a word)
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas and autoscaling both set: with autoscaling, size it by its "
                             "min_replicas / max_replicas (or initial_replicas)")
        return self

    @field_validator("env")
    @classmethod
    def _env_of_its_own(cls, value: dict[str, str]) -> dict[str, str]:
        taken = sorted({"OMP_NUM_THREADS", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"} & set(value))
        if taken:
            raise ValueError(f"{taken} are set by the app: use threads for OMP_NUM_THREADS")
        if any(not name or "=" in name for name in value):
            raise ValueError("environment variable names must be non-empty and without '='")
        return value

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        builtin = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(value))
        if builtin:
            raise ValueError(f"{builtin} are not custom resources: use num_cpus / num_gpus")
        if any(amount < 0 for amount in value.values()):
            raise ValueError("resource amounts must be >= 0")
        return value


class SessionConfig(BaseModel):
    """KV-cache sessions on each draft and verifier replica (LRU + TTL)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_sessions: int = Field(DEFAULT_MAX_SESSIONS, ge=1)
    ttl_s: float = Field(DEFAULT_TTL_S, gt=0)


# Where the sessions spread over several replicas of a deployment, Serve's hash ring on the session
# id loads the busiest above the mean: filled to what they hold on average, the busiest is past it
# almost always; filled to this share, seldom (benchmarks/ring_spread.py, docs/operations.md "Scale").
# A fraction, not a float: 9 rows x (5 replicas x 2/3) came to 29.999... and its cap to 29.
RING_FILL = Fraction(2, 3)


@dataclass(frozen=True)
class LiveCap:
    """What each round loop of a served app keeps live (its BatchConfig's `max_live_sessions`,
    `max_live_positions`): what one replica holding sessions keeps (`held` sessions: its store's
    `sessions.max_sessions` and its runtime's cache, the static cache's rows or llama.cpp's
    sequences; `positions`: llama.cpp's unified cache), on each of the replicas the loops share (of
    the deployments `holders`: the Draft deployments, and the Verifier where the loop runs on
    Coordinator replicas), times their replicas, over the most loops there may be, at RING_FILL
    where a session's replica is one of several; and where the loop runs in a Verifier replica
    (`own`), at most what that one holds: its sessions are all its own. Past it each step evicts
    the caches of the sessions the next one serves, and every round re-prefills (past a shared
    cache's positions, a step whose sessions all feed fails). The shared replicas count at their
    fewest (`fewest`) until a loop sees more of them running (`batch(asked, running)`, at most
    `most`); the loops count at their most, since each raises its own cap without knowing the others'."""

    held: int
    positions: int | None
    holders: tuple[str, ...]
    fewest: int
    most: int
    loops: int
    own: bool = False

    def batch(self, asked: BatchConfig, running: int = 0) -> BatchConfig:
        """`asked` capped for one loop, with `running` replicas of each holder (the fewest where fewer)."""
        if not self.holders:
            return asked.within(self.held, self.positions)
        replicas = min(max(self.fewest, running), self.most)
        share = Fraction(1) if replicas == 1 else replicas * RING_FILL
        sessions = max(1, int(self.held * share) // self.loops)
        positions = None if self.positions is None else max(1, int(self.positions * share) // self.loops)
        if self.own:
            sessions = min(sessions, self.held)
            positions = None if positions is None else min(positions, self.positions)
        return asked.within(sessions, positions)


def toward(current: BatchConfig, target: BatchConfig, live: int, retired: int) -> BatchConfig:
    """The live limits a loop moves to on its way to `target` (LiveCap): down at once; up at once
    where it holds no session (`live`), else by at most the sessions that left it since it last
    moved (`retired`). Raised at once, the sessions it admits spread over every replica running
    while its live ones stay on the fewer they are on, which would then hold more than they can
    (a follower's first read takes its target whole: LoopHost._follow)."""
    if target.max_live_sessions <= current.max_live_sessions or not live:
        return target
    sessions = min(target.max_live_sessions, current.max_live_sessions + retired)
    positions = target.max_live_positions
    if positions is not None:
        positions = max(current.max_live_positions or 0, positions * sessions // target.max_live_sessions)
    return target.model_copy(update={"max_live_sessions": sessions, "max_live_positions": positions})


# The defaults of each role's replicas, beside ReplicaConfig's. Draft and Verifier replicas run their
# torch work off the event loop, so they answer health checks mid-pass (Serve's 30 s timeout leaves
# little room on a loaded CPU); one being stopped waits a minute for its calls in flight (a session
# it drops re-prefills on another, losslessly). Coordinator and Ingress replicas run no model (no
# CPU reserved) and hold whole generations: stopped (Ctrl-C, downscale, upgrade) they let them
# finish, for up to 15 minutes (2,048 tokens at a few tokens/s on a CPU; Serve's default is 20 s).
MODEL_REPLICAS = {"health_check_period_s": 10.0, "health_check_timeout_s": 60.0, "graceful_shutdown_timeout_s": 60.0}
REQUEST_REPLICAS = {"num_cpus": 0.0, "max_ongoing_requests": 256, "graceful_shutdown_timeout_s": 900.0}
ROLE_DEFAULTS = {"draft": MODEL_REPLICAS, "verifier": MODEL_REPLICAS,
                 "coordinator": REQUEST_REPLICAS, "ingress": REQUEST_REPLICAS}


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    models: EngineConfig = EngineConfig()
    # The policy of requests that name none (and its k/threshold for requests that name it too).
    policy: PolicyConfig = PolicyConfig()
    # The name the OpenAI routes answer to (`model` in requests, /v1/models).
    model_name: str = Field("specdec", min_length=1)
    # Target shards per verifier replica (accelerate device map over its GPUs; 1 on CPU).
    target_shards: int = Field(1, ge=1)
    # Each role's replicas; what a role's section leaves out is its ROLE_DEFAULTS, then ReplicaConfig's.
    draft: ReplicaConfig = ReplicaConfig()
    verifier: ReplicaConfig = ReplicaConfig()
    coordinator: ReplicaConfig = ReplicaConfig()
    ingress: ReplicaConfig = ReplicaConfig()
    sessions: SessionConfig = SessionConfig()
    # Send sampled draft distributions without entries at or below this probability (0 = exact).
    sparsify_below: float = Field(0.0, ge=0, lt=1)
    # How round calls travel (docs/serving.md compares them):
    #   "direct": our Draft/Verifier gRPC services on each replica's own server; Serve's consistent
    #             hash router picks a session's replica once, on its first round;
    #   "serve-grpc": every round call through Serve's handle and router, over Serve's
    #             inter-deployment gRPC transport, carrying our protobuf bytes;
    #   "actor": the same through Ray actor calls.
    round_transport: Literal["direct", "serve-grpc", "actor"] = "direct"
    # Where a feature draft (one that reads the target's states) runs: "colocated", in the verifier's
    # replicas, so the states never leave the target's process and only tokens cross; "separate",
    # on Draft replicas of its own like a model draft, the states riding with its round calls.
    feature_draft_placement: Literal["colocated", "separate"] = "colocated"
    # Where the round loop runs: "coordinator", on Coordinator replicas of its own, which call the
    # draft and the verifier replicas every step; "verifier", in every Verifier replica, which calls
    # its target (and a feature draft beside it) in its process and only the other drafts' replicas
    # across: one call a step fewer. The ingress then sends each request to a Verifier replica, which
    # takes `coordinator`'s max_ongoing_requests and the longer graceful shutdown of the two, and a
    # request whose Verifier replica dies is retried by the client as one whose coordinator died
    # (docs/serving.md, "Where the loop runs").
    loop_placement: Literal["coordinator", "verifier"] = "coordinator"
    # Requests waiting for an ingress or a coordinator slot (per caller: each proxy, each ingress
    # replica) beyond which clients get HTTP 429 / RESOURCE_EXHAUSTED at once (-1: unbounded).
    max_queued_requests: int = Field(256, ge=-1)
    # Every route of both ingresses and the round services need `Authorization: Bearer <key>`
    # (docs/reliability.md, "Access"). Unset: the SPECDEC_API_KEY environment variable of the
    # process that builds the app, else no authentication.
    api_key: SecretStr | None = None
    # Largest request accepted: HTTP body bytes (413 beyond), gRPC request message bytes
    # (INVALID_ARGUMENT beyond). 1 MiB holds a 32k-token prompt several times over.
    max_request_bytes: int = Field(1 << 20, ge=1024)

    @field_validator("policy")
    @classmethod
    def _servable_policy(cls, value: PolicyConfig) -> PolicyConfig:
        """A default policy no request could run is refused where the app is built, not at every
        request (whether the named draft has a head is a request's own check)."""
        try:
            check_served_policy(resolve_policy(value, has_head=True))
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return value

    @field_validator("models")
    @classmethod
    def _threads_per_deployment(cls, value: EngineConfig) -> EngineConfig:
        if value.threads is not None:  # each replica sets its own (it was accepted and never read)
            raise ValueError("models.threads is not read when served: set draft.threads and verifier.threads")
        return value

    @model_validator(mode="after")
    def _a_gpu_per_shard(self) -> AppConfig:
        # (each verifier replica splits the target over the GPUs Ray gives it: a shard without one
        # failed at load, or took a GPU Ray had given nobody)
        if self.target_shards > 1 and self.verifier.num_gpus != self.target_shards:
            raise ValueError(f"target_shards {self.target_shards} needs verifier.num_gpus {self.target_shards} "
                             f"(a GPU per shard), got {self.verifier.num_gpus:g}")
        return self

    @field_validator("max_queued_requests")
    @classmethod
    def _serve_queue(cls, value: int) -> int:
        if value == 0:  # (Serve's own check, at deploy time, would end `serve run` with a traceback)
            raise ValueError("max_queued_requests must be -1 (unbounded) or at least 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _role_defaults(cls, data):
        """A role's section, given or not, starts from its ROLE_DEFAULTS: `coordinator:
        {autoscaling: ...}` alone keeps the coordinator's 0 CPUs and long shutdown."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for role, defaults in ROLE_DEFAULTS.items():
            given = data.get(role, {})
            if isinstance(given, ReplicaConfig):
                data[role] = given.model_copy(update={key: value for key, value in defaults.items()
                                                      if key not in given.model_fields_set})
            elif isinstance(given, dict):
                data[role] = defaults | given
        return data

    @model_validator(mode="before")
    @classmethod
    def _key_from_the_environment(cls, data):
        if isinstance(data, dict) and data.get("api_key") is None and env_api_key():
            data = {**data, "api_key": env_api_key()}
        return data

    @field_validator("api_key", mode="after")
    @classmethod
    def _presentable(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_api_key(value.get_secret_value())
        return value

    def colocated_drafts(self) -> list[str]:
        """The drafts that run in the verifier's replicas (at most one: a replica's gRPC server
        hosts one Draft service), decided once where the app is built."""
        if self.feature_draft_placement == "separate":
            return []
        names = [name for name, each in draft_configs(self.models).items() if is_feature_draft(each.draft)]
        if len(names) > 1:
            raise ValueError(f"feature drafts {names} cannot all sit beside the target (one can): set "
                             "feature_draft_placement: separate")
        return names

    def model_devices(self) -> dict[str, str]:
        """Where `models.device: auto` puts each role's models: on the GPU Ray gives a replica that
        asks for one (the coordinator, which may have none, takes its context limit from theirs)."""
        return {role: "cuda" if replicas.num_gpus > 0 else "cpu"
                for role, replicas in (("target", self.verifier), ("draft", self.draft))}

    @property
    def loop_deployment(self) -> str:
        """The deployment whose replicas run the round loop."""
        return "Verifier" if self.loop_placement == "verifier" else "Coordinator"

    @property
    def key(self) -> str | None:
        """The API key in clear, or None when authentication is off."""
        return self.api_key.get_secret_value() if self.api_key is not None else None
