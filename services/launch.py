"""`specdec serve`: a local Ray instance, Serve's HTTP and gRPC proxies, and the app."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from services.app import build_app, deployment_replicas
from services.config import GRPC_SERVICER_FUNCTIONS, AppConfig
from specdec.errors import InvalidRequestError, SpecDecError, one_line

APP_NAME = "specdec"
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT = 8000, 9000  # Serve's defaults
# Serve's gRPC proxy reads this when it starts (its default is 2 GiB): the most it buffers of one
# request or response. Requests are refused beyond AppConfig.max_request_bytes anyway; responses of
# n samples of a long context need more.
PROXY_MAX_MESSAGE_ENV, PROXY_MAX_MESSAGE_BYTES = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", 32 * 1024 * 1024
# Serve's graceful_shutdown_timeout_s where a deployment sets none, and the time its controller takes
# past a replica's to see it gone.
SERVE_GRACEFUL_SHUTDOWN_S, DELETE_SLACK_S = 20.0, 30.0
# ray.init's options for a served app: the replicas' logs stay in Ray's log files
RAY_OPTIONS = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": False,
               "configure_logging": False}


def start(config: AppConfig, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
          grpc_port: int = DEFAULT_GRPC_PORT) -> dict[str, str]:
    """Start (or join) Ray and run the app; returns its addresses once every replica is up. The
    gRPC proxy's message limit applies only when this call starts Ray (its processes inherit the
    environment); on a cluster set it where `ray start` runs (docs/reliability.md)."""
    if not ray.is_initialized():
        os.environ.setdefault(PROXY_MAX_MESSAGE_ENV, str(PROXY_MAX_MESSAGE_BYTES))
        ray.init(**RAY_OPTIONS)
    # With an API key, reflection (which would list our services to anyone) is off.
    serve.start(http_options={"host": host, "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS,
                                         enable_reflection=config.key is None))
    try:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    except RuntimeError as error:  # "Deploying application specdec failed": say why, as the replicas said it
        raise SpecDecError(f"the app did not start: {deploy_failure() or one_line(error)}") from None
    return client_addresses(host, http_port, grpc_port)


def deploy_failure() -> str | None:
    """The first failed deployment and its replicas' reason: the last line of the error Serve
    recorded (a traceback), without the exception's module path; None where none recorded one."""
    app = serve.status().applications.get(APP_NAME)
    for name, deployment in (app.deployments if app else {}).items():
        lines = [line for line in deployment.message.splitlines() if line.strip()]
        if lines and deployment.status != "HEALTHY":
            kind, sep, reason = lines[-1].partition(": ")
            return f"{name}: {reason if sep and ' ' not in kind else lines[-1]}"
    return None


def delete_app(config: AppConfig, poll_s: float = 0.5) -> bool:
    """Delete the app, waiting as long as its replicas may take to let their requests in flight
    finish (their graceful_shutdown_timeout_s, the longest of them): serve.delete's own wait gives up
    after 60 s with a TimeoutError, which ended `specdec serve` with a traceback while a coordinator
    still let its generations finish, and skipped the shutdown after it. Whether the app went."""
    serve.delete(APP_NAME, _blocking=False)
    graces = [r.graceful_shutdown_timeout_s for r in deployment_replicas(config).values()]
    deadline = time.monotonic() + max(SERVE_GRACEFUL_SHUTDOWN_S if g is None else g for g in graces) + DELETE_SLACK_S
    while APP_NAME in serve.status().applications:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def client_addresses(host: str, http_port: int, grpc_port: int) -> dict[str, str]:
    """Where clients reach the app: a gRPC target and an HTTP URL (an IPv6 literal in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return {"grpc": f"{shown}:{grpc_port}", "http": f"http://{shown}:{http_port}"}


def check_ports(host: str, http_port: int, grpc_port: int) -> None:
    """Refuse (InvalidRequestError) ports the proxies could not listen on, before Ray starts and the
    models load: Serve's proxy finds out only once Ray is up, and fails with an actor's traceback."""
    if http_port == grpc_port:
        raise InvalidRequestError(f"--http-port and --grpc-port are both {http_port}")
    for flag, port in (("--http-port", http_port), ("--grpc-port", grpc_port)):
        if not 1 <= port <= 65535:
            raise InvalidRequestError(f"{flag} must be in 1..65535, got {port}")
        try:  # as the proxies bind (SO_REUSEADDR: a port a stopped server left in TIME_WAIT is free)
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise InvalidRequestError(f"--host {host!r}: {error.strerror}") from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise InvalidRequestError(f"{flag} {port} on {host}: {error.strerror}") from None


def resources_at_start(config: AppConfig) -> dict[str, float]:
    """The CPUs and GPUs the app's replicas reserve when it starts."""
    groups = deployment_replicas(config).values()
    return {"CPU": sum(g.num_cpus * g.replicas()[0] for g in groups),
            "GPU": sum(g.num_gpus * g.replicas()[0] for g in groups)}


def serve_forever(config: AppConfig, host: str, http_port: int, grpc_port: int,
                  connect: Callable[[dict[str, float]], bool]) -> int:
    """`specdec serve` until Ctrl-C or SIGTERM (`kill`, `docker stop`), either of which lets the
    requests in flight finish (Serve's graceful shutdown) before it stops. `connect(need)` starts
    or joins Ray (specdec.cli.start_ray: `need`, the CPUs and GPUs the replicas reserve at start,
    refused where a private instance could never place them); it returns whether it joined a
    cluster, where only this app is stopped and another app of its name is not replaced."""
    check_ports(host, http_port, grpc_port)
    print("starting Ray and the app (loading both models)...", file=sys.stderr)
    os.environ.setdefault(PROXY_MAX_MESSAGE_ENV, str(PROXY_MAX_MESSAGE_BYTES))
    joined = connect(resources_at_start(config))
    deployed = False
    try:
        if joined and APP_NAME in serve.status().applications:
            raise SpecDecError(f"an app named {APP_NAME!r} already runs on that cluster: stop it first "
                               "(serve shutdown), or serve from another cluster")
        # after ray.init, whose handler exits the process mid-call (a crash dump, rc 134): as Ctrl-C
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        deployed = True
        addresses = start(config, host, http_port, grpc_port)
        exposed = ("; Serve listens on every interface: set SPECDEC_API_KEY to require a key"
                   if config.key is None and host not in ("0.0.0.0", "::") else "")
        print(f"gRPC  {addresses['grpc']}  (specdec.v1.Generation{exposed})\n"
              f"HTTP  {addresses['http']}  (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)\n"
              "Ctrl-C stops.", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        print("stopping: the requests in flight finish first", file=sys.stderr, flush=True)
    finally:
        try:
            if deployed and not delete_app(config):  # drains: each replica waits for its requests in flight
                print("the app did not stop in time: stopping it now", file=sys.stderr, flush=True)
        finally:
            if not joined:
                serve.shutdown()
            ray.shutdown()
    return 0
