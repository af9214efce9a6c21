"""`specdec client` over both protocols against real servers on the in-process engine (tiny models):
the text equals `specdec generate`'s, stats on stderr, one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from clients import ClientError
from clients.cli import TextPrinter, add_client_parser, stats_summary
from specdec.cli import EXIT_USAGE, add_generation_flags
from specdec.errors import SpecDecError
from specdec.params import build_params
from services.openai_api import create_app
from engine_backend import EngineBackend, GenerationServicer, free_port, grpc_server, http_server

PROMPT = "def fibonacci(n):"


def run(argv: list[str]) -> int:
    """What specdec.cli.main does with a subcommand."""
    parser = argparse.ArgumentParser(prog="specdec")
    parser.add_argument("--debug", action="store_true")
    add_client_parser(parser.add_subparsers(dest="command", required=True), add_generation_flags)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecDecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


@pytest.fixture(scope="module")
def servers(tiny_engine):
    backend = EngineBackend(tiny_engine)
    with grpc_server(GenerationServicer(backend)) as grpc_address, \
            http_server(create_app(lambda: backend, "specdec")) as http_url:
        yield {"grpc": grpc_address, "http": http_url}


def engine_text(tiny_engine, **flags) -> str:
    return tiny_engine.generate(PROMPT, build_params(**flags)).completions[0].text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("template", [True, False])
def test_generate_prints_text_and_stats(servers, tiny_engine, capsys, protocol, stream, template):
    flags = ["--policy", "fixed", "--k", "3", "--max-new-tokens", "24"] + ([] if template else ["--no-chat-template"])
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", servers[protocol], *flags]
               + (["--stream"] if stream else []))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == engine_text(tiny_engine, policy="fixed", k=3, max_new_tokens=24, chat_template=template) + "\n"
    assert "tok/s" in err and "verification rate" in err and "mean accepted length" in err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_json(servers, tiny_engine, capsys, protocol):
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", servers[protocol],
                "--max-new-tokens", "12", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == 0
    expected = tiny_engine.generate(PROMPT, build_params(max_new_tokens=12)).completions[0]
    if protocol == "grpc":
        assert body["completions"][0]["token_ids"] == expected.token_ids
        assert body["stats"]["generated_tokens"] == len(expected.token_ids)
    else:
        assert body["choices"][0]["message"]["content"] == expected.text
        assert body["specdec"]["generated_tokens"] == len(expected.token_ids)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_samples_get_headers(servers, capsys, protocol):
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", servers[protocol], "--n", "2",
                "--temperature", "1", "--seed", "2", "--top-p", "0.9", "--stop", "zz", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("--- sample 1 ---\n") and "\n--- sample 2 ---\n" in out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_parameter_is_one_line_and_exit_2(servers, capsys, protocol):
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", servers[protocol], "--policy", "nope"])
    assert code == EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: unknown policy 'nope'; choose one of")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("prompt,flags,message", [
    (PROMPT, ["--k", "3000000000"], None),  # past the field's int32: the server says so over HTTP, the client over gRPC
    (PROMPT, ["--seed", "99999999999999999999"], None),
    (PROMPT, ["--stop", "\udcff"], "'\\udcff' is not valid UTF-8"),  # a byte the shell passed that is not UTF-8
    ("hi \udcff", [], "'hi \\udcff' is not valid UTF-8"),
    (PROMPT, ["--temperature", "nan"], None),  # JSON cannot carry NaN: the HTTP client says so
    (PROMPT, ["--retries", "-1"], "retries must be a whole number >= 0"),
    (PROMPT, ["--timeout", "0"], "timeout must be more than 0 seconds"),
    (PROMPT, ["--timeout", "nan"], "timeout must be more than 0 seconds"),
    (PROMPT, ["--api-key", "\u043a\u043b\u044e\u0447"], "the API key must be printable ASCII"),
    # (a blank at an end: over HTTP "Illegal header value", retried as a transport failure; over gRPC sent)
    (PROMPT, ["--api-key", "key "], "the API key has blanks at its ends"),
    (PROMPT, ["--api-key", " "], "the API key has blanks at its ends"),
    # (one reason on both protocols and in process: GenerationParams' and the OpenAI route's own check)
    (PROMPT, [arg for stop in "abcdefghijklmnopq" for arg in ("--stop", stop)], "stop: at most 16 stop strings, got 17"),
])
def test_a_value_the_request_cannot_carry_is_one_line_and_exit_2(servers, capsys, protocol, prompt, flags, message):
    code = run(["client", "generate", prompt, "--protocol", protocol, "--address", servers[protocol], *flags])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    if message:
        assert message in err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unreachable_server(capsys, protocol):
    address = f"127.0.0.1:{free_port()}"
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", address, "--timeout", "10"])
    shown = address if protocol == "grpc" else f"http://{address}"
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == f"error: cannot reach {shown}: is `specdec serve` running?\n"


@pytest.mark.parametrize("protocol, address, message", [("http", "http://[::1", "is not a URL"),
                                                       ("http", "\udcff:1", "is not a URL"),
                                                       ("grpc", "\udcff:1", "is not an address"),
                                                       # (each failed at its first call, UNKNOWN or "cannot reach")
                                                       ("grpc", "localhost:99999", "is not an address"),
                                                       ("grpc", "http://localhost:9000", "is an HTTP URL"),
                                                       ("grpc", "a\nb:1", "is not an address"),
                                                       ("http", "ftp://x", "is not an http:// or https:// URL"),
                                                       ("http", "http://localhost:99999", "is not a port")])
def test_a_malformed_address_is_one_line(capsys, protocol, address, message):
    code = run(["client", "generate", PROMPT, "--protocol", protocol, "--address", address, "--timeout", "10"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_an_unlimited_timeout_works(servers, capsys):
    for protocol in ("grpc", "http"):
        assert run(["client", "generate", PROMPT, "--protocol", protocol, "--address", servers[protocol],
                    "--timeout", "inf", "--max-new-tokens", "4"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_models_and_health(servers, capsys):
    assert run(["client", "models", "--address", servers["http"]]) == 0
    assert run(["client", "health", "--address", servers["http"]]) == 0
    assert capsys.readouterr().out == "specdec\nok\n"


def test_an_answer_of_another_shape_is_one_line(capsys):
    """Another server's JSON (a proxy's, another API's) printed a KeyError's traceback."""
    from fastapi import FastAPI

    other = FastAPI()
    other.get("/v1/models")(lambda: {"object": "list"})
    other.get("/health")(lambda: ["up"])
    other.post("/v1/chat/completions")(lambda: {"id": "x"})
    with http_server(other) as url:
        for argv in (["models"], ["health"], ["generate", PROMPT, "--protocol", "http"]):
            assert run(["client", *argv, "--address", url, "--retries", "0"]) == EXIT_USAGE
            err = capsys.readouterr().err
            assert err.startswith("error: the server's") and "not the shape" in err and err.count("\n") == 1, err


def test_stream_and_json_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as info:
        run(["client", "generate", PROMPT, "--stream", "--json"])
    assert info.value.code == EXIT_USAGE and "not allowed with" in capsys.readouterr().err


def test_client_error_is_a_user_error():
    assert issubclass(ClientError, SpecDecError)


def test_stats_summary_from_wire_dict():
    stats = {"generated_tokens": 10, "rounds": 4, "target_forward_passes": 4, "draft_tokens": 8,
             "accepted_tokens": 6, "wall_time_s": 2.0, "k_histogram": {"2": 4}, "acceptance_rate": 0.75,
             "transport_time_s": 0.5, "transport_bytes": 1000}
    line = stats_summary(stats)
    assert "10 tokens in 2.0s (5.00 tok/s)" in line and "acceptance 75.0%" in line
    assert "mean accepted length 2.50" in line and line.endswith("transport 0.50s")


def test_a_stream_cut_short_ends_its_line_before_the_error(capsys):
    # (the error was printed on the text's line: "...searching for thiserror: cannot reach ...")
    with pytest.raises(ConnectionError):
        with TextPrinter(1) as printer:
            printer.write(0, "partial")
            raise ConnectionError
    with pytest.raises(ConnectionError):
        with TextPrinter(1):
            raise ConnectionError
    assert capsys.readouterr().out == "partial\n"
