"""`services.launch.start` when the app cannot start: one line with the replicas' own reason (Serve
raised "Deploying application specdec failed: Failed to update the deployments [...]" and the reason
was only in the replica logs), and the addresses it prints for clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from engine_backend import free_ports, local_serve
from services.config import AppConfig, ReplicaConfig
from services.launch import client_addresses
from specdec.builder import EngineConfig
from specdec.errors import SpecDecError


def test_an_app_whose_replicas_cannot_load_says_why_in_one_line(tiny_pair):
    # (a head that is there but trained for another draft: only a replica loading it finds out; a
    # missing one is refused where the app is built, test_app_config.py)
    from specdec.heads import SHIPPED

    models = EngineConfig(draft=str(tiny_pair[0]), target=str(tiny_pair[1]), head=str(SHIPPED["default"]))
    config = AppConfig(models=models, draft=ReplicaConfig(num_cpus=0.1, threads=1),
                       verifier=ReplicaConfig(num_cpus=0.1, threads=1), coordinator=ReplicaConfig(num_cpus=0.0),
                       ingress=ReplicaConfig(num_cpus=0.0))
    with pytest.raises(SpecDecError) as info:
        with local_serve(config):
            pass
    message = str(info.value)
    assert message.startswith("the app did not start: ") and "expects hidden size" in message and "\n" not in message


def test_client_addresses_write_an_ipv6_host_in_brackets():
    assert client_addresses("::1", 8000, 9000) == {"grpc": "[::1]:9000", "http": "http://[::1]:8000"}
    assert client_addresses("127.0.0.1", 8000, 9000) == {"grpc": "127.0.0.1:9000", "http": "http://127.0.0.1:8000"}


def test_sigterm_stops_specdec_serve_as_ctrl_c_does(tiny_pair):
    """`kill`, `docker stop`, systemd: SIGTERM aborted the process with a crash dump (rc 134, Ray's
    handler) and never shut Serve down."""
    http_port, grpc_port = free_ports(2)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--draft", str(tiny_pair[0]),
                               "--target", str(tiny_pair[1]), "--threads", "1", "--http-port", str(http_port),
                               "--grpc-port", str(grpc_port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in server.stdout:  # the addresses, once every replica is up
            if line.startswith("Ctrl-C stops."):
                break
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 0, err[-2000:]
    assert "stopping: the requests in flight finish first" in err and "SIGTERM received" not in err


def test_serve_deploy_of_a_config_naming_a_model_not_there_fails_with_its_one_line_reason():
    """`serve deploy` (and `serve run CONFIG`): Serve's controller runs the builder. A mistyped model
    was found by every replica as it loaded, and the app ended DEPLOY_FAILED with their tracebacks;
    now the build fails, before any replica starts, and the app's status message ends with the one
    line naming the model (Serve puts its own line before it)."""
    import time

    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({"applications": [{
        "name": "specdec", "route_prefix": "/", "import_path": "services.app:build_app",
        "args": {"models": {"target": "/no/such/target.gguf"}}}]})
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        http_port, grpc_port = free_ports(2)
        client = serve_api.serve_start(http_options={"host": "127.0.0.1", "port": http_port},
                                       grpc_options={"port": grpc_port})
        client.deploy_apps(config, _blocking=False)
        deadline = time.monotonic() + 300  # (a bound on the wait, not a measurement)
        while (app := serve.status().applications.get("specdec")) is None or app.status in ("NOT_STARTED", "DEPLOYING"):
            assert time.monotonic() < deadline, app
            time.sleep(0.5)
        assert app.status == "DEPLOY_FAILED"
        assert app.message.splitlines()[-1] == "models: /no/such/target.gguf: no such .gguf file", app.message
        assert "Traceback" not in app.message and not app.deployments
    finally:
        serve.shutdown()
        ray.shutdown()
