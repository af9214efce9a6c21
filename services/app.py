"""The Ray Serve application: draft, verifier, coordinator and ingress deployments.

    Ingress (gRPC proxy: specdec.v1.Generation; HTTP: OpenAI routes)
      -> Coordinator (the round loop over every session: one batched call per step per role)
           --Propose batch-->  Draft (draft model + head + policies)       services/replicas.py
                               (one deployment per draft: Draft, Draft-<name> for `models.drafts`)
           --Verify batch--->  Verifier (target, sharded)

With `loop_placement: verifier` there is no Coordinator: each Verifier replica runs the loop of the
requests the ingress sends it, verifies in its process and sends only the Propose batches.

Round calls carry our protobuf messages (protos/specdec/v1), split per replica by the consistent
hash router on the session id, so a session's rounds find its KV cache (services/transports.py).
`build_app` is the `import_path` target of `serve run` / `serve deploy`; `specdec serve` calls it
too. services/ingress.py holds the ingress, services/errors.py the errors' statuses.
"""

from __future__ import annotations

from pydantic import ValidationError
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.exceptions import RayServeException

from specdec.builder import EngineConfig, cache_limits, check_sources, draft_configs
from specdec.training.config import config_error_message
from specdec.models.suffix import is_suffix_draft
from specdec.errors import ModelSourceError, Overloaded, SpecDecError, one_line
from specdec.params import DEFAULT_DRAFT
from services.autoscaling import POLICY as ROUND_CALLS_POLICY
from services.config import CONSISTENT_HASH_ROUTER, AppConfig, LiveCap, ReplicaConfig
from services.errors import RETRY_AFTER_S, TABLE
from services.ingress import ingress_class
from services.replicas import CoordinatorDeployment, Draft, Verifier
from services.server import MAX_ROUND_MESSAGE_BYTES


# ------------------------------------------------------------------------------------------------
# Builders

def _deployment(cls: type, name: str, replicas: ReplicaConfig, round_service: bool = False, **options):
    """`round_service` (Draft, Verifier): routed by session id, and autoscaled on its round calls
    unless the config names another policy (services/autoscaling.py)."""
    if replicas.autoscaling:
        policy = {"policy": {"policy_function": ROUND_CALLS_POLICY}} if round_service else {}
        options["autoscaling_config"] = policy | replicas.autoscaling
    else:
        options["num_replicas"] = replicas.num_replicas
    if round_service:
        # Strict affinity: a call waits for its session's replica rather than going to the next in the
        # ring when that one is at max_ongoing_requests (Serve's default, 2 fallbacks), which moved
        # sessions and rebuilt their caches over `serve-grpc` / `actor` (and placed a `direct`
        # session's cache on a replica its id does not lead to).
        options["request_router_config"] = RequestRouterConfig(request_router_class=CONSISTENT_HASH_ROUTER,
                                                               request_router_kwargs={"num_fallback_replicas": 0})
    # Serve's inter-deployment gRPC (round_transport serve-grpc) receives at most 4 MiB by default.
    # No OMP_WAIT_POLICY: PASSIVE made every parallel region wake a sleeping thread, and a 2-thread
    # draft step then cost as much as a 1-thread one; libgomp's default short spin is faster here
    # even though the draft and the verifier take turns on the same cores (docs/benchmarks.md).
    env = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MAX_ROUND_MESSAGE_BYTES)}
    if not replicas.num_gpus:
        # Ray (since 2.5x) no longer hides the node's GPUs from a replica that asks for none, where
        # `models.device: auto` would take one nobody gave it, and the coordinator's context limit
        # (AppConfig.model_devices) would be the CPU runtime's.
        env["CUDA_VISIBLE_DEVICES"] = ""
    env |= replicas.env
    if replicas.threads:
        env["OMP_NUM_THREADS"] = str(replicas.threads)
    actor_options = {"num_cpus": replicas.num_cpus, "num_gpus": replicas.num_gpus, "runtime_env": {"env_vars": env}}
    if replicas.resources:
        actor_options["resources"] = dict(replicas.resources)
    for option in ("health_check_period_s", "health_check_timeout_s",
                   "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s"):
        if getattr(replicas, option) is not None:
            options[option] = getattr(replicas, option)
    # Serve's per-call access log costs about as much as a small round call on these hot paths, and
    # Serve's metrics count the calls anyway.
    return serve.deployment(cls, name=name, max_ongoing_requests=replicas.max_ongoing_requests,
                            ray_actor_options=actor_options, logging_config={"enable_access_log": False},
                            **options)


def loop_host(verifier: ReplicaConfig, coordinator: ReplicaConfig) -> ReplicaConfig:
    """The Verifier's replicas where they run the round loop: they hold whole generations, so they
    take the coordinator's requests at once and wait for them as long as it would to shut down."""
    waits = [r.graceful_shutdown_timeout_s for r in (verifier, coordinator) if r.graceful_shutdown_timeout_s is not None]
    return verifier.model_copy(update={"max_ongoing_requests": coordinator.max_ongoing_requests,
                                       "graceful_shutdown_timeout_s": max(waits, default=None)})


def draft_replicas(replicas: ReplicaConfig, draft: EngineConfig) -> ReplicaConfig:
    """A draft deployment's replicas: `draft`'s, less every resource for a model-free draft (the
    suffix draft runs no model, microseconds a step: a whole core reserved for it can leave no room
    for the verifier on a small machine, and a GPU or a draft node's slot reserved for it is one a
    model cannot use)."""
    if is_suffix_draft(draft.draft):
        return replicas.model_copy(update={"num_cpus": 0.0, "num_gpus": 0.0, "resources": {}})
    return replicas


def draft_deployment_name(name: str) -> str:
    """"Draft" for the default draft, "Draft-<name>" for the others."""
    return "Draft" if name == DEFAULT_DRAFT else f"Draft-{name}"


def deployment_replicas(config: AppConfig) -> dict[str, ReplicaConfig]:
    """Each deployment the app runs, by its name, with its replicas: a Draft deployment per draft
    not colocated with the target, the Verifier (running the loop with `loop_placement: verifier`),
    the Coordinator otherwise, the Ingress."""
    colocated = config.colocated_drafts()
    replicas = {draft_deployment_name(name): draft_replicas(config.draft, each)
                for name, each in draft_configs(config.models).items() if name not in colocated}
    if config.loop_placement == "verifier":
        return replicas | {"Verifier": loop_host(config.verifier, config.coordinator), "Ingress": config.ingress}
    return replicas | {"Verifier": config.verifier, "Coordinator": config.coordinator, "Ingress": config.ingress}


def live_cap(config: AppConfig) -> LiveCap:
    """What each round loop keeps live (services/config.py LiveCap): the replicas the loops share are
    the Draft deployments' and the Verifier's, but where the loop runs in the Verifier's replicas
    (each then holds its own loop's sessions alone)."""
    replicas = deployment_replicas(config)
    loop = config.loop_deployment
    _, _, loops = replicas[loop].replicas()
    shared = {name: r.replicas() for name, r in replicas.items() if name not in ("Coordinator", "Ingress", loop)}
    sessions, positions = cache_limits(config.models, config.model_devices())
    held = min(limit for limit in (config.sessions.max_sessions, sessions) if limit is not None)
    fewest = max(1, min((r[1] for r in shared.values()), default=1))
    most = max(1, min((r[2] for r in shared.values()), default=1))
    return LiveCap(held, positions, tuple(sorted(shared)), fewest, most, loops, own=loop == "Verifier")


class AppConfigError(SpecDecError, RayServeException):
    """A config the app cannot be built from, its reason in one line. A RayServeException: where
    Serve's controller runs the builder (`serve deploy`, `serve run CONFIG`), the app's status
    message is such an error's text, and any other exception's traceback."""


def checked_config(args: dict | AppConfig | None) -> AppConfig:
    """The app's config, validated, its model sources and heads checked before any replica starts:
    a mistyped model failed in every replica as it loaded, and the app ended DEPLOY_FAILED with
    their tracebacks. A local path is checked where the app is built (under `serve deploy`, a task
    of Serve's controller on some node), so it must be there as on every node, as the coordinator's
    tokenizer needs anyway; a hub id is fetched by the replicas, as before. Raises AppConfigError."""
    try:
        config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
        check_sources(config.models, here=False)  # (the replicas' GPUs need not be visible here)
    except ValidationError as exc:
        raise AppConfigError(one_line(config_error_message(exc))) from None
    except ModelSourceError as exc:
        raise AppConfigError(f"models: {one_line(exc)}") from None
    return config


def build_app(args: dict | AppConfig | None = None) -> serve.Application:
    """`serve run services.app:build_app [key=value ...]` or a config file's `args:`."""
    config = checked_config(args)
    cap = live_cap(config)
    colocated = config.colocated_drafts()  # decided here, once: the replicas take it as given
    replicas = deployment_replicas(config)
    drafts = {name: _deployment(Draft, draft_deployment_name(name), replicas[draft_deployment_name(name)],
                                round_service=True).bind(config, name)
              for name in draft_configs(config.models) if name not in colocated}
    # At capacity a request is refused at once (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED),
    # whether the proxies' queue for the ingress or the ingress's queue for a coordinator is full.
    bounded = {"max_queued_requests": config.max_queued_requests,
               "backpressure_config": BackpressureConfig(status_code=TABLE[Overloaded].http,
                                                         retry_after_s=RETRY_AFTER_S[Overloaded])}
    if config.loop_placement == "verifier":  # each Verifier replica runs the loop of the requests it is sent
        coordinator = _deployment(Verifier, "Verifier", replicas["Verifier"],
                                  round_service=True, **bounded).bind(config, colocated, drafts, cap)
    else:
        verifier = _deployment(Verifier, "Verifier", replicas["Verifier"], round_service=True).bind(config, colocated)
        coordinator = _deployment(CoordinatorDeployment, "Coordinator", replicas["Coordinator"],
                                  **bounded).bind(drafts, verifier, config, colocated, cap)
    return _deployment(ingress_class(config), "Ingress", replicas["Ingress"], **bounded).bind(coordinator, config)
