"""Every option a user can set is named in the user-facing docs (README.md and docs/*.md; not
docs/results/ or docs/notes/): each flag of every `specdec` subcommand verbatim (`--max-new-tokens`),
and each field of the configs users write (the Serve app's AppConfig and the EngineConfig, batch and
llama.cpp sections it nests; the training pipeline's YAML; the OpenAI request bodies with their
`speculative` options) as `name` in backticks or as `section.name` (`batch.max_tokens_per_pass`,
`llamacpp.context`). No models, no Ray: the parser and the pydantic models are only read."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]

# Options that need no line of their own in the docs, each with why.
EXEMPT_FLAGS = {
    "--help",  # argparse's own, on every parser
}
# (EngineConfig.fuse_suffix was one: the builder's own flag, now outside the fields, builder.py `unfused`.)
EXEMPT_FIELDS: set[str] = set()


def docs_text() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # (docs/results, docs/notes: not globbed)
    return "\n".join(path.read_text(encoding="utf-8") for path in files)


def parser_flags(parser: argparse.ArgumentParser, command: str = "specdec") -> dict[str, set[str]]:
    """Every long option of `parser` and its subcommands, with the commands that take it."""
    flags: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for flag, commands in parser_flags(sub, f"{command} {name}").items():
                    flags.setdefault(flag, set()).update(commands)
        for flag in action.option_strings:
            if flag.startswith("--"):
                flags.setdefault(flag, set()).add(command)
    return flags


def nested_models(annotation) -> typing.Iterator[type[BaseModel]]:
    """The pydantic models an annotation holds (`X`, `X | None`, `list[X]`, `dict[str, X]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in typing.get_args(annotation):
        yield from nested_models(argument)


class Where(typing.NamedTuple):
    sections: set[str]  # the section names it is written under (ReplicaConfig's: draft, verifier, ...)
    keys: set[str]  # a section's own keys (a field holding a model): `data.dir` names `data` too


def config_fields(model: type[BaseModel], section: str | None = None,
                  found: dict[str, Where] | None = None) -> dict[str, Where]:
    """`Model.field` -> where it is written, for every field of `model` and the models it nests."""
    found = {} if found is None else found
    for name, field in model.model_fields.items():
        key = f"{model.__name__}.{name}"
        new = key not in found
        entry = found.setdefault(key, Where(set(), set()))
        if section:
            entry.sections.add(section)
        for sub in nested_models(field.annotation):
            entry.keys.update(sub.model_fields)
            if new:
                config_fields(sub, name, found)
            else:  # its fields are known; only this section name is new
                for each in sub.model_fields:
                    found[f"{sub.__name__}.{each}"].sections.add(name)
    return found


def mentioned(key: str, field: Where, text: str) -> bool:
    """`name` in backticks, `section.name`, or for a section `name.key` (`llamacpp.context`)."""
    name = key.split(".", 1)[1]
    if f"`{name}`" in text:
        return True
    dotted = [rf"{re.escape(section)}\.{re.escape(name)}" for section in field.sections]
    dotted += [rf"{re.escape(name)}\.{re.escape(each)}" for each in field.keys]
    return any(re.search(rf"(?<![\w-]){pattern}(?!\w)", text) for pattern in dotted)


def how_to_name(key: str, field: Where) -> str:
    name = key.split(".", 1)[1]
    return f"{key}: write `{name}`" + "".join(f" or {section}.{name}" for section in sorted(field.sections))


def user_configs() -> list[type[BaseModel]]:
    from services.config import AppConfig
    from services.openai_api import ChatRequest, CompletionRequest
    from specdec.training.config import PipelineConfig

    return [AppConfig, PipelineConfig, CompletionRequest, ChatRequest]


def test_every_cli_flag_is_documented():
    from specdec.cli import build_parser

    text = docs_text()
    flags = parser_flags(build_parser())
    assert len(flags) > 40  # (the walk reached the subcommands)
    missing = {flag: sorted(commands) for flag, commands in flags.items()
               if flag not in EXEMPT_FLAGS and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)}
    assert not missing, f"flags named nowhere in README.md or docs/*.md (flag: commands): {missing}"


def test_every_config_field_is_documented():
    text = docs_text()
    fields: dict[str, Where] = {}
    for model in user_configs():
        for key, field in config_fields(model).items():
            entry = fields.setdefault(key, Where(set(), set()))
            entry.sections.update(field.sections)
            entry.keys.update(field.keys)
    assert {"BatchConfig.max_tokens_per_pass", "LlamaCppOptions.context", "SpeculativeOptions.suffix_cache",
            "ReplicaConfig.num_replicas", "TrainSection.depth"} <= set(fields)  # (the walk reached the nested ones)
    missing = sorted(how_to_name(key, field) for key, field in fields.items()
                     if key not in EXEMPT_FIELDS and not mentioned(key, field, text))
    assert not missing, "config fields named nowhere in README.md or docs/*.md:\n" + "\n".join(missing)


def test_the_exemptions_are_still_options():
    """An exemption whose option is gone is stale: drop it."""
    from specdec.cli import build_parser

    assert EXEMPT_FLAGS <= set(parser_flags(build_parser()))
    fields = {}
    for model in user_configs():
        fields |= config_fields(model)
    assert EXEMPT_FIELDS <= set(fields)
