"""Building an engine from model sources: `default`, a local HF directory, a .gguf file or a hub id."""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from specdec.engine import SpecDecEngine
from specdec.loop import BatchConfig
from specdec.errors import IncompatibleModelsError, ModelSourceError, SpecDecError, one_line
from specdec.head import AcceptanceHead, check_serves, load_head, read_head_config
from specdec.drafts import draft_dir
from specdec.heads import resolve_head
from specdec.models.formats import WeightFormat, apply_weight_format
from specdec.models.llamacpp import LlamaCppDraftRuntime, LlamaCppOptions, LlamaCppTargetRuntime, llamacpp_available
from specdec.models.feature_draft import target_layers_of
from specdec.models.feature_files import is_feature_draft, load_feature_draft, read_config
from specdec.models.feature_runtime import FeatureDraftRuntime
from specdec.models.runtime import MAX_THREADS, DraftRole, DraftRuntime, TargetRole, TargetRuntime
from specdec.models.sources import (DEFAULT_DRAFT_QUANT, DEFAULTS, REQUANT_FTYPES, SHIPPED, check_gguf_source,
                                    check_source, gguf_identity, model_identity, requantize_gguf, requantized_identity,
                                    resolve_gguf, resolve_model)
from specdec.models.static import StaticOptions
from specdec.models.suffix import MatchHead, SuffixDraft, fused_with, is_suffix_draft
from specdec.models.vocab import FULL as FULL_VOCAB
from specdec.models.vocab import check_draft_vocab, resolve_draft_vocab, tokenizer_ids, trim_lm_head
from specdec.params import DEFAULT_DRAFT, named_drafts
from specdec.sequences import DraftTraits, RequestRules

Role = Literal["draft", "target"]
DEFAULT_DRAFT_SOURCE = "suffix+default"  # the first draft where none is named: the suffix fused with the 0.5B
RuntimeName = Literal["auto", "torch", "llamacpp"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DraftQuant = Literal["auto", SHIPPED, *REQUANT_FTYPES]  # type: ignore[valid-type]


class EngineConfig(BaseModel):
    """Which models, head and kernels an engine runs."""

    model_config = ConfigDict(extra="forbid")

    # A model source, or a feature draft's directory (`specdec train-draft`; it runs on a torch target),
    # "suffix", or "suffix+SOURCE": the engine's first draft, named "default" in requests. By default
    # the suffix draft fused with the pinned 0.5B draft (docs/benchmarks.md: faster than the 0.5B
    # alone where text repeats, as fast where it does not).
    draft: str = DEFAULT_DRAFT_SOURCE
    # More drafts beside it, by the name a request picks one with (`draft` in a request), each a
    # source as `draft` with its shipped head (`head: auto`) and the same kernels and formats:
    # e.g. {"feature": "default-feature"} (the feature draft shipped for the default target). Their
    # sessions share the steps with the first draft's (specdec/loop.py).
    drafts: dict[str, str] = {}
    target: str = "default"
    # Acceptance head: "auto" = the head shipped for the draft (specdec/heads/), if any; "none"; a path.
    head: str | None = "auto"
    cache_dir: str | None = None
    draft_format: WeightFormat = "auto"
    target_format: WeightFormat = "auto"
    # The draft's output vocabulary: "full", "ascii" or a JSON file listing token ids (models/vocab.py).
    draft_vocab: str = "full"
    # torch intra-op threads (and llama.cpp's); None keeps torch's default (all cores)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    # Where each model runs: "auto" = the first GPU when there is one, else the CPU; or a torch
    # device string ("cpu", "cuda", "cuda:1"). A sharded verifier places itself (models/sharding.py).
    device: str = "auto"
    # The torch models' weights and activations on a GPU: "auto" = bfloat16 there (a pass is bound by
    # memory traffic: half of fp32's), float32 on the CPU, whose kernels (models/formats.py) take fp32.
    # The output is the target's distribution in this dtype; logits and Algorithm 1 stay fp32.
    dtype: Dtype = "auto"
    # Sessions per step and tokens per pass (specdec/loop.py); shared by the in-process engine,
    # the replicas and the served coordinator.
    batch: BatchConfig = BatchConfig()
    # "slots": many sessions per pass, each in buffers that grow (models/cache.py); "static": many
    # sessions per pass in one cache allocated once with fixed shapes, the GPU's layout
    # (models/static.py); "reference": the batch-1 path, one pass per session (kept to compare against);
    # "auto": static on a GPU (its passes replay CUDA graphs), slots on the CPU (a padded pass
    # computes its padding there).
    kv_cache: Literal["auto", "slots", "static", "reference"] = "auto"
    # With the static cache on CUDA: drafting steps and verifications replay CUDA graphs captured per
    # bucket of sessions, tokens and length; off: eager (the reference).
    cuda_graphs: bool = True
    # Which kernels run the models: "llamacpp" reads a GGUF file as it is (models/llamacpp.py),
    # "torch" runs a Hugging Face model (a GGUF converted once to fp32); "auto" = llamacpp for
    # `default` and .gguf sources (faster and a tenth of the memory on CPU, docs/performance.md),
    # torch for the rest and on a GPU.
    runtime: RuntimeName = "auto"
    llamacpp: LlamaCppOptions = LlamaCppOptions()
    # The llama.cpp runtime's draft weights: "shipped" as the GGUF has them, or requantized once to
    # a type with llama.cpp's fast x86 kernels (models/sources.py, REQUANT_FTYPES); "auto":
    # DEFAULT_DRAFT_QUANT for the default draft on llama.cpp, any other draft as shipped. The target
    # is never requantized.
    draft_quant: DraftQuant = "auto"
    # The suffix draft fused with this draft (proposers.py `FusedProposer`): set by `unfused` where
    # the source is "suffix+SOURCE" (`draft_configs` reads it so: the draft's config names SOURCE).
    # Not a field: "suffix+SOURCE" is the one way to ask for it, and a config naming it is refused
    # (extra="forbid"); copies (model_copy) and pickles (the replicas' configs) keep it.
    _fuse_suffix: bool = PrivateAttr(False)

    @property
    def fuse_suffix(self) -> bool:
        return self._fuse_suffix


def build_engine(config: EngineConfig = EngineConfig(), progress: bool = True) -> SpecDecEngine:
    if config.threads:
        torch.set_num_threads(config.threads)
    check_sources(config)
    check_runtime_settings(config)
    for name, each in draft_configs(config).items():  # every draft's, before any model loads
        check_head_identity(each, name)
    target_rows, tokenizer = target_vocabulary(config, progress)
    for each in draft_configs(config).values():  # every draft's, before any model loads
        check_shared_vocabulary(model_dir(each, "draft", progress), target_rows, tokenizer, each.draft)
    drafts = {}
    for name, each in draft_configs(config).items():
        draft, draft_dir = build_draft(each, progress, (target_rows, tokenizer_ids(tokenizer)))
        drafts[name] = (draft, draft_dir)
    target, target_dir = build_target(config, progress)
    heads = {}
    for (name, (draft, draft_dir)), each in zip(drafts.items(), draft_configs(config).values()):
        heads[name] = build_head(each, draft, name)
    (draft, _), head = drafts.pop(DEFAULT_DRAFT), heads.pop(DEFAULT_DRAFT)
    return SpecDecEngine(draft, target, tokenizer, head,
                         eos_token_ids=eos_token_ids_of(load_generation_config(target_dir), tokenizer),
                         batch=config.batch, more_drafts={name: (d, heads[name]) for name, (d, _) in drafts.items()})


WEIGHTLESS = {"draft_quant": "auto", "draft_vocab": FULL_VOCAB}  # what the suffix draft, having no weights, keeps


def draft_configs(config: EngineConfig) -> dict[str, EngineConfig]:
    """Each draft's config by name, the first as DEFAULT_DRAFT: the others are the first's with
    their own source and shipped head."""
    named = named_drafts(config, {name: config.model_copy(update={"draft": source, "head": "auto", "drafts": {}}
                                                          | (WEIGHTLESS if is_suffix_draft(source) else {}))
                                  for name, source in config.drafts.items()})
    return {name: unfused(each) for name, each in named.items()}


def unfused(config: EngineConfig) -> EngineConfig:
    """A fused draft's config ("suffix+SOURCE") as its model draft's (`draft` SOURCE) with the suffix
    beside it (`fuse_suffix`); any other as it is."""
    model = fused_with(config.draft)
    if model is None:
        return config
    fused = config.model_copy(update={"draft": model})
    fused._fuse_suffix = True
    return fused


def check_sources(config: EngineConfig, here: bool = True) -> None:
    """Every model source checked (models/sources.py `check_source`), every head's files and
    draft vocabulary file, before any is fetched, converted or loaded: a mistyped --target, --head
    or --draft-vocab fails at once, not after minutes of loading (or in a served app's replicas
    after Ray started). `here`: see resolve_device."""
    check_source_of(config, "target", here)
    for each in draft_configs(config).values():
        check_source_of(each, "draft", here)
        check_draft_vocab(each.draft_vocab)
        if not is_suffix_draft(each.draft) and (path := head_path(each)) is not None:
            read_head_config(path)


# Settings only the torch runtime reads (at their defaults otherwise), by the flag that sets them.
TORCH_ONLY = {"dtype": "--dtype", "kv_cache": "--kv-cache", "cuda_graphs": "--no-cuda-graphs"}


def check_runtime_settings(config: EngineConfig) -> None:
    """A setting that no model of this engine reads is refused rather than ignored: torch's
    (formats, dtype, cache, graphs, a GPU) where every model runs on llama.cpp, llama.cpp's where
    none does, and a head beside the suffix draft, which makes its own estimates. (In process, and by
    `specdec serve` on its own Ray, whose replicas run here on the CPU; a Serve config's replicas may
    run on other machines, where `auto` resolves otherwise.)"""
    drafts = draft_configs(config).values()
    target, on_drafts = backend_for(config, "target").name, {backend_for(each, "draft").name for each in drafts}
    runs = {target} | on_drafts
    if not runs & {"torch", "feature"}:
        given = [flag for field, flag in TORCH_ONLY.items()
                 if getattr(config, field) != EngineConfig.model_fields[field].default]
        if config.device not in ("auto", "cpu"):
            given.append(f"--device {config.device}")
        if given:
            raise ModelSourceError(f"{', '.join(given)}: only the torch runtime reads it, and these models run on "
                                   "llama.cpp (on the CPU); use --runtime torch for them")
    formats = {"--target-format": config.target_format != "auto" and target != "torch",
               "--draft-format": config.draft_format != "auto" and "torch" not in on_drafts}
    if given := [flag for flag, ignored in formats.items() if ignored]:
        raise ModelSourceError(f"{', '.join(given)}: the torch runtime's weight formats; that model does not run on it")
    if "llamacpp" not in runs and config.llamacpp != LlamaCppOptions():
        raise ModelSourceError("--llamacpp-context (the llamacpp settings): no model of this engine runs on llama.cpp")
    if "llamacpp" in runs:
        llamacpp_options(config)  # (for its check of --max-pass-tokens against llama.cpp's sequences)
    for each in drafts:
        if is_suffix_draft(each.draft) and each.head not in ("auto", "none", None):
            raise ModelSourceError(f"--head {each.head}: the suffix draft estimates acceptance from its matches "
                                   "and reads no head")


def check_source_of(config: EngineConfig, role: Role, here: bool = True) -> None:
    source = config.draft if role == "draft" else config.target
    if role == "draft" and (is_feature_draft(source) or is_suffix_draft(source)):
        return  # a feature draft's directory is checked when it is read, against the target; the suffix has none
    if backend_for(config, role, here).name == "llamacpp" and source != "default":
        check_gguf_source(source)
    else:
        check_source(source, role)


def resolve_runtime(config: EngineConfig, source: str, here: bool = True) -> str:
    """The runtime a model source runs on (see EngineConfig.runtime). `here`: see resolve_device."""
    if config.runtime != "auto":
        return config.runtime
    is_gguf = source == "default" or source.lower().endswith(".gguf")
    on_cpu = resolve_device(config.device, here).type == "cpu"
    return "llamacpp" if is_gguf and on_cpu and RUNTIMES["llamacpp"].available() else "torch"


class RuntimeBackend(ABC):
    """How one runtime builds a role from a model source: its files, its limits, its defaults. The
    builder asks the registry (`RUNTIMES`, by `EngineConfig.runtime` or `resolve_runtime`) instead of
    comparing runtime names."""

    name: str
    # The draft weights `draft_quant: auto` means for the default draft (models/sources.py).
    default_draft_quant: str = SHIPPED

    def available(self) -> bool:
        return True

    @abstractmethod
    def meta_dir(self, config: EngineConfig, source: str, role: Role, progress: bool) -> Path:
        """The directory with the model's config and tokenizer (no weights loaded)."""

    def context_limit(self, config: EngineConfig) -> int | None:
        """Positions a session may hold beyond the model's own limit (None: none)."""
        return None

    def cache_limits(self, config: EngineConfig) -> tuple[int | None, int | None]:
        """(sessions its caches hold at once, past which a pass takes another session's cache;
        positions they hold in all where they share one cache): its runtime's `max_pass_sessions`
        and `max_cached_positions`, None where only memory limits them."""
        return None, None

    @abstractmethod
    def draft(self, config: EngineConfig, quant: str, progress: bool) -> tuple[DraftRole, Path | None]:
        """The draft and its model's directory (None: it has none, the suffix draft)."""

    @abstractmethod
    def target(self, config: EngineConfig, progress: bool, load=None) -> tuple[TargetRole, Path]: ...


class TorchBackend(RuntimeBackend):
    """transformers models in torch (models/runtime.py); a GGUF source is converted once."""

    name = "torch"

    def meta_dir(self, config: EngineConfig, source: str, role: Role, progress: bool) -> Path:
        return resolve_model(source, role=role, cache=config.cache_dir, progress=progress)

    def context_limit(self, config: EngineConfig) -> int | None:
        return StaticOptions().capacity if resolve_kv_cache(config, here=False) == "static" else None

    def cache_limits(self, config: EngineConfig) -> tuple[int | None, int | None]:
        return StaticOptions().slots if resolve_kv_cache(config, here=False) == "static" else None, None

    def draft(self, config: EngineConfig, quant: str, progress: bool) -> tuple[DraftRole, Path]:
        if quant != SHIPPED:
            raise ModelSourceError("--draft-quant needs the llamacpp runtime (the torch runtime converts the GGUF "
                                   "as shipped)")
        draft_dir = self.meta_dir(config, config.draft, "draft", progress)
        keep = draft_vocabulary(config.draft_vocab, draft_dir)
        draft = DraftRuntime(load_model(draft_dir, "draft", config.draft_format, progress, config.device, keep,
                                        config.dtype),
                             identity=model_identity(draft_dir), name=config.draft, **runtime_options(config))
        return draft, draft_dir

    def target(self, config: EngineConfig, progress: bool, load=None) -> tuple[TargetRole, Path]:
        target_dir = self.meta_dir(config, config.target, "target", progress)
        model = load(target_dir) if load else load_model(target_dir, "target", config.target_format, progress,
                                                         config.device, dtype=config.dtype)
        return (TargetRuntime(model, identity=model_identity(target_dir), name=config.target,
                              **runtime_options(config)), target_dir)


class LlamaCppBackend(RuntimeBackend):
    """GGUF files as they are, on llama.cpp's CPU kernels (models/llamacpp.py)."""

    name = "llamacpp"
    default_draft_quant = DEFAULT_DRAFT_QUANT

    def available(self) -> bool:
        return llamacpp_available()

    def meta_dir(self, config: EngineConfig, source: str, role: Role, progress: bool) -> Path:
        return resolve_gguf(source, role=role, cache=config.cache_dir, progress=progress).meta_dir

    def context_limit(self, config: EngineConfig) -> int | None:
        return config.llamacpp.context

    def cache_limits(self, config: EngineConfig) -> tuple[int | None, int | None]:
        return config.llamacpp.sequences, config.llamacpp.context

    def draft(self, config: EngineConfig, quant: str, progress: bool) -> tuple[DraftRole, Path]:
        if config.draft_vocab != FULL_VOCAB:
            raise ModelSourceError("--draft-vocab needs the torch runtime (llama.cpp's output layer is its own)")
        source = resolve_gguf(config.draft, role="draft", cache=config.cache_dir, progress=progress)
        if quant != SHIPPED:
            source = requantize_gguf(source, quant, cache=config.cache_dir, progress=progress)
        return (LlamaCppDraftRuntime(source.gguf, identity=source.identity, name=config.draft,
                                     options=llamacpp_options(config)), source.meta_dir)

    def target(self, config: EngineConfig, progress: bool, load=None) -> tuple[TargetRole, Path]:
        source = resolve_gguf(config.target, role="target", cache=config.cache_dir, progress=progress)
        return (LlamaCppTargetRuntime(source.gguf, identity=source.identity, name=config.target,
                                      options=llamacpp_options(config)), source.meta_dir)


class FeatureDraftBackend(RuntimeBackend):
    """A feature draft's directory (models/feature_draft.py, `specdec train-draft`): one layer on the
    target's own states, so it runs beside a torch target, whose passes hand them over, and shares
    its tokenizer and vocabulary (its `meta_dir` is the target's)."""

    name = "feature"

    def meta_dir(self, config: EngineConfig, source: str, role: Role, progress: bool) -> Path:
        return RUNTIMES["torch"].meta_dir(config, config.target, "target", progress)

    def cache_limits(self, config: EngineConfig) -> tuple[int | None, int | None]:
        return StaticOptions().slots if resolve_device(config.device, here=False).type == "cuda" else None, None

    def draft(self, config: EngineConfig, quant: str, progress: bool) -> tuple[DraftRole, Path]:
        if quant != SHIPPED or config.draft_vocab != FULL_VOCAB:
            raise ModelSourceError("a feature draft has its own weights and vocabulary: --draft-quant and "
                                   "--draft-vocab do not apply")
        start = time.perf_counter()
        target_dir = self.meta_dir(config, config.target, "target", progress)
        device = resolve_device(config.device)
        directory = draft_dir(config.draft)
        model = load_feature_draft(directory, target_dir, model_identity(target_dir),
                                   resolve_dtype(config.dtype, device), device)
        if device.type == "cpu":
            model = apply_weight_format(model, "draft", config.draft_format)
        if progress:
            print(f"loaded feature draft {directory.name} on {device} in {time.perf_counter() - start:.1f}s",
                  file=sys.stderr)
        # On CUDA its cache is static whatever the target's: its greedy steps run as one chain,
        # captured (models/feature_chain.py)
        kv = "static" if device.type == "cuda" else "slots"
        return FeatureDraftRuntime(model, identity=model_identity(directory), name=config.draft, kv=kv,
                                   static=StaticOptions(graphs=config.cuda_graphs)), target_dir

    def target(self, config: EngineConfig, progress: bool, load=None) -> tuple[TargetRole, Path]:
        raise ModelSourceError("a feature draft is a draft: --target names its target")


class SuffixDraftBackend(RuntimeBackend):
    """The suffix draft (models/suffix.py): no model, on any target; the target's tokenizer and
    vocabulary are its own (its `meta_dir` is the target's: the rules and checks that read it run on
    the coordinator or in process)."""

    name = "suffix"

    def meta_dir(self, config: EngineConfig, source: str, role: Role, progress: bool) -> Path:
        return backend_for(config, "target").meta_dir(config, config.target, "target", progress)

    def draft(self, config: EngineConfig, quant: str, progress: bool) -> tuple[DraftRole, None]:
        """The draft unsized, no file read (and no directory of its own: None): the target's width,
        all it takes of the target (its one-hot q's), is given by build_draft's `target_vocab` in
        process and by the first Propose that names it on a served replica (workers.py
        `DraftWorker.fit`), both through `SuffixDraft.fit_vocabulary`. Resolving the target for it
        here downloaded, assembled or converted the target on the replica's node, which may be any."""
        if quant != SHIPPED or config.draft_vocab != FULL_VOCAB:
            raise ModelSourceError("the suffix draft has no weights: --draft-quant and --draft-vocab do not apply")
        return SuffixDraft(None), None

    def target(self, config: EngineConfig, progress: bool, load=None) -> tuple[TargetRole, Path]:
        raise ModelSourceError("the suffix draft is a draft: --target names its target")


RUNTIMES: dict[str, RuntimeBackend] = {backend.name: backend for backend in (
    TorchBackend(), LlamaCppBackend(), FeatureDraftBackend(), SuffixDraftBackend())}


def backend_for(config: EngineConfig, role: Role, here: bool = True) -> RuntimeBackend:
    """A feature draft runs beside a torch target: its passes hand over the states the draft reads.
    `here`: see resolve_device."""
    config = unfused(config) if role == "draft" else config
    if role == "draft" and is_suffix_draft(config.draft):
        return RUNTIMES["suffix"]
    feature = [is_feature_draft(each.draft) for each in draft_configs(config).values()]
    if feature[0] if role == "draft" else any(feature):
        if config.runtime == "llamacpp":
            raise ModelSourceError("a feature draft reads the target's hidden states, which the llamacpp runtime "
                                   "does not hand out: use --runtime torch (or auto)")
        return RUNTIMES["feature" if role == "draft" else "torch"]
    return RUNTIMES[resolve_runtime(config, config.draft if role == "draft" else config.target, here)]


def model_dir(config: EngineConfig, role: Role, progress: bool = True) -> Path:
    """The directory with a model's config and tokenizer (no weights loaded)."""
    config = unfused(config) if role == "draft" else config
    return backend_for(config, role).meta_dir(config, config.draft if role == "draft" else config.target, role,
                                              progress)


def resolve_draft_quant(config: EngineConfig) -> str:
    """The draft weights `draft_quant` names (see EngineConfig.draft_quant)."""
    if config.draft_quant != "auto":
        return config.draft_quant
    config = unfused(config)
    return backend_for(config, "draft").default_draft_quant if config.draft == "default" else SHIPPED


def build_draft(config: EngineConfig, progress: bool = True,
                target_vocab: tuple[int, int] | None = None) -> tuple[DraftRole, Path | None]:
    """A draft (its config's first), the suffix draft beside it where it is fused, and its model's
    directory (None for the plain suffix draft, which has none). `target_vocab`: (the target's token
    rows, its tokenizer's ids), which a draft with other rows fits its logits to and the plain suffix
    draft takes as its width (build_engine). None: the draft as it is, its target unread (a served
    draft replica: resolving the target there would fetch or convert it on the draft's machine; it
    fits the draft to the width its coordinator's calls name, workers.py `DraftWorker.fit`), the
    plain suffix draft unsized until then."""
    config = unfused(config)
    draft, draft_dir = backend_for(config, "draft").draft(config, resolve_draft_quant(config), progress)
    if target_vocab is not None:
        draft.fit_vocabulary(*target_vocab)  # (before the fused suffix takes its width; the plain suffix's width)
    if config.fuse_suffix:
        draft.suffix = SuffixDraft(draft.vocab_size)
    return draft, draft_dir


def draft_vocabulary(vocab: str, draft_dir: Path) -> list[int] | None:
    """The ids the draft's LM head keeps (None: all); `full` reads nothing from the model directory."""
    if vocab == FULL_VOCAB:
        return None
    vocab_size = AutoConfig.from_pretrained(draft_dir).vocab_size
    return resolve_draft_vocab(vocab, vocab_size, lambda: load_tokenizer(draft_dir))


def build_target(config: EngineConfig, progress: bool = True, load=None) -> tuple[TargetRole, Path]:
    """`load(model_dir) -> model` replaces the default one-device load (the sharded verifier, torch).
    For a feature draft its passes also return the states the draft reads."""
    backend = RUNTIMES["torch"] if load is not None else backend_for(config, "target")
    target, target_dir = backend.target(config, progress, load)
    for each in draft_configs(config).values():
        if is_feature_draft(each.draft):
            target.read_features(target_layers_of(read_config(each.draft)))
    return target, target_dir


def llamacpp_options(config: EngineConfig) -> LlamaCppOptions:
    update = {}
    if config.threads and config.llamacpp.threads is None:
        update["threads"] = config.threads
    if config.batch.max_tokens_per_pass:
        update["batch"] = config.batch.max_tokens_per_pass
        if update["batch"] < config.llamacpp.sequences:  # (llama.cpp would abort the process)
            raise ModelSourceError(f"--max-pass-tokens {update['batch']}: a llama.cpp pass holds one output for each of "
                                   f"its {config.llamacpp.sequences} sequences at least; give {config.llamacpp.sequences} "
                                   "or more")
    return config.llamacpp.model_copy(update=update)


def runtime_options(config: EngineConfig) -> dict:
    return {"kv": resolve_kv_cache(config), "max_tokens_per_pass": config.batch.max_tokens_per_pass,
            "static": StaticOptions(graphs=config.cuda_graphs)}


def resolve_kv_cache(config: EngineConfig, here: bool = True) -> str:
    """EngineConfig.kv_cache on the models' device: "auto" is static on a GPU, slots elsewhere.
    `here`: see resolve_device."""
    if config.kv_cache != "auto":
        return config.kv_cache
    return "static" if resolve_device(config.device, here).type == "cuda" else "slots"


def head_path(config: EngineConfig) -> str | None:
    return resolve_head(config.head, fused_with(config.draft) or config.draft)


def has_head(config: EngineConfig) -> bool:
    """Whether the draft's rounds have acceptance estimates: a head, or the suffix draft's own."""
    return is_suffix_draft(config.draft) or head_path(config) is not None


def build_head(config: EngineConfig, draft: DraftRole, name: str = DEFAULT_DRAFT) -> AcceptanceHead | MatchHead | None:
    """`name`: the draft's (a draft besides the first reads the head in its own directory)."""
    if is_suffix_draft(config.draft):  # its estimates come from its matches (models/suffix.py)
        return MatchHead()
    path = head_path(config)
    if path is None:
        return None
    with named_draft(name):
        return load_head(path, draft_identity=draft.identity, hidden_size=draft.hidden_size, **head_instead(path, name))


def head_instead(path: str, name: str) -> dict[str, str]:
    """load_head's `instead` for draft `name`: --head (or `none`) applies to the first draft only."""
    if name == DEFAULT_DRAFT:
        return {}
    return {"instead": f"a draft besides the first reads the head in its own directory: move {path} out of it, "
                       "or train one for this draft there"}


@contextmanager
def named_draft(name: str) -> Iterator[None]:
    """A draft besides the first named in the error the block raises."""
    try:
        yield
    except SpecDecError as exc:
        if name == DEFAULT_DRAFT:
            raise
        raise type(exc)(f"draft {name!r}: {exc}") from None


def known_draft_identity(config: EngineConfig) -> str | None:
    """The identity the draft of `config` carries once loaded, where it is known without fetching,
    converting, requantizing or loading it: a model directory's or a feature draft's (model_identity
    reads a few MiB of each weight file), the pinned default's (its GGUF's, with the recipe of its
    requantization on llama.cpp). None where only resolving the source tells (a hub id, a GGUF file,
    whose identity is its sha256) and for the suffix draft, which has none."""
    config = unfused(config)
    source, backend = config.draft, backend_for(config, "draft")
    if backend.name == "feature":
        directory = draft_dir(source)
    elif source == "default" and backend.name in ("torch", "llamacpp"):
        quant, identity = resolve_draft_quant(config), gguf_identity(DEFAULTS["draft"].sha256)
        if quant == SHIPPED:
            return identity
        # (torch refuses a requantized draft when it builds it: nothing to check before)
        return requantized_identity(identity, quant) if backend.name == "llamacpp" else None
    elif backend.name == "torch" and check_source(source, "draft") == "dir":
        directory = Path(source).expanduser()
    else:
        return None
    try:
        return model_identity(directory)
    except (ModelSourceError, OSError):  # (no weights there: loading it says so)
        return None


def check_head_identity(config: EngineConfig, name: str = DEFAULT_DRAFT) -> None:
    """A head trained for another draft, refused in one line before the draft loads where its identity
    is known without loading it (known_draft_identity): a real draft takes seconds to minutes to
    load. build_head checks it again once the draft loaded, where only that tells."""
    if is_suffix_draft(config.draft) or (path := head_path(config)) is None:
        return
    identity = known_draft_identity(config)
    if identity is not None:
        with named_draft(name):
            check_serves(read_head_config(path), path, identity, **head_instead(path, name))


def build_rules(config: EngineConfig, progress: bool = True, devices: dict[Role, str] | None = None) -> RequestRules:
    """A request's rules without loading weights (the coordinator): tokenizer, EOS, context,
    vocabulary, and each draft's traits. `devices`: where `device: auto` puts each role's models
    when they load in other processes (a served app's replicas: a GPU where Ray gives them one),
    whose runtimes then set the context limit; the files are read as this process resolves them.
    A draft whose rows differ from the target's is fitted where it runs: by build_engine in
    process, by a served draft replica to the width the loop's calls name (the rules' vocabulary:
    calls.py `RoundCalls`)."""
    def context_limit(each: EngineConfig, role: Role) -> int | None:
        each = placed(each, role, devices)
        return backend_for(each, role, here=False).context_limit(each)

    target_dir = model_dir(config, "target", progress)
    target_config = AutoConfig.from_pretrained(target_dir)
    tokenizer = load_tokenizer(target_dir)
    limits = [context_limit(config, "target"), target_config.max_position_embeddings]
    drafts = {}
    for name, each in draft_configs(config).items():
        draft_dir = model_dir(each, "draft", progress)
        draft_config = AutoConfig.from_pretrained(draft_dir)
        check_shared_vocabulary(draft_dir, target_config.vocab_size, tokenizer, each.draft)
        limits += [context_limit(each, "draft"), draft_config.max_position_embeddings]
        drafts[name] = DraftTraits(has_head=has_head(each), reads_features=is_feature_draft(each.draft),
                                   model_free=is_suffix_draft(each.draft), fused=each.fuse_suffix)
    return RequestRules(tokenizer, eos_token_ids_of(load_generation_config(target_dir), tokenizer),
                        min(limit for limit in limits if limit is not None), target_config.vocab_size, drafts)


def cache_limits(config: EngineConfig, devices: dict[Role, str] | None = None) -> tuple[int | None, int | None]:
    """The fewest sessions, and positions in all, any of the config's runtimes (the target's, every
    draft's) holds caches for at once (None: no limit but memory), read from the settings without
    loading a model; `devices` as build_rules'. The loaded roles say the same (`max_pass_sessions`,
    `max_cached_positions`)."""
    limits = [backend_for(each, role, here=False).cache_limits(each)
              for role, each in [("target", placed(config, "target", devices))]
              + [("draft", placed(each, "draft", devices)) for each in draft_configs(config).values()]]
    sessions, positions = zip(*limits)
    return (min((n for n in sessions if n is not None), default=None),
            min((n for n in positions if n is not None), default=None))


def placed(config: EngineConfig, role: Role, devices: dict[Role, str] | None) -> EngineConfig:
    """`config` with `device: auto` resolved as where the role's models load (`devices`: build_rules)."""
    if devices is not None and config.device == "auto":
        return config.model_copy(update={"device": devices[role]})
    return config


def resolve_device(device: str = "auto", here: bool = True) -> torch.device:
    """`here`: the models load in this process, so a GPU it names must be visible to it (False:
    where the device only decides a setting, e.g. the context limit of replicas elsewhere)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ModelSourceError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if here and resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelSourceError(f"device {device!r}: no CUDA GPU is visible to this process")
    return resolved


def resolve_dtype(dtype: Dtype, device: torch.device) -> torch.dtype:
    """EngineConfig.dtype on `device`: "auto" is bfloat16 on a GPU and float32 on the CPU, the only
    dtype the CPU weight formats take (models/formats.py)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and dtype != "float32":
        raise ModelSourceError(f"dtype {dtype!r} on the CPU: the torch runtime's CPU kernels take float32 "
                               "(use --dtype auto or float32 there)")
    return getattr(torch, dtype)


def load_model(model_dir: Path, role: Role, weight_format: WeightFormat = "auto", progress: bool = True,
               device: str = "auto", keep_tokens: list[int] | None = None, dtype: Dtype = "auto"):
    """`keep_tokens`: the only ids the LM head scores (a trimmed draft vocabulary, models/vocab.py)."""
    start = time.perf_counter()
    target_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target_device)
    hf_logging.disable_progress_bar()  # a cached model loads in seconds; one summary line says so
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    except Exception as exc:  # transformers raises OSError, ValueError, safetensors errors, ...
        raise ModelSourceError(f"cannot load the {role} model from {model_dir}: {one_line(exc)}") from None
    if keep_tokens is not None:
        model = trim_lm_head(model, keep_tokens)
    if target_device.type == "cpu":
        model = apply_weight_format(model.eval(), role, weight_format)  # CPU kernels (models/formats.py)
    else:
        model = model.to(target_device).eval()
    if progress:
        vocab = f", {len(set(keep_tokens))} output tokens" if keep_tokens is not None else ""
        print(f"loaded {role} {model_dir.name} on {target_device}{vocab} in {time.perf_counter() - start:.1f}s",
              file=sys.stderr)
    return model


def load_tokenizer(model_dir: Path):
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise ModelSourceError(f"cannot load the tokenizer from {model_dir}: {one_line(exc)}") from None


def target_vocabulary(config: EngineConfig, progress: bool = True):
    """(the target's token rows, its tokenizer), from its config: no weights loaded."""
    target_dir = model_dir(config, "target", progress)
    return AutoConfig.from_pretrained(target_dir).vocab_size, load_tokenizer(target_dir)


def check_shared_vocabulary(draft_dir: Path, target_rows: int, target_tokenizer, source: str) -> None:
    """Draft and target must map text to the same ids, or verification compares different tokens.
    Their embeddings may differ in padding rows past the tokenizer's last id (Qwen2.5's 0.5B has
    151,936 rows, its 7B 152,064, the tokenizer 151,665 ids): the tokenizers must then agree on every
    id below the smaller (a GGUF's token texts, its [PAD] tokens included, as llama.cpp checks), and
    the draft is fitted to the target's width (`build_draft`; it gives the ids past it q = 0).
    `source`: the draft as the user named it."""
    draft_rows = AutoConfig.from_pretrained(draft_dir).vocab_size
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    except Exception:
        draft_tokenizer = None  # a draft directory without a tokenizer: only the sizes tell
    if draft_tokenizer is None:
        if draft_rows != target_rows:
            raise IncompatibleModelsError(
                f"draft and target vocabularies differ ({draft_rows} vs {target_rows} tokens) and the draft "
                f"({source}) has no tokenizer to tell which ids they share")
        return
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_rows != target_rows:
        shared = min(draft_rows, target_rows)
        draft_vocab = {text: i for text, i in draft_vocab.items() if i < shared}
        target_vocab = {text: i for text, i in target_vocab.items() if i < shared}
    if draft_vocab != target_vocab:
        raise IncompatibleModelsError(
            f"the draft ({source}) and target tokenizers have different vocabularies; "
            "speculative decoding needs one shared vocabulary")


def load_generation_config(model_dir: Path) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: what transformers derives from the model's config
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))


def eos_token_ids_of(generation_config, tokenizer) -> set[int]:
    ids = set()
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids

