"""cluster/serve/multi-gpu.yaml on a real two-node Ray cluster on this machine: a head node that
stands in for a draft node and a second node that stands in for a verifier node, each advertising
the custom resource the config's replicas ask for. Replicas must land where the config says and a
request must complete over gRPC and HTTP.

The nodes are `ray start --block` processes this module starts and terminates itself (terminating
the --block process stops its node), in their own temp dir, on free ports and with an auth token of
their own, so they neither meet other Ray instances on the machine nor outlive the test. The mapping to this machine: tiny models,
no GPUs, a tenth of a CPU per replica, both proxies' ports free ones, and proxies on the head only
(both "nodes" share one IP, so every-node proxies would bind the same ports twice)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest
import ray
import yaml
from ray import serve
from ray._raylet import AuthenticationTokenLoader, Config
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema
from ray.util.state import list_actors

from specdec.v1 import generation_pb2, generation_pb2_grpc
from services.app import build_app
from services.config import AppConfig
from engine_backend import free_ports

CONFIG = Path(__file__).parents[2] / "cluster" / "serve" / "multi-gpu.yaml"
NODE_START_TIMEOUT_S = 120
REPLICAS_PER_ROLE = 2  # more than one, so a replica placed by chance would show


NODE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
              "dashboard-agent-grpc-port", "dashboard-agent-listen-port")


def node_ports(ports: list[int]) -> list[str]:
    """Every port a node would otherwise take at a fixed default (agents, metrics, managers)."""
    return [f"--{name}={port}" for name, port in zip(NODE_PORTS, ports, strict=True)]


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def use_auth_env(values: dict[str, str | None]) -> None:
    """Ray's token authentication for this process (the nodes inherit the environment); Ray
    caches the mode and the token, so both are reloaded."""
    for name in AUTH_ENV:
        if values.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = values[name]
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class NodeExited(RuntimeError):
    pass


class Node:
    def __init__(self, args: list[str], log: Path):
        self.path = log
        self.log = log.open("wb")
        # Its own process group: terminating it reaches nothing of the test process.
        self.process = subprocess.Popen([shutil.which("ray") or "ray", "start", "--block", *args],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # --block stops the node's processes, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):  # whatever the node left behind, e.g. after a failed start
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()


def wait_for(condition, nodes: list[Node], logs: Path) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while not condition():
        for node in nodes:
            if node.process.poll() is not None:
                raise NodeExited(f"a ray node exited ({node.process.returncode}); logs in {logs}; "
                                 f"{node.path.name} ends:\n{node.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the nodes did not come up within {NODE_START_TIMEOUT_S}s; logs in {logs}")
        time.sleep(0.5)


def start_node(args, log: Path, condition, nodes: list[Node], logs: Path, attempts: int = 3) -> None:
    """Starts a node (args() gives its arguments, free ports drawn afresh) and waits for condition.
    A free port can be taken by another process between being drawn and being bound, which makes
    `ray start` exit: such a start is tried again on other ports."""
    for attempt in range(attempts):
        node = Node(args(), log.with_suffix(f".{attempt}.out"))
        nodes.append(node)
        try:
            wait_for(condition, nodes, logs)
            return
        except NodeExited:
            if node.process.poll() is None or attempt == attempts - 1:
                raise
            node.stop()
            nodes.remove(node)


def on_this_machine(config: dict, tiny_pair) -> tuple[ServeDeploySchema, AppConfig]:
    """The config with tiny models, no GPUs, small CPU shares; placement (resources) untouched."""
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    args = AppConfig.model_validate(app.args)
    draft_dir, target_dir = tiny_pair
    models = args.models.model_copy(update={"draft": str(draft_dir), "target": str(target_dir), "cache_dir": None})
    roles = {}
    for role in ("draft", "verifier", "coordinator", "ingress"):
        replicas = getattr(args, role)
        update = {"num_gpus": 0.0, "num_cpus": 0.1, "threads": 1}
        if role in ("draft", "verifier"):
            update["autoscaling"] = replicas.autoscaling | {"initial_replicas": REPLICAS_PER_ROLE}
        roles[role] = replicas.model_copy(update=update)
    return schema, args.model_copy(update={"models": models, "target_shards": 1, **roles})


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    if ray.is_initialized():
        ray.shutdown()
    config = yaml.safe_load(CONFIG.read_text())
    schema, args = on_this_machine(config, tiny_pair)
    draft_resource, = args.draft.resources
    verifier_resource, = args.verifier.resources
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-cluster-test-", dir="/tmp"))  # short: socket paths
    # A token of its own: `ray start` turns token auth on when ~/.ray/auth_token exists and a
    # driver given an explicit address never does, so the mode and token are set for all of them.
    saved_auth = {name: os.environ.get(name) for name in AUTH_ENV}
    nodes: list[Node] = []
    try:
        use_auth_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
        common = ["--num-cpus=2", "--num-gpus=0", "--object-store-memory=150000000", f"--temp-dir={temp_dir}",
                  "--node-ip-address=127.0.0.1"]
        draft_node = {draft_resource: REPLICAS_PER_ROLE * args.draft.resources[draft_resource]}
        verifier_node = {verifier_resource: REPLICAS_PER_ROLE * args.verifier.resources[verifier_resource]}
        gcs_port = []

        def head_args() -> list[str]:
            gcs, dashboard, client, *node = free_ports(3 + len(NODE_PORTS))
            gcs_port.append(gcs)
            return ["--head", f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                    "--disable-usage-stats", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
                    f"--resources={json.dumps(draft_node)}", *common, *node_ports(node)]

        start_node(head_args, temp_dir / "head", lambda: (temp_dir / "ray_current_cluster").exists(),  # written once up
                   nodes, temp_dir)
        address = f"127.0.0.1:{gcs_port[-1]}"
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        start_node(lambda: [f"--address={address}", f"--resources={json.dumps(verifier_node)}", *common,
                                   *node_ports(free_ports(len(NODE_PORTS)))],
                   temp_dir / "verifier-node", lambda: sum(n["Alive"] for n in ray.nodes()) == 2, nodes, temp_dir)

        http_port, grpc_port = free_ports(2)
        serve.start(proxy_location="HeadOnly",
                    http_options={**schema.http_options.model_dump(exclude_unset=True), "host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=schema.grpc_options.grpc_servicer_functions))
        (app,) = schema.applications
        serve.run(build_app(args), name=app.name, route_prefix=app.route_prefix)
        yield {"args": args, "address": address, "grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}",
               "resources": {"draft": draft_resource, "verifier": verifier_resource}}
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            for node in reversed(nodes):
                node.stop()
            use_auth_env(saved_auth)
            shutil.rmtree(temp_dir, ignore_errors=True)


def replica_nodes(address: str, deployment: str) -> list[str]:
    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return [a.node_id for a in actors if a.class_name == f"ServeReplica:specdec:{deployment}"]


def test_replicas_land_on_their_node_types(cluster):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    placement = {}
    for deployment in ("Draft", "Verifier", "Coordinator", "Ingress"):
        placement[deployment] = replica_nodes(cluster["address"], deployment)
        print(deployment, "->", [(node[:8], sorted(k for k in nodes[node] if k.endswith("_node")))
                                 for node in placement[deployment]], file=sys.stderr)
    assert len(placement["Draft"]) == len(placement["Verifier"]) == REPLICAS_PER_ROLE
    for deployment, role in (("Draft", "draft"), ("Verifier", "verifier")):
        resource = cluster["resources"][role]
        assert all(resource in nodes[node] for node in placement[deployment]), (deployment, placement)
    assert set(placement["Draft"]).isdisjoint(placement["Verifier"])


def test_request_completes_over_grpc_and_http(cluster):
    with grpc.insecure_channel(cluster["grpc"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        response = stub.Generate(generation_pb2.GenerateRequest(text="def fibonacci(n):", policy="fixed", k=3,
                                                                max_new_tokens=24), timeout=120)
    assert response.completions[0].finish_reason in ("stop", "length")
    assert response.stats.generated_tokens == len(response.completions[0].token_ids) > 0

    body = {"model": cluster["args"].model_name, "prompt": "SELECT name FROM", "max_tokens": 16}
    reply = httpx.post(f"{cluster['http']}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0
