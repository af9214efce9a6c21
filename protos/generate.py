"""Generate the Python code for the gRPC contracts: protos/specdec/v1/*.proto -> specdec/v1/.

    python protos/generate.py              # regenerate specdec/v1/ in place
    python protos/generate.py --out DIR    # write DIR/specdec/v1/ instead (the staleness test)

This runs `grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=.` over every
.proto. Because the protos live at protos/<package path>/ and the include root is protos/, the
generated modules import each other package-qualified (`from specdec.v1 import common_pb2`): no
import rewriting. The output is byte-for-byte reproducible with the pinned grpcio-tools, so the
generated files are committed (a plain checkout imports them), setup.py regenerates them on every
build, and tests/test_protos.py fails when they are stale. Never edit them by hand.
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import sys
import tempfile
from pathlib import Path

# The grpcio-tools release the committed code is generated with. Keep in step with pyproject.toml
# ([build-system] requires and the `test` extra; tests/test_protos.py checks). Its protoc emits
# protobuf 7.35.1 gencode and its plugin grpcio 1.85.1 stubs: the generated modules refuse older
# protobuf / grpcio runtimes, hence the runtime floors in pyproject.toml.
GRPCIO_TOOLS_VERSION = "1.85.1"

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("specdec", "v1")  # relative to both PROTO_ROOT and the output root

# What this script owns in the package directory: anything else there is left alone.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
INIT = "__init__.py"


class GenerationError(RuntimeError):
    """grpcio-tools is missing or not the pinned release, or protoc failed."""


def installed_grpcio_tools_version() -> str | None:
    if importlib.util.find_spec("grpc_tools") is None:
        return None
    from grpc_tools import grpc_version

    return grpc_version.VERSION


def proto_files() -> list[Path]:
    """The .proto files, relative to PROTO_ROOT, in a stable order."""
    return sorted(path.relative_to(PROTO_ROOT) for path in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Write out_root/specdec/v1/ from the protos; returns the files written or removed.

    Files whose bytes are unchanged are not rewritten, and generated files of protos that no
    longer exist are removed.
    """
    version = installed_grpcio_tools_version()
    if version is None:
        raise GenerationError(f"grpcio-tools is not installed: pip install grpcio-tools=={GRPCIO_TOOLS_VERSION}")
    if version != GRPCIO_TOOLS_VERSION:
        raise GenerationError(
            f"grpcio-tools {version} is installed but the code is generated with {GRPCIO_TOOLS_VERSION}: "
            f"pip install grpcio-tools=={GRPCIO_TOOLS_VERSION} (or change the pin here and in pyproject.toml)")
    protos = proto_files()
    if not protos:
        raise GenerationError(f"no .proto files in {PROTO_ROOT / PACKAGE_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        _run_protoc(protos, Path(tmp))
        generated = {path.name: _with_header(path.read_bytes(), _source_of(path.name))
                     for path in (Path(tmp) / PACKAGE_DIR).iterdir()}
    generated[INIT] = _init_module(protos)
    return _sync(generated, out_root / PACKAGE_DIR)


def _run_protoc(protos: list[Path], out_dir: Path) -> None:
    from grpc_tools import protoc

    well_known_types = importlib.resources.files("grpc_tools") / "_proto"  # as `python -m grpc_tools.protoc`
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known_types}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}",
            *(str(PROTO_ROOT / proto) for proto in protos)]
    if protoc.main(args) != 0:
        raise GenerationError("protoc failed (its message is above)")


def _source_of(module_file: str) -> str:
    stem = module_file.split("_pb2", 1)[0]
    return (Path("protos") / PACKAGE_DIR / f"{stem}.proto").as_posix()


def _header(what: str) -> str:
    return (f"# Generated from {what} by protos/generate.py (grpcio-tools {GRPCIO_TOOLS_VERSION}).\n"
            "# Do not edit: change the .proto and run `python protos/generate.py`.\n")


def _with_header(content: bytes, source: str) -> bytes:
    """Our header first, after an encoding declaration (which must stay on line 1)."""
    header = _header(source).encode()
    if content.startswith(b"# -*- coding"):
        first, rest = content.split(b"\n", 1)
        return first + b"\n" + header + rest
    return header + content


def _init_module(protos: list[Path]) -> bytes:
    modules = "".join(f"    {proto.stem}_pb2 / {proto.stem}_pb2_grpc\n" for proto in protos)
    return (_header((Path("protos") / PACKAGE_DIR / "*.proto").as_posix())
            + '"""Protobuf messages and gRPC stubs of the specdec.v1 contracts (protos/specdec/v1/):\n\n'
            + modules + '"""\n').encode()


def _sync(files: dict[str, bytes], package_dir: Path) -> list[Path]:
    package_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for stale in sorted(package_dir.iterdir()):
        if stale.name.endswith(GENERATED_SUFFIXES) and stale.name not in files:
            stale.unlink()
            changed.append(stale)
    for name, content in sorted(files.items()):
        path = package_dir / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT,
                        help="output root; the code goes to OUT/specdec/v1/ (default: the repository)")
    args = parser.parse_args(argv)
    try:
        changed = generate(args.out)
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"{'wrote' if path.exists() else 'removed'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
