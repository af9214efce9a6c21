"""cluster/: every config validates against the schema of the tool that reads it (Serve's
ServeDeploySchema and our AppConfig, the Ray autoscaler's JSON schema shipped in the ray package,
the KubeRay resources' required fields), and placement is consistent across them: every custom
resource a replica asks for is advertised by some node type, in an amount that fits it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.serve._private.build_app import build_app as flatten_app
from ray.serve.schema import ServeDeploySchema

from services.app import build_app
from services.config import GRPC_SERVICER_FUNCTIONS, AppConfig, ReplicaConfig, SessionConfig
from specdec.builder import EngineConfig
from specdec.loop import BatchConfig

CLUSTER = Path(__file__).parents[2] / "cluster"
SERVE_CONFIGS = sorted((CLUSTER / "serve").glob("*.yaml"))
LAUNCHER_CONFIGS = sorted((CLUSTER / "launcher").glob("*.yaml"))
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
ROLES = ("draft", "verifier", "coordinator", "ingress")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def app_args(config: dict) -> AppConfig:
    (app,) = ServeDeploySchema.model_validate(config).applications
    return AppConfig.model_validate(app.args)


def kuberay(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text()) if d["apiVersion"] == "ray.io/v1"]
    return doc


def worker_group_resources(group: dict) -> dict[str, float]:
    """A KubeRay group's custom resources: rayStartParams.resources is a JSON object in a quoted string."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def gpu_limit(pod_template: dict) -> int:
    (container,) = pod_template["spec"]["containers"]
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_there_are_the_three_serve_configs():
    assert {p.name for p in SERVE_CONFIGS} >= {"local.yaml", "gpu.yaml", "multi-gpu.yaml"}


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_config_validates(path):
    config = load(path)
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "services.app:build_app" and app.route_prefix == "/"
    assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS
    assert schema.http_options.request_timeout_s and schema.grpc_options.request_timeout_s
    args = AppConfig.model_validate(app.args)
    for role in ROLES:
        replicas = getattr(args, role)
        assert replicas.graceful_shutdown_timeout_s is not None, role
        if role in ("coordinator", "ingress"):
            # A coordinator holds whole generations: it must wait for them longer than the proxy does.
            assert replicas.graceful_shutdown_timeout_s >= schema.http_options.request_timeout_s, role
            assert replicas.autoscaling, role
        else:
            assert replicas.health_check_timeout_s is not None, role


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_config_builds_the_deployments_it_says(path):
    """What Serve receives (the flattened app) carries the config's placement and lifecycle options."""
    args = app_args(load(path))
    deployments = {d.name: d for d in flatten_app(build_app(args), name="specdec").deployments}
    assert set(deployments) == {"Draft", "Verifier", "Coordinator", "Ingress"}
    for role in ROLES:
        replicas, deployment = getattr(args, role), deployments[role.capitalize()]
        options, config = deployment.ray_actor_options, deployment._deployment_config
        assert options["num_gpus"] == replicas.num_gpus and options.get("resources", {}) == replicas.resources
        assert replicas.env.items() <= options["runtime_env"]["env_vars"].items()
        assert config.graceful_shutdown_timeout_s == replicas.graceful_shutdown_timeout_s
        if replicas.autoscaling:
            assert config.autoscaling_config.max_replicas == replicas.autoscaling["max_replicas"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_the_loop_beside_the_verifier_deploys_no_coordinator(path):
    """`loop_placement: verifier`: the Verifier replicas hold whole generations, as a coordinator's do."""
    args = app_args(load(path)).model_copy(update={"loop_placement": "verifier"})
    deployments = {d.name: d for d in flatten_app(build_app(args), name="specdec").deployments}
    assert set(deployments) == {"Draft", "Verifier", "Ingress"}
    config = deployments["Verifier"]._deployment_config
    assert config.max_ongoing_requests == args.coordinator.max_ongoing_requests
    assert config.graceful_shutdown_timeout_s == max(args.coordinator.graceful_shutdown_timeout_s,
                                                     args.verifier.graceful_shutdown_timeout_s)
    assert deployments["Verifier"].ray_actor_options["num_gpus"] == args.verifier.num_gpus


def test_multi_gpu_verifier_takes_one_gpu_per_shard():
    args = app_args(load(CLUSTER / "serve" / "multi-gpu.yaml"))
    assert args.target_shards > 1 and args.verifier.num_gpus == args.target_shards
    assert args.draft.resources and args.verifier.resources
    assert set(args.draft.resources).isdisjoint(args.verifier.resources)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_the_coordinator_limits_requests_as_the_replicas_devices_do(path):
    # (the coordinator has no GPU in these configs: builder.build_rules takes the replicas' limits)
    args = app_args(load(path))
    gpus = args.verifier.num_gpus > 0
    assert args.model_devices() == ({"target": "cuda", "draft": "cuda"} if gpus else {"target": "cpu", "draft": "cpu"})


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_round_replicas_can_scale_to_their_most(path):
    """A replica's round calls in flight are at most the coordinators' lanes calling it (one batched
    call a step each): a target above what they can reach never added a replica (4 with 4 coordinators)."""
    args = app_args(load(path))
    callers = (args.coordinator.autoscaling or {}).get("max_replicas", args.coordinator.num_replicas)
    for role in ("draft", "verifier"):
        scaling = getattr(args, role).autoscaling
        if scaling and scaling["max_replicas"] > 1:
            reachable = callers * args.models.batch.lanes / scaling["target_ongoing_requests"]
            assert reachable >= scaling["max_replicas"], (role, reachable)


def capped(args: AppConfig, running: int = 0):
    from services.app import live_cap

    return live_cap(args).batch(args.models.batch, running)


def test_each_loop_decodes_no_more_sessions_than_the_replicas_hold_for_it():
    """Up to 4 coordinators share gpu.yaml's one verifier: its store holds 256 sessions, its static
    cache 64 rows, so 16 each. On the CPU the llama.cpp runtime's 64 sequences bound one loop."""
    from specdec.models.static import DEFAULT_SLOTS

    gpu = app_args(load(CLUSTER / "serve" / "gpu.yaml"))
    assert capped(gpu).max_live_sessions == DEFAULT_SLOTS // 4
    cpu = AppConfig()
    assert capped(cpu).max_live_sessions == min(cpu.sessions.max_sessions, cpu.models.llamacpp.sequences)
    assert capped(cpu).max_live_positions == cpu.models.llamacpp.context  # its unified cache
    local = app_args(load(CLUSTER / "serve" / "local.yaml"))  # up to 2 coordinators share its one verifier
    assert capped(local).max_live_positions == local.models.llamacpp.context // 2
    assert capped(gpu).max_live_positions is None  # a row of its own per session
    slots = cpu.model_copy(update={"models": cpu.models.model_copy(update={"runtime": "torch"})})
    assert capped(slots).max_live_sessions == cpu.sessions.max_sessions


def test_the_live_cap_follows_the_holders_running_and_leaves_room_for_the_rings_spread():
    """multi-gpu.yaml: 8 coordinators share draft and verifier replicas of 64 static rows each,
    autoscaled from 1 to 8. At one replica each loop keeps 8 sessions (the 64 rows over the most
    loops); as more run, more, up to 8 x 64 x RING_FILL / 8 = 42 (filled to 64 on average, the
    busiest replica on Serve's hash ring would hold more than its rows and evict the caches its
    steps read). A config with two replicas from the start gives them RING_FILL too."""
    from services.config import RING_FILL
    from specdec.models.static import DEFAULT_SLOTS

    multi = app_args(load(CLUSTER / "serve" / "multi-gpu.yaml"))
    assert [capped(multi, running).max_live_sessions for running in (0, 1, 2, 8, 9)] == \
        [8, 8, int(DEFAULT_SLOTS * 2 * RING_FILL) // 8, int(DEFAULT_SLOTS * 8 * RING_FILL) // 8,
         int(DEFAULT_SLOTS * 8 * RING_FILL) // 8]
    assert capped(multi, 8).max_live_sessions == 42
    two = AppConfig(verifier=ReplicaConfig(num_replicas=2), draft=ReplicaConfig(num_replicas=3),
                    coordinator=ReplicaConfig(num_replicas=1))
    cpu = AppConfig()
    held = min(cpu.sessions.max_sessions, cpu.models.llamacpp.sequences)
    assert capped(two).max_live_sessions == int(held * 2 * RING_FILL)
    assert capped(two).max_live_positions == int(cpu.models.llamacpp.context * 2 * RING_FILL)
    asked = two.model_copy(update={"models": two.models.model_copy(update={"batch": BatchConfig(max_live_sessions=5)})})
    assert capped(asked, 2).max_live_sessions == 5  # never past what the config asks


def test_two_thirds_of_the_replicas_rows_are_counted_exactly():
    """9 rows on each of 5 replicas, two thirds full: 30 sessions (4,095 positions on each: 13,650).
    Counted in floats, 9 x (5 x 2/3) came to 29.999... and the cap to 29."""
    from services.config import LiveCap

    nine = LiveCap(held=9, positions=None, holders=("Verifier",), fewest=5, most=5, loops=1)
    assert nine.batch(BatchConfig()).max_live_sessions == 30
    assert LiveCap(15, 4095, ("Verifier",), 5, 5, 1).batch(BatchConfig()).max_live_positions == 13650
    assert LiveCap(64, None, ("Verifier",), 8, 8, 8).batch(BatchConfig()).max_live_sessions == 42


def test_a_loop_raises_its_cap_as_its_sessions_leave():
    """Raised at once, a full loop's new sessions would spread over every replica running while its
    live ones stay where they are: one replica scaled to two, the first would take 64 + 8. It rises
    by the sessions that left since it last moved; where it holds none, at once; down, at once."""
    from services.config import toward

    now, target = BatchConfig(max_live_sessions=8, max_live_positions=800), BatchConfig(max_live_sessions=10,
                                                                                        max_live_positions=1000)
    assert toward(now, target, live=0, retired=0) == target
    assert (toward(now, target, live=8, retired=1).max_live_sessions, toward(now, target, 8, 1).max_live_positions) \
        == (9, 900)
    assert toward(now, target, live=8, retired=5) == target
    assert toward(target, now, live=10, retired=0) == now


def test_a_loop_in_a_verifier_replica_keeps_what_that_replica_holds():
    """`loop_placement: verifier`: a loop's target sessions are all on its own replica, whatever the
    loops; only the draft's replicas are shared. With the feature draft beside the target nothing
    is: the loop keeps all the replica holds (before, the 4 loops there might be split it in 4)."""
    scaling = {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}
    sessions = SessionConfig(max_sessions=64)  # (below the 256 asked)
    alone = AppConfig(models=EngineConfig(draft="default-feature", runtime="torch"), loop_placement="verifier",
                      verifier=ReplicaConfig(**scaling), sessions=sessions)
    assert alone.colocated_drafts() == ["default"]
    held = 64
    assert capped(alone).max_live_sessions == capped(alone, 4).max_live_sessions == held
    shared = AppConfig(models=EngineConfig(runtime="torch"), loop_placement="verifier", verifier=ReplicaConfig(**scaling),
                       draft=ReplicaConfig(autoscaling={"min_replicas": 1, "max_replicas": 8}), sessions=sessions)
    assert capped(shared).max_live_sessions == held // 4  # one draft replica shared by 4 loops
    assert capped(shared, 8).max_live_sessions == held  # 8 of them: at most what the loop's own replica holds


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_a_coordinator_at_its_live_cap_asks_for_another(path):
    """A coordinator past its live cap queues the rest: it autoscales at that many requests, so
    the waiting requests bring another coordinator rather than wait behind a full one."""
    args = app_args(load(path))
    if args.coordinator.autoscaling:
        assert args.coordinator.autoscaling["target_ongoing_requests"] <= capped(args).max_live_sessions


def test_gpu_replicas_fit_one_gpu_at_full_scale():
    args = app_args(load(CLUSTER / "serve" / "gpu.yaml"))
    used = sum(r.num_gpus * r.autoscaling["max_replicas"] for r in (args.draft, args.verifier))
    assert 0 < used <= 1.0


# ------------------------------------------------------------------------------------------------
# Ray cluster launcher

@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_validates_against_rays_schema(path):
    jsonschema.validate(load(path), json.loads(RAY_SCHEMA.read_text()))


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_node_types_host_the_multi_gpu_replicas(path):
    launcher, args = load(path), app_args(load(CLUSTER / "serve" / "multi-gpu.yaml"))
    types = launcher["available_node_types"]
    assert launcher["head_node_type"] in types
    for role in ("draft", "verifier"):
        replicas = getattr(args, role)
        (resource,) = replicas.resources
        (hosts,) = [t for t in types.values() if resource in t["resources"]]
        assert hosts["resources"].get("GPU", 0) >= replicas.num_gpus * hosts["resources"][resource] / replicas.resources[resource]
        assert hosts["min_workers"] <= hosts["max_workers"] and hosts["idle_timeout_s"] > 0
    assert any("pip install -e" in command for command in launcher["setup_commands"])


# ------------------------------------------------------------------------------------------------
# KubeRay

def test_rayservice_embeds_the_multi_gpu_serve_config():
    service = kuberay("rayservice.yaml")
    assert service["kind"] == "RayService" and service["metadata"]["name"]
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == load(CLUSTER / "serve" / "multi-gpu.yaml")


def test_rayservice_worker_groups_host_their_replicas():
    spec = kuberay("rayservice.yaml")["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["rayVersion"] == ray.__version__
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    args = app_args(yaml.safe_load(spec["serveConfigV2"]))
    groups = cluster["workerGroupSpecs"]
    for group in groups:
        assert group["groupName"] and 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for role in ("draft", "verifier"):
        replicas = getattr(args, role)
        (resource,) = replicas.resources
        (group,) = [g for g in groups if resource in worker_group_resources(g)]
        hosted = worker_group_resources(group)[resource] / replicas.resources[resource]
        assert gpu_limit(group["template"]) == replicas.num_gpus * hosted, role


def test_rayjob_runs_data_generation_then_head_training():
    job = kuberay("rayjob.yaml")
    spec = job["spec"]
    assert job["kind"] == "RayJob" and job["metadata"]["name"]
    entrypoint = spec["entrypoint"]
    assert entrypoint.index("specdec gen-data --config") < entrypoint.index("specdec train-head --config")
    # KubeRay's submitter pastes the entrypoint unquoted into a shell line: an operator outside
    # quotes would run what follows it in the submitter pod, not on the cluster.
    assert not {"&&", "||", ";", "|", "&"} & set(shlex.split(entrypoint)), entrypoint
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__ and cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert all(gpu_limit(g["template"]) >= 1 for g in cluster["workerGroupSpecs"])
    assert spec["shutdownAfterJobFinishes"] is True


def test_kuberay_images_are_the_one_the_dockerfile_builds():
    dockerfile = (CLUSTER / "kuberay" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile and "pip install --no-cache-dir -e" in dockerfile
    for name in ("rayservice.yaml", "rayjob.yaml"):
        spec = kuberay(name)["spec"]
        cluster = spec.get("rayClusterConfig") or spec["rayClusterSpec"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        images = {c["image"] for t in templates for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
        assert len(images) == 1, (name, images)
