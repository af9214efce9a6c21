"""The configuration of the training pipeline: one YAML file for `specdec gen-data` and
`specdec train-head` (examples in cluster/training/).

Sections: `models` (the pair), `data` (prompts, responses, labels, where shards go), `scaling`
(Ray workers: the only section that changes between this CPU and a GPU cluster), `train` (the
head and its optimisation) and `sweep` (the D x w_rej grid chosen on validation). Every model
forbids unknown keys, and a bad file fails as one line before any Ray or model work.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.builder import EngineConfig
from specdec.drafts import draft_dir
from specdec.errors import SpecDecError, one_line
from specdec.features import FEATURES_HIDDEN, FeatureKind
from specdec.head import MAX_DEPTH
from specdec.models.formats import WeightFormat
from specdec.models.vocab import ASCII, FULL
from specdec.policies import POLICY_NAMES, PolicyConfig, policy_traits
from specdec.sampling import SamplingParams
from specdec.training.mixing import OFFICIAL_TARGET_TOKEN_RATIO

PromptSource = Literal["stdlib-docstrings", "prose", "package-docstrings"]
SELECT_BY = {"kl": "min", "auroc": "max", "ece": "min", "loss": "min"}  # validation metric -> better
MAX_SEED = (1 << 63) - 1  # torch's generators take 64 bits (a seed + an epoch stays within them)


class ConfigError(SpecDecError, ValueError):
    """A training config that cannot be used (unknown key, impossible value, unreadable file)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*")
    @classmethod
    def _finite(cls, value):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


def _folder(path: str | None, writable: bool = False) -> str | None:
    """A folder's path, `~` expanded. What of it exists must be folders: a file there would fail the
    job with a traceback at its first write, minutes in. A URI (`s3://...`) is refused: the jobs
    write through the file system, which would make it a local folder named `s3:`."""
    if path is None:
        return None
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise ValueError(f"{path!r} is a URI; the jobs read and write folders: mount the storage and give its path")
    try:
        if "\0" in path:
            raise ValueError("a NUL character")
        expanded = Path(path).expanduser()
        existing = next(p for p in (expanded, *expanded.parents) if p.exists())  # ("/" exists)
    except (RuntimeError, OSError, ValueError) as error:  # ~nosuchuser, a name too long, a NUL
        raise ValueError(f"{path!r} is not a usable path ({one_line(error)})") from None
    if not existing.is_dir():
        raise ValueError(f"{path}: {existing} is a file, not a folder")
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: {existing} is not writable")
    return str(expanded)


def _writable_folder(path: str | None) -> str | None:
    """A folder a job writes (`_folder`), refused where it could not: a read-only file system or no
    permission would fail it at its first write, after the work."""
    return _folder(path, writable=True)


def _run_name(name: str) -> str:
    """A run's name is a folder under the storage: `.` or `..` would put it beside or above it."""
    if not name.strip("."):
        raise ValueError("must not be made of dots alone")
    return name


class ModelsSection(Strict):
    draft: str = "default"
    target: str = "default"
    cache_dir: str | None = None
    # The draft's teacher-forced passes (labels, features) read whole sequences at once: int8 (and
    # `auto`, int8 on CPU) takes ONE activation scale per pass, which over a sequence moves the hidden
    # states far from the weights' own (cosine 0.80 to fp32 on the default pair) while one token a
    # pass, as in decoding, is fine. So the pipeline runs the draft unquantized.
    draft_format: WeightFormat = "fp32"
    target_format: WeightFormat = "auto"
    draft_vocab: str = "full"  # label with the draft vocabulary the head will serve with (models/vocab.py)

    @field_validator("draft_vocab")
    @classmethod
    def _vocabulary(cls, vocab: str) -> str:
        # (checked here, not first in each generation worker, which would fail with a traceback)
        if vocab not in (FULL, ASCII) and not Path(vocab).expanduser().is_file():
            raise ValueError(f"expected 'full', 'ascii' or a JSON file of token ids, not {vocab!r}")
        return vocab

    @field_validator("draft_format")
    @classmethod
    def _unquantized_draft(cls, fmt: str) -> str:
        if fmt in ("auto", "int8"):
            raise ValueError("must be fp32 or onednn: int8 scales a whole teacher-forced pass at once")
        return fmt

    def engine_config(self, threads: int | None = None) -> EngineConfig:
        return EngineConfig(draft=self.draft, target=self.target, head="none", cache_dir=self.cache_dir,
                            draft_format=self.draft_format, target_format=self.target_format,
                            draft_vocab=self.draft_vocab, threads=threads,
                            runtime="torch")  # labelling reads the torch models (training/data.py)


class PromptsSection(Strict):
    # One source or several (their prompts interleave in hash order, each source split on its own).
    source: PromptSource | list[PromptSource] = Field("stdlib-docstrings", min_length=1)
    train: int | None = Field(None, ge=1, description="train prompts to generate (None: all)")
    validation: int | None = Field(None, ge=1, description="validation prompts to generate (None: all)")
    validation_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    max_prompt_tokens: int = Field(512, ge=8)


class ResponseSection(Strict):
    """How the target's response X is produced (through the engine: lossless, so any policy)."""

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(256, ge=1)
    policy: str = "fixed"
    k: int | None = Field(8, ge=1)
    # Features data only: a train prompt with a reference answer (the stdlib prompts' own code) takes
    # it as its response, one teacher-forced pass instead of a decode; validation prompts and prompts
    # without one keep the target's response (training/data.py, "Reference answers").
    reference: bool = False

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        traits = policy_traits(name) if name in POLICY_NAMES else None
        if traits is None or traits.needs_head or traits.needs_reference:
            raise ValueError(f"must be a policy that needs no head or hindsight, not {name!r}")
        return name

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed)

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(name=self.policy, k=self.k if policy_traits(self.policy).uses_draft else None)


class LabelsSection(Strict):
    """The label sets of every response: for each temperature, the transform p and q go through
    before Y_i ~ q_i and P_i = min(1, p_i(Y_i)/q_i(Y_i)); temperature 0 labels greedy verification
    (Y_i = argmax q_i, one-hot p and q: exact match). `draws` independent Y per sampled temperature
    (the target's p and the draft's q are computed once and reused; a greedy temperature has one)."""

    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    draws: int = Field(1, ge=1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, temperatures: list[float]) -> list[float]:
        if any(not (math.isfinite(t) and t >= 0.0) for t in temperatures) or len(set(temperatures)) < len(temperatures):
            raise ValueError("must be distinct temperatures >= 0")
        return temperatures

    def sets(self) -> list[SamplingParams]:
        """One SamplingParams per label set, in the order the shards store them."""
        return [SamplingParams(temperature=t, top_p=self.top_p, top_k=self.top_k)
                for t in self.temperatures for _ in range(1 if t == 0.0 else self.draws)]


class FeaturesSection(Strict):
    """What a `features` dataset keeps at every position of prompt + response, for the feature draft
    (models/feature_draft.py): the target's hidden states after these decoder layers (0-based:
    low, middle and high by default) and its output state (the final norm's, which its LM head
    reads: the soft targets and the one-layer variant's input)."""

    layers: list[int] = Field(default_factory=lambda: [1, 13, 24], min_length=1)
    # The states' teacher-forced pass: `target`, the target as the engine runs it (float32 on the
    # CPU, bfloat16 on a GPU); `bfloat16`, a bfloat16 copy of it where the engine runs float32. On a
    # CPU with AVX-512 BF16 that pass takes half the time and its states are within cosine 0.9996
    # of float32's (docs/training.md, "Computing the states in bfloat16"). The states are stored in
    # bfloat16 either way; each shard records how its states were computed.
    compute: Literal["target", "bfloat16"] = "target"

    @field_validator("layers")
    @classmethod
    def _layers(cls, layers: list[int]) -> list[int]:
        if any(i < 0 for i in layers) or len(set(layers)) < len(layers) or layers != sorted(layers):
            raise ValueError("must be distinct decoder layer indices >= 0, in increasing order")
        return layers


class DataSection(Strict):
    dir: str = Field(min_length=1, description="shards and manifest.json")
    # `labels`: the acceptance head's data (responses, labels); `features`: the feature draft's
    # (responses and the target's hidden states; training/data.py).
    kind: Literal["labels", "features"] = "labels"
    features: FeaturesSection = FeaturesSection()
    prompts: PromptsSection = PromptsSection()
    response: ResponseSection = ResponseSection()
    labels: LabelsSection = LabelsSection()
    seed: int = Field(0, ge=0)
    shard_size: int = Field(8, ge=1, description="prompts per shard (the unit of resume)")

    _folder_dir = field_validator("dir")(_folder)

    @model_validator(mode="after")
    def _reference_for_features(self) -> DataSection:
        if self.response.reference and self.kind != "features":
            raise ValueError("response.reference applies to features data only: the head's labels are of the "
                             "target's own responses")
        return self


class ScalingSection(Strict):
    """Ray workers for both steps: generation actors and Ray Train workers."""

    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, ge=0.0001)  # (Ray's finest fraction of a resource)
    threads: int | None = Field(None, ge=1, le=4096, description="torch threads per worker (None: Ray's OMP setting)")


class TrainSection(Strict):
    storage: str = Field(min_length=1, description="Ray Train storage path: checkpoints and the feature cache")
    name: str = Field("head", min_length=1, pattern=r"^[\w.-]+$", description="run name (resume key)")
    output: str = Field(min_length=1, description="where the final head is saved")
    depth: int = Field(3, ge=0, le=MAX_DEPTH)
    w_acc: float = Field(1.0, ge=0.0)
    w_rej: float = Field(6.0, ge=0.0)
    mixing_ratio: float = Field(OFFICIAL_TARGET_TOKEN_RATIO, ge=0.0, lt=1.0)
    mixing_seed: int = Field(0, ge=0, le=MAX_SEED)
    reduction: Literal["mean", "weighted_mean"] = "mean"
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(512, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # What the head reads (specdec/features.py): the paper's `hidden`, or `hidden+distribution`.
    features: FeatureKind = FEATURES_HIDDEN
    # Project the hidden state to this width before the blocks, with dropout on it in training (head.py).
    bottleneck: int | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Fit Platt scaling on the validation tokens after training and save it with the head (calibration.py).
    calibrate: bool = True
    # The head's data from the dataset's first N train sequences (its order: reused responses, the
    # target's own text, first); the validation split whole. None: every train sequence. The draft's
    # passes over the data are most of train-head's time (a feature draft's: seconds a sequence here).
    max_sequences: int | None = Field(None, ge=1)

    _folder_paths = field_validator("storage", "output")(_writable_folder)
    _name_is_a_folder = field_validator("name")(_run_name)

    @model_validator(mode="after")
    def _some_weight(self):
        if self.w_acc == 0.0 and self.w_rej == 0.0:
            raise ValueError("w_acc and w_rej cannot both be 0")
        return self


class DraftTrainSection(Strict):
    """`specdec train-draft`: the feature draft (models/feature_draft.py) on a `features` dataset."""

    storage: str = Field(min_length=1, description="Ray Train storage path: checkpoints")
    name: str = Field("feature-draft", min_length=1, pattern=r"^[\w.-]+$", description="run name (resume key)")
    output: str = Field(min_length=1, description="where the trained draft is saved")
    # What g_t reads: `fused` = the dataset's layers (low, middle, high) reduced to one width, or
    # `output` = the target's output state alone.
    inputs: Literal["fused", "output"] = "fused"
    intermediate_size: int | None = Field(4480, ge=1, description="the layer's MLP width (None: the target's)")
    vocab_coverage: float = Field(0.99, gt=0.0, le=1.0, description="share of train response tokens the trimmed vocabulary covers")
    vocab_size: int = Field(0, ge=0, description="at least this many output ids, the lowest (most frequent BPE merges) added")
    steps: int = Field(3, ge=1, le=8, description="draft steps unrolled in training (training-time test)")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of step j: step_decay ** (j - 1)")
    prompt_weight: float = Field(0.5, ge=0.0, le=1.0, description="loss weight of positions that predict prompt tokens")
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step")
    # Batches of sequences of like length (transformers' group_by_length): a batch is padded to its
    # longest sequence, and the layer's work is paid on the padding too.
    group_by_length: bool = True
    # The target's own responses (not reference answers) repeated in each epoch: what the draft
    # drafts after in serving, and what its validation measures, are the target's own text.
    own_repeats: int = Field(1, ge=1, description="times each of the target's own responses appears in an epoch")
    lr: float = Field(5e-4, gt=0.0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0.0)
    checkpoint_every: int = Field(100, ge=1, description="optimizer steps between checkpoints (the unit of resume)")
    max_tokens: int = Field(1024, ge=8, description="longest prompt + response trained on (longer ones are cut)")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # A saved feature draft to start from (a longer run on more data without starting over): its
    # weights and its vocabulary; its target, inputs and shape must be this run's.
    init: str | None = Field(None, min_length=1, description="a saved feature draft directory to start from, "
                             "or a shipped one's name (default-feature)")

    _folder_paths = field_validator("storage", "output")(_writable_folder)
    _init_folder = field_validator("init")(lambda path: None if path is None else _folder(str(draft_dir(path))))
    _name_is_a_folder = field_validator("name")(_run_name)


class SweepSection(Strict):
    depths: list[int] = Field(default_factory=lambda: list(range(MAX_DEPTH + 1)), min_length=1)
    w_rej: list[float] = Field(default_factory=lambda: [1.0, 3.0, 6.0, 12.0], min_length=1)
    select_by: Literal["kl", "auroc", "ece", "loss"] = "kl"

    @field_validator("depths")
    @classmethod
    def _depths(cls, depths: list[int]) -> list[int]:
        if any(not 0 <= d <= MAX_DEPTH for d in depths):
            raise ValueError(f"each depth must lie in 0..{MAX_DEPTH}")
        if len(set(depths)) < len(depths):
            raise ValueError("must be distinct depths")
        return depths

    @field_validator("w_rej")
    @classmethod
    def _weights(cls, weights: list[float]) -> list[float]:
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ValueError("each w_rej must be a positive number")
        if len({f"{w:g}" for w in weights}) < len(weights):  # (a run's name holds it so: train.py)
            raise ValueError("must be weights distinct in their first 6 digits")
        return weights


class PipelineConfig(Strict):
    models: ModelsSection = ModelsSection()
    data: DataSection
    scaling: ScalingSection = ScalingSection()
    train: TrainSection | None = None
    sweep: SweepSection = SweepSection()
    draft: DraftTrainSection | None = None

    def require_train(self) -> TrainSection:
        if self.train is None:
            raise ConfigError("the config has no `train` section")
        return self.train

    def require_draft(self) -> DraftTrainSection:
        if self.draft is None:
            raise ConfigError("the config has no `draft` section (what `specdec train-draft` trains)")
        if self.data.kind != "features":
            raise ConfigError("data.kind must be `features` to train a feature draft")
        return self.draft


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML config; every problem is one line naming the file and the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML ({one_line(exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (models, data, scaling, train, sweep)")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, source: str = "config") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {config_error_message(exc)}") from None


def config_error_message(exc: ValidationError) -> str:
    """`train.w_rej: Input should be greater than or equal to 0` / `data.bogus: unknown key`."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "config"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}"
