"""The one table from errors to what a client sees: a gRPC status code, an HTTP status and an
OpenAI error type, with a one-line reason. Both ingresses, the round servicers and the transports
read it; nothing else maps errors.

    error                   gRPC                 HTTP  OpenAI type             retry
    InvalidRequestError     INVALID_ARGUMENT     400   invalid_request_error   no: fix the request
    Unauthenticated         UNAUTHENTICATED      401   authentication_error    no: send the key
    Overloaded              RESOURCE_EXHAUSTED   429   overloaded_error        after Retry-After
    Unavailable             UNAVAILABLE          503   unavailable_error       at once
    anything else (a bug)   INTERNAL             500   internal_error          reason never shown
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from specdec.errors import InvalidRequestError, Overloaded, Unavailable, one_line

logger = logging.getLogger(__name__)

INTERNAL_REASON = "internal error"
RETRY_AFTER_S = {Overloaded: 1, Unavailable: 0}  # a round takes milliseconds: capacity frees up quickly


class Unauthenticated(Exception):
    """A call without the configured API key."""


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    kind: str  # OpenAI's error "type"


TABLE: dict[type[Exception], Status] = {
    InvalidRequestError: Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    Unauthenticated: Status(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    Overloaded: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "overloaded_error"),
    Unavailable: Status(grpc.StatusCode.UNAVAILABLE, 503, "unavailable_error"),
}
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "internal_error")


def user_error(exc: BaseException) -> BaseException:
    """The error itself, or the user error a remote Ray call wrapped (Ray keeps it as `.cause`;
    the wrapper's own text would carry the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) and _known(cause) else exc


def _known(exc: BaseException) -> type | None:
    return next((cls for cls in TABLE if isinstance(exc, cls)), None)


def describe(exc: BaseException) -> tuple[Status, str]:
    """(status, one-line reason) for any exception; a bug is logged here and never described."""
    exc = user_error(exc)
    cls = _known(exc)
    if cls is None:
        logger.error("request failed", exc_info=exc)
        return INTERNAL, INTERNAL_REASON
    return TABLE[cls], one_line(exc, "invalid request")


def retry_after(exc: BaseException) -> int | None:
    """Seconds a client should wait before retrying (the Retry-After header), None: do not retry."""
    return next((s for cls, s in RETRY_AFTER_S.items() if isinstance(user_error(exc), cls)), None)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    status, reason = describe(exc)
    return status.grpc, reason


def from_grpc(code: grpc.StatusCode, details: str) -> Exception:
    """The error a gRPC status stands for (the table read backwards); other codes are RuntimeError."""
    cls = next((c for c, s in TABLE.items() if s.grpc == code), None)
    return cls(one_line(details or code.name)) if cls else RuntimeError(f"{code.name}: {details}")
