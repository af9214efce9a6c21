"""services.config: replica options are checked where the config is read, before Ray sees them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import AppConfig, ReplicaConfig


def test_misspelt_autoscaling_key_is_rejected():
    # Serve's AutoscalingConfig itself would ignore the key and scale with its defaults.
    with pytest.raises(ValidationError, match="max_replica"):
        ReplicaConfig(autoscaling={"min_replicas": 1, "max_replica": 4})


def test_inconsistent_autoscaling_is_rejected_by_serves_own_rules():
    with pytest.raises(ValidationError, match="max_replicas"):
        ReplicaConfig(autoscaling={"min_replicas": 3, "max_replicas": 1})


@pytest.mark.parametrize(("policy", "reason"), [("nope", "No module named 'nop'"),
                                                ("services.autoscaling:nope", "has no attribute 'nope'")])
def test_an_autoscaling_policy_that_cannot_be_imported_is_refused_in_one_line(policy, reason):
    """Serve imports the policy as it checks the config: a missing one escaped as the import's own
    exception (ModuleNotFoundError, AttributeError), a traceback where the app is built."""
    from ray.serve.exceptions import RayServeException

    from services.app import build_app

    with pytest.raises(RayServeException) as caught:
        build_app({"draft": {"autoscaling": {"policy": {"policy_function": policy}}}})
    message = str(caught.value)
    assert message.startswith("draft.autoscaling: policy: cannot import") and reason in message, message
    assert "\n" not in message


@pytest.mark.parametrize("resources", [{"GPU": 1}, {"CPU": 2}, {"draft_node": -1}])
def test_resources_are_custom_and_non_negative(resources):
    with pytest.raises(ValidationError):
        ReplicaConfig(resources=resources)


def test_each_role_keeps_its_defaults_however_much_of_its_section_is_given():
    """Serve's defaults (20 s to shut down) cut off a coordinator's generations when `specdec serve`
    stopped, which said it let them finish; a section given in part (`coordinator: {autoscaling:
    ...}`) took ReplicaConfig's defaults, a whole CPU for a coordinator included."""
    from ray.serve._private.build_app import build_app as flatten_app

    from services.app import build_app
    from services.config import MODEL_REPLICAS, REQUEST_REPLICAS

    scaling = {"min_replicas": 1, "max_replicas": 2}
    for config in (AppConfig(), AppConfig.model_validate({"coordinator": {"autoscaling": scaling},
                                                          "ingress": ReplicaConfig(num_replicas=2),
                                                          "verifier": {"num_cpus": 2}})):
        deployments = {d.name: d for d in flatten_app(build_app(config), name="specdec").deployments}
        for role, defaults in (("draft", MODEL_REPLICAS), ("verifier", MODEL_REPLICAS),
                               ("coordinator", REQUEST_REPLICAS), ("ingress", REQUEST_REPLICAS)):
            replicas = getattr(config, role)
            assert {key: getattr(replicas, key) for key in defaults} == defaults, role
            deployed = deployments[role.capitalize()]._deployment_config
            assert deployed.graceful_shutdown_timeout_s == defaults["graceful_shutdown_timeout_s"], role
        assert deployments["Verifier"]._deployment_config.health_check_timeout_s == 60
        for name in ("Draft", "Verifier"):  # a round call waits for its session's replica, never another's
            routing = deployments[name]._deployment_config.request_router_config
            assert routing.request_router_kwargs == {"num_fallback_replicas": 0}, name
    assert REQUEST_REPLICAS["graceful_shutdown_timeout_s"] >= 900  # 2,048 tokens at a few tokens/s
    given = AppConfig(draft=ReplicaConfig(graceful_shutdown_timeout_s=5, health_check_timeout_s=None)).draft
    assert (given.graceful_shutdown_timeout_s, given.health_check_timeout_s) == (5, None)  # None: Serve's


def test_a_replica_without_a_gpu_of_its_own_sees_none():
    """Ray 2.60 no longer hides a node's GPUs from an actor that asks for none: `device: auto` took
    one nobody had given it, and the coordinator priced the CPU runtime's context."""
    from ray.serve._private.build_app import build_app as flatten_app

    from services.app import build_app

    config = AppConfig(verifier=ReplicaConfig(num_gpus=1), draft=ReplicaConfig(env={"CUDA_VISIBLE_DEVICES": "1"}))
    env = {d.name: d.ray_actor_options["runtime_env"]["env_vars"]
           for d in flatten_app(build_app(config), name="specdec").deployments}
    assert "CUDA_VISIBLE_DEVICES" not in env["Verifier"] and env["Draft"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["Coordinator"]["CUDA_VISIBLE_DEVICES"] == env["Ingress"]["CUDA_VISIBLE_DEVICES"] == ""
    assert config.model_devices() == {"target": "cuda", "draft": "cpu"}


def test_a_sharded_target_asks_a_gpu_per_shard():
    with pytest.raises(ValidationError, match="target_shards 2 needs verifier.num_gpus 2"):
        AppConfig(target_shards=2)
    assert AppConfig(target_shards=2, verifier=ReplicaConfig(num_gpus=2)).target_shards == 2


def test_a_replicas_environment_reaches_its_processes_and_leaves_the_apps_own_alone():
    from ray.serve._private.build_app import build_app as flatten_app

    from services.app import build_app

    config = AppConfig(draft=ReplicaConfig(env={"GOMP_SPINCOUNT": "1000"}, threads=2))
    deployments = {d.name: d for d in flatten_app(build_app(config), name="specdec").deployments}
    env = deployments["Draft"].ray_actor_options["runtime_env"]["env_vars"]
    assert env["GOMP_SPINCOUNT"] == "1000" and env["OMP_NUM_THREADS"] == "2"
    assert "GOMP_SPINCOUNT" not in deployments["Verifier"].ray_actor_options["runtime_env"]["env_vars"]
    for taken in ("OMP_NUM_THREADS", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"):
        with pytest.raises(ValidationError, match="set by the app"):
            ReplicaConfig(env={taken: "1"})
    with pytest.raises(ValidationError, match="names must be"):
        ReplicaConfig(env={"A=B": "1"})


def test_a_model_free_draft_reserves_no_cpu_or_gpu():
    """The suffix draft's deployment runs no model: with a whole core reserved for it, a 2-core
    machine had none left for the verifier, and the app waited forever; a model draft keeps the
    draft replicas' reservation."""
    from ray.serve._private.build_app import build_app as flatten_app

    from services.app import build_app
    from specdec.builder import EngineConfig

    config = AppConfig(models=EngineConfig(drafts={"suffix": "suffix"}),
                       draft=ReplicaConfig(num_cpus=1, num_gpus=1, resources={"draft_node": 1}))
    deployments = {d.name: d.ray_actor_options for d in flatten_app(build_app(config), name="specdec").deployments}
    suffix, model = deployments["Draft-suffix"], deployments["Draft"]
    assert (suffix["num_cpus"], suffix["num_gpus"], suffix.get("resources")) == (0.0, 0.0, None)
    assert (model["num_cpus"], model["num_gpus"], model["resources"]) == (1, 1, {"draft_node": 1})


@pytest.mark.parametrize("policy, reason", [
    ({"name": "bogus"}, "unknown policy 'bogus'"),
    ({"name": "oracle"}, "runs in process only"),
    ({"name": "fixed", "k": 0}, "k must be at least 1"),
    ({"name": "fixed", "k": 65}, "k must be at most 64"),
    ({"name": "specdec++", "threshold": 1.5}, "threshold must be in (0, 1)"),
])
def test_a_default_policy_no_request_could_run_is_refused_where_the_app_is_built(policy, reason):
    with pytest.raises(ValidationError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        AppConfig(policy=policy)
    assert AppConfig(policy={"name": "fixed", "k": 4}).policy.k == 4


@pytest.mark.parametrize("field", [{"max_queued_requests": 0}, {"draft": {"num_cpus": float("inf")}},
                                   {"verifier": {"health_check_period_s": float("inf")}},
                                   {"sessions": {"ttl_s": float("inf")}},
                                   {"coordinator": {"autoscaling": {"target_ongoing_requests": float("inf")}}}])
def test_values_serve_would_refuse_at_deploy_time_are_refused_in_the_config(field):
    with pytest.raises(ValidationError):
        AppConfig(**field)


def test_threads_past_any_machines_cores_are_refused_in_the_config():
    """A replica's torch.set_num_threads overflowed past a C int: each replica failed at start."""
    with pytest.raises(ValidationError, match="draft.threads\n  Input should be less than or equal to 4096"):
        AppConfig(draft={"threads": 99_999_999_999})
    assert AppConfig(verifier={"threads": 4096}).verifier.threads == 4096


def test_replicas_sized_two_ways_or_threads_no_replica_reads_are_refused():
    # Serve refuses the first at deploy time (the config dropped num_replicas); the second was never read
    with pytest.raises(ValidationError, match="num_replicas and autoscaling both set"):
        AppConfig(coordinator={"num_replicas": 3, "autoscaling": {"min_replicas": 1, "max_replicas": 2}})
    assert AppConfig(coordinator={"autoscaling": {"min_replicas": 1, "max_replicas": 2}}).coordinator.num_replicas == 1
    with pytest.raises(ValidationError, match="models.threads is not read when served: set draft.threads"):
        AppConfig(models={"threads": 2})
    with pytest.raises(ValidationError, match="model_name"):  # (/v1/models listed a model without a name)
        AppConfig(model_name="")


@pytest.mark.parametrize("key, reason", [
    ("", "must not be empty"),
    ("s3cret\n", "blanks at its ends"),  # (a secret file's newline: every request was refused)
    (" s3cret", "blanks at its ends"),
    ("sécret", "printable ASCII"),  # (an HTTP header carries latin-1, gRPC metadata ASCII)
])
def test_a_key_no_client_could_present_is_refused_given_or_from_the_environment(key, reason, monkeypatch):
    with pytest.raises(ValidationError, match=reason):
        AppConfig(api_key=key)
    monkeypatch.setenv("SPECDEC_API_KEY", key)
    if key:  # (an empty variable is no key)
        with pytest.raises(ValidationError, match=reason):
            AppConfig()
    monkeypatch.setenv("SPECDEC_API_KEY", "two words")
    assert AppConfig().api_key.get_secret_value() == "two words"


@pytest.mark.parametrize("models, reason", [
    ({"target": "no-such-model"}, "models: 'no-such-model': no such directory or file, and not a hub id"),
    ({"draft": "/no/such/draft.gguf"}, "models: /no/such/draft.gguf: no such .gguf file"),
    ({"drafts": {"second": "/no/such/dir"}}, "models: '/no/such/dir': no such directory or file"),
    ({"head": "/no/such/head"}, "models: no acceptance head at /no/such/head"),
])
def test_a_model_that_cannot_be_found_is_named_in_one_line_where_the_app_is_built(models, reason):
    """`serve deploy` with a mistyped model built the app, and every replica then failed to load it:
    the app ended DEPLOY_FAILED with the replicas' tracebacks. It is refused where the app is built,
    before any replica starts, as a RayServeException: Serve's controller, which runs the builder
    under `serve deploy`, shows such an error's text as the app's status message (any other
    exception's traceback)."""
    from ray.serve.exceptions import RayServeException

    from services.app import build_app

    with pytest.raises(RayServeException) as caught:
        build_app({"models": models})
    message = str(caught.value)
    assert message.startswith(reason) and "\n" not in message, message


def test_a_config_pydantic_refuses_is_one_line_where_the_app_is_built():
    """As a missing model: the reason of a config that does not validate (Serve's status message was
    pydantic's traceback)."""
    from ray.serve.exceptions import RayServeException

    from services.app import build_app

    with pytest.raises(RayServeException, match=r"^policy: unknown policy 'bogus'") as caught:
        build_app({"policy": {"name": "bogus"}})
    assert "\n" not in str(caught.value)


def test_the_models_are_checked_for_the_replicas_gpus_not_the_builders():
    """The builder may run where no GPU is (Serve's controller on a CPU head node): a config putting
    the models on the replicas' GPUs builds there."""
    from ray.serve._private.build_app import build_app as flatten_app

    from services.app import build_app

    config = AppConfig(models={"device": "cuda"}, draft=ReplicaConfig(num_gpus=1), verifier=ReplicaConfig(num_gpus=1))
    assert {d.name for d in flatten_app(build_app(config), name="specdec").deployments} >= {"Draft", "Verifier"}
