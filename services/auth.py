"""Optional API-key authentication, shared by both ingresses and the internal round services.

One key (AppConfig.api_key, else the SPECDEC_API_KEY environment variable). Clients present it as
OpenAI's clients do: `Authorization: Bearer <key>`, as an HTTP header or as gRPC metadata
(`authorization`). Keys are compared in constant time.

    HTTP (FastAPI)      Starlette's AuthenticationMiddleware, before routing -> 401
                        or reading the body (services/openai_api.py)
    gRPC public         checked by the ingress servicer: Serve's gRPC proxy  -> UNAUTHENTICATED
                        in Ray 2.60 takes no server interceptors
    gRPC round services a grpc.ServerInterceptor on each replica's server    -> UNAUTHENTICATED
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

import grpc

from services.errors import Unauthenticated, grpc_status

API_KEY_ENV = "SPECDEC_API_KEY"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
SCHEME = "bearer"
MISSING_KEY = "missing or invalid API key: send `Authorization: Bearer <key>`"


def cache_scope(api_key: str) -> str:
    """The name of the key's cache of earlier responses (models/suffix.py `SuffixDraft.cache`): a
    digest, so the key itself never travels to the replicas nor sits in their memory."""
    return hashlib.sha256(b"specdec suffix cache\0" + api_key.encode()).hexdigest()[:32]


def env_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def check_api_key(key: str) -> None:
    """Raises ValueError for a key no client could present: empty, blank at either end (a secret
    file's newline: the server strips what is presented) or not printable ASCII (what HTTP headers
    and gRPC metadata carry)."""
    if not key:
        raise ValueError(f"must not be empty (leave it and {API_KEY_ENV} unset for no authentication)")
    if key != key.strip():
        raise ValueError(f"has blanks at its ends (a file's newline?), which no request can present (the "
                         f"config's key, else {API_KEY_ENV})")
    if not all(" " <= c <= "~" for c in key):
        raise ValueError(f"must be printable ASCII, which requests present (the config's key, else {API_KEY_ENV})")


def bearer(api_key: str) -> str:
    return f"Bearer {api_key}"


def key_matches(expected: str | None, authorization: str | None) -> bool:
    """Whether an Authorization value ("Bearer <key>") carries the expected key; always true when no
    key is configured."""
    if not expected:
        return True
    if not authorization:
        return False
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return False
    return hmac.compare_digest(presented.strip().encode(), expected.encode())


def metadata_authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a gRPC call carries the key in (none without a key)."""
    return ((METADATA_KEY, bearer(api_key)),) if api_key else ()


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the key, before the servicer (or deserialising the request)."""

    def __init__(self, api_key: str):
        self._api_key = api_key

        def deny(_request, context: grpc.ServicerContext):
            context.abort(*grpc_status(Unauthenticated(MISSING_KEY)))

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)  # the round streams

    def intercept_service(self, continuation, handler_call_details):
        if key_matches(self._api_key, metadata_authorization(handler_call_details.invocation_metadata)):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_bidi
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
