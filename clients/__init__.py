"""Python clients of a running `specdec serve`: clients.grpc_client (specdec.v1.Generation) and
clients.http_client (the OpenAI-compatible routes); `specdec client` on the command line."""

from __future__ import annotations

import os

from specdec.errors import InvalidRequestError, SpecDecError, one_line

API_KEY_ENV = "SPECDEC_API_KEY"
NO_LIMIT_S = 1e6  # a timeout this long or longer (inf included) is none: the transports cannot hold it


class ClientError(SpecDecError):
    """A call failed: `code` is the gRPC status name ("INVALID_ARGUMENT"), "HTTP <status>", or
    "UNAVAILABLE" when the server cannot be reached; str() is the server's one-line reason;
    `retry_after_s` the server's Retry-After, when it sent one; `lost`: Serve's proxy answered for
    an ingress replica that died under the call (gRPC INTERNAL "The actor died unexpectedly", a
    plain-text HTTP 500), which a retry reaches another replica for."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, lost: bool = False):
        super().__init__(message)
        self.code, self.message, self.retry_after_s, self.lost = code, message, retry_after_s, lost


def resolve_api_key(value: str | None) -> str | None:
    """The key a client sends: `value`, else $SPECDEC_API_KEY; None: none. A key no header can
    carry (not printable ASCII) is refused, and one with blanks at its ends, which no server's key
    has (services/auth.py check_api_key; an HTTP header cannot end in one)."""
    key = (value if value is not None else os.environ.get(API_KEY_ENV)) or None
    if key is not None and not (key.isascii() and key.isprintable()):
        raise InvalidRequestError(f"the API key must be printable ASCII (it travels in a header): {ascii(key)}")
    if key is not None and key != key.strip():
        raise InvalidRequestError(f"the API key has blanks at its ends, which no server's key has (the key given, "
                                  f"else {API_KEY_ENV})")
    return key


def time_limit(seconds: float | None) -> float | None:
    """An attempt's time limit in seconds, None for none (inf or past NO_LIMIT_S): a gRPC attempt's
    deadline; over HTTP httpx's limit on each connect, read and write (a stream goes on while its
    chunks keep coming). Retries each get their own."""
    if seconds is None or seconds >= NO_LIMIT_S:
        return None
    if not seconds > 0:  # (NaN too)
        raise InvalidRequestError(f"timeout must be more than 0 seconds (inf: none), not {seconds!r}")
    return seconds


__all__ = ["API_KEY_ENV", "ClientError", "one_line", "resolve_api_key", "time_limit"]
