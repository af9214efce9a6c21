"""`specdec serve`: a local Ray instance, Serve's HTTP and gRPC proxies, and the app."""

from __future__ import annotations

import sys
import threading

import ray
from ray import serve
from ray.serve.config import gRPCOptions

from services.app import build_app
from services.config import GRPC_SERVICER_FUNCTIONS, AppConfig

APP_NAME = "specdec"
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT = 8000, 9000  # Serve's defaults


def start(config: AppConfig, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
          grpc_port: int = DEFAULT_GRPC_PORT, num_cpus: int | None = None) -> dict[str, str]:
    """Start (or join) Ray and run the app; returns its addresses once every replica is up."""
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return {"grpc": f"{host}:{grpc_port}", "http": f"http://{host}:{http_port}"}


def serve_forever(config: AppConfig, host: str, http_port: int, grpc_port: int) -> int:
    print("starting Ray and the app (loading both models)...", file=sys.stderr)
    addresses = start(config, host, http_port, grpc_port)
    print(f"gRPC  {addresses['grpc']}  (specdec.v1.Generation)\n"
          f"HTTP  {addresses['http']}  (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)\n"
          "Ctrl-C stops.", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
