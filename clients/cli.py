"""`specdec client`: call a running `specdec serve` over gRPC or HTTP.

    specdec client generate "def fib(n):" --policy fixed --k 4 --stream
    specdec client generate "Hi" --protocol http --address http://host:8000 --json
    specdec client models | health        (HTTP routes)

Output as `specdec generate`: the text on stdout, the stats line on stderr; --json prints the
protocol's response (gRPC: GenerateResponse with proto field names; HTTP: OpenAI's JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import json_format

from clients import ClientError
from clients.grpc_client import DEFAULT_ADDRESS, DEFAULT_TIMEOUT_S, GrpcClient
from clients.http_client import DEFAULT_BASE_URL, HttpClient
from specdec.errors import InvalidRequestError
from specdec.metrics import RequestStats


def add_client_parser(commands: argparse._SubParsersAction,
                      add_generation_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    client = commands.add_parser("client", help="call a running `specdec serve` over gRPC or HTTP")
    subcommands = client.add_subparsers(dest="client_command", required=True)

    generate = subcommands.add_parser("generate", help="generate text for one prompt on the server")
    generate.add_argument("prompt")
    generate.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    add_connection_flags(generate, f"gRPC HOST:PORT (default {DEFAULT_ADDRESS}) or HTTP URL (default {DEFAULT_BASE_URL})")
    output = generate.add_mutually_exclusive_group()
    output.add_argument("--stream", action="store_true", help="print the text as rounds commit it")
    output.add_argument("--json", action="store_true", help="print the response as one JSON object")
    add_generation_flags(generate)
    generate.set_defaults(func=cmd_generate)

    for name, func, help_ in (("models", cmd_models, "list the served model (HTTP)"),
                              ("health", cmd_health, "check the server can serve (HTTP)")):
        parser = subcommands.add_parser(name, help=help_)
        add_connection_flags(parser, f"HTTP URL (default {DEFAULT_BASE_URL})")
        parser.set_defaults(func=func)


def add_connection_flags(parser: argparse.ArgumentParser, address_help: str) -> None:
    parser.add_argument("--address", default=None, help=address_help)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds an attempt may take (gRPC: its deadline; HTTP: each connect and read, so a "
                             "stream goes on while chunks keep coming, as the openai package's timeout)")
    parser.add_argument("--api-key", default=None, help="the server's API key (default: $SPECDEC_API_KEY)")
    parser.add_argument("--retries", type=int, default=2,
                        help="retries when the server is at capacity or a replica died (default 2)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def http_url(address: str | None) -> str:
    if not address:
        return DEFAULT_BASE_URL
    return address if "://" in address else f"http://{address}"


def grpc_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation flags as GrpcClient parameters (same names); unset ones left out."""
    options = {"policy": args.policy, "k": args.k, "threshold": args.threshold, "temperature": args.temperature,
               "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
               "n": args.n, "stop": args.stop, "chat_template": False if args.no_chat_template else None,
               "draft": args.use_draft}
    return {key: value for key, value in options.items() if value is not None}


def http_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The generation flags as OpenAI body fields (the template choice picks the route instead)."""
    options = grpc_options(args)
    options.pop("chat_template", None)
    if "max_new_tokens" in options:
        options["max_tokens"] = options.pop("max_new_tokens")
    return options


def stats_summary(stats: dict) -> str:
    """`specdec generate`'s stats line from a Stats dict (proto field names), plus transport when served."""
    names = {f.name for f in dataclasses.fields(RequestStats)}
    values = {key: value for key, value in stats.items() if key in names}
    values["k_histogram"] = Counter({int(k): v for k, v in stats.get("k_histogram", {}).items()})
    request = RequestStats(**values)
    transport = f" | transport {request.transport_time_s:.2f}s" if request.transport_bytes else ""
    return request.summary() + transport


def proto_dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True, unquote_int64_if_possible=True)


class TextPrinter:
    """Samples' text to stdout; with n > 1 a header whenever the sample changes (served samples interleave)."""

    def __init__(self, samples: int):
        self.samples, self.current = samples, None

    def write(self, index: int, text: str) -> None:
        if not text:
            return
        if self.samples > 1 and index != self.current:
            sys.stdout.write(("\n" if self.current is not None else "") + f"--- sample {index + 1} ---\n")
        self.current = index
        sys.stdout.write(text)
        sys.stdout.flush()

    def __enter__(self) -> TextPrinter:
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None and self.current is not None:  # cut short: its error on a line of its own
            sys.stdout.write("\n")
            sys.stdout.flush()

    def finish(self, stats: dict | None) -> int:
        sys.stdout.write("\n")
        if stats:
            print(stats_summary(stats), file=sys.stderr)
        return 0


# ------------------------------------------------------------------------------------------------
# Commands

def cmd_generate(args: argparse.Namespace) -> int:
    for text in [args.prompt, *(value for value in grpc_options(args).values() if isinstance(value, str)),
                 *(args.stop or [])]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (Python keeps them as surrogates)
            raise InvalidRequestError(f"{ascii(text)} is not valid UTF-8") from None
    return generate_grpc(args) if args.protocol == "grpc" else generate_http(args)


def generate_grpc(args: argparse.Namespace) -> int:
    options = grpc_options(args)
    with GrpcClient(args.address or DEFAULT_ADDRESS, args.timeout, args.api_key, args.retries) as client:
        if args.json:
            print(json.dumps(proto_dict(client.generate(args.prompt, **options))))
            return 0
        with TextPrinter(args.n or 1) as printer:
            stats = None
            if args.stream:
                for chunk in client.generate_stream(args.prompt, **options):
                    printer.write(chunk.index, chunk.text)
                    stats = chunk.stats if chunk.HasField("stats") else stats
            else:
                response = client.generate(args.prompt, **options)
                for completion in response.completions:
                    printer.write(completion.index, completion.text)
                stats = response.stats
    return printer.finish(proto_dict(stats) if stats is not None else None)


def generate_http(args: argparse.Namespace) -> int:
    """The chat route (the server applies the template to one user turn), or with
    --no-chat-template the completions route (raw text), as `specdec generate` treats the prompt."""
    fields = http_fields(args)
    with HttpClient(http_url(args.address), args.timeout, args.api_key, args.retries) as client:
        if args.no_chat_template:
            prompt, unary, stream = args.prompt, client.complete, client.complete_stream
        else:
            prompt, unary, stream = [{"role": "user", "content": args.prompt}], client.chat, client.chat_stream
        if args.json:
            print(json.dumps(unary(prompt, **fields)))
            return 0
        with TextPrinter(args.n or 1) as printer, openai_shaped("answer"):
            stats = None
            for body in (stream(prompt, **fields) if args.stream else [unary(prompt, **fields)]):
                for choice in body["choices"]:
                    printer.write(choice["index"], choice_text(choice))
                stats = body.get("specdec", stats)
    return printer.finish(stats)


def choice_text(choice: dict) -> str:
    for holder in ("message", "delta"):
        if holder in choice:
            return choice[holder].get("content") or ""
    return choice.get("text") or ""


def cmd_models(args: argparse.Namespace) -> int:
    with HttpClient(http_url(args.address), args.timeout, args.api_key, args.retries) as client:
        models = client.models()
        with openai_shaped("/v1/models answer"):
            for model in models["data"]:
                print(model["id"])
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with HttpClient(http_url(args.address), args.timeout, args.api_key, args.retries) as client:
        health = client.health()
        with openai_shaped("/health answer"):
            print(health.get("status", "ok"))
    return 0


@contextlib.contextmanager
def openai_shaped(what: str) -> Iterator[None]:
    """Reading a server's JSON as the API's shape: another shape (another server, a proxy's JSON) is
    a one-line BAD_RESPONSE, not a KeyError's traceback."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ClientError("BAD_RESPONSE", f"the server's {what} is not the shape of the OpenAI API's") from None
