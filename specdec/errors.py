"""Errors a user can cause and fix. The command line prints them as one line; the services map them
to INVALID_ARGUMENT / HTTP 400. Anything else is a bug and keeps its traceback."""

from collections.abc import Mapping


class SpecDecError(Exception):
    """Base class: the message is a one-line reason meant for the user."""


class InvalidRequestError(SpecDecError, ValueError):
    """A request parameter or prompt is out of range."""


class ModelSourceError(SpecDecError):
    """A model could not be found, fetched, verified or loaded."""


class ChecksumError(ModelSourceError):
    """A downloaded or assembled file does not match its pinned SHA-256."""


class IncompatibleModelsError(ModelSourceError):
    """Draft, target and head do not belong together (vocabulary, hidden size, identity)."""


class Overloaded(SpecDecError):
    """The server cannot take more work now (Serve's backpressure): HTTP 429, gRPC RESOURCE_EXHAUSTED.
    Retriable after a pause."""


class Unavailable(SpecDecError):
    """The replica running the request died (or none is up yet): HTTP 503, gRPC UNAVAILABLE.
    Retriable at once: a greedy or seeded request gives the same result again."""


# A reason quotes what the client sent (a draft's or a policy's name): cut, a long one cannot
# outgrow gRPC's 16 KiB trailers (the status was lost: RESOURCE_EXHAUSTED) or reflect a body back.
MAX_REASON_CHARS = 1000


def one_line(message: object, default: str = "") -> str:
    """The first line of a message (an exception: its text, else its class name), for a user-facing
    reason: a status detail, an error field, a log line; at most MAX_REASON_CHARS."""
    text = str(message).strip()
    if text:
        line = text.splitlines()[0]
        return line if len(line) <= MAX_REASON_CHARS else line[:MAX_REASON_CHARS - 1] + "…"
    return type(message).__name__ if isinstance(message, BaseException) and not default else default


def validation_message(exc, names: Mapping[str, str] | None = None) -> str:
    """The first error of a pydantic ValidationError as one line: `max-new-tokens: Input should be
    greater than or equal to 1`; `names` renames a field for the user (a flag that sets it)."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"] if part not in ("sampling", "policy"))
    where = where.replace("_", "-")
    where = (names or {}).get(where, where)
    # A validator's own ValueError: its text, without pydantic's "Value error, " before it.
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return f"{where}: {message}" if where else message
