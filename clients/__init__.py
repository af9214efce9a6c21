"""Python clients of a running `specdec serve`: clients.grpc_client (specdec.v1.Generation) and
clients.http_client (the OpenAI-compatible routes); `specdec client` on the command line."""

from __future__ import annotations

from specdec.errors import SpecDecError, one_line


class ClientError(SpecDecError):
    """A call failed: `code` is the gRPC status name ("INVALID_ARGUMENT"), "HTTP <status>", or
    "UNAVAILABLE" when the server cannot be reached; str() is the server's one-line reason;
    `retry_after_s` the server's Retry-After, when it sent one."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


__all__ = ["ClientError", "one_line"]
