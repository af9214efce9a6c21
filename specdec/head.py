"""The acceptance prediction head f_theta (paper §3.2-3.3).

A (D+1)-layer ResNet with SiLU on the draft model's final hidden state e_i of candidate y_i:
D residual blocks x + SiLU(W x + b), then a linear layer to one logit. D = 0 is a linear probe.
The input is first standardised per dimension with the training features' mean and standard
deviation (buffers saved with the weights): the default draft's final hidden states carry one
"massive" dimension near 150 at every position while the others spread ~3, and unscaled it swamps
the first layer (first-epoch loss ~16 and a noisy, slower fit on the default pair's data).
sigmoid(f_theta(e_i)) predicts P(y_i accepted | y_1..y_{i-1} accepted).

`features` (specdec/features.py) picks the input: `hidden` (the paper; the default, so a head.json
without the field loads as before) or `hidden+distribution`, the hidden state q_i came from
concatenated with the draft distribution's scalar features at y_i (standardised together).

`bottleneck` (optional): the standardised hidden state goes through a linear map to this many
dimensions before it joins the scalar features and the blocks; the blocks then run at that width
plus the scalars'. On the default pair's data a full-width `hidden+distribution` head overfits
the hidden state (validation AUROC 0.882 against 0.892 for q(y_i) alone) while the scalars carry
nearly everything; the bottleneck (with `dropout` on the hidden state in training) keeps the
hidden state from drowning them. None: the blocks read the whole input, the paper's shape.

`calibration` (optional): an affine map of the logit, sigmoid(scale * l + bias), fitted after
training on validation tokens (training/calibration.py) and applied by `acceptance_probability`.

On disk a head is a directory with `head.safetensors` and `head.json`; the JSON records the
draft model it was trained on (hidden size and identity), and loading it for another draft fails,
unless `validated_drafts` lists that draft: one shown, on validation tokens, to be judged as well as
the head's own (training/transfer.py; e.g. the draft requantized for llama.cpp's fast kernels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.errors import IncompatibleModelsError, ModelSourceError, one_line
from specdec.files import written_together
from specdec.features import FEATURES_DISTRIBUTION, FEATURES_HIDDEN, NUM_SCALAR_FEATURES, FeatureKind, join_head_inputs

WEIGHTS_FILE, CONFIG_FILE = "head.safetensors", "head.json"
MAX_DEPTH = 4  # the paper sweeps D in 0..4
MIN_INPUT_STD = 1e-3  # a constant input dimension is centred, not blown up


class Calibration(BaseModel):
    """Phat = sigmoid(scale * l + bias) for the head's raw logit l (Platt scaling)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["platt"] = "platt"
    scale: float = Field(gt=0.0)  # > 0: calibration never reorders candidates (AUROC unchanged)
    bias: float

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.scale + self.bias


class ValidatedDraft(BaseModel):
    """Another draft the head serves, with the evidence (training/transfer.py, benchmarks/head_transfer.py):
    on the same validation tokens, its AUROC and ECE against the head's own draft measured alike."""

    model_config = ConfigDict(extra="allow")

    identity: str
    name: str = ""
    tokens: int = Field(ge=0)
    auroc: float
    ece: float
    reference_auroc: float
    reference_ece: float
    source: str = ""  # the command, machine and date that measured it


class HeadConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    hidden_size: int = Field(gt=0)
    depth: int = Field(ge=0, le=MAX_DEPTH)
    draft_identity: str  # `specdec.models.sources.model_identity` of the draft it belongs to
    draft_name: str = ""
    # SpecDec++'s h for this head, chosen on validation prompts (`specdec bench --prompts validation`);
    # None: the policy's default.
    threshold: float | None = Field(None, gt=0.0, lt=1.0)
    features: FeatureKind = FEATURES_HIDDEN
    bottleneck: int | None = Field(None, gt=0)  # width the hidden state is projected to (module docstring)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the standardised hidden state, in training only
    calibration: Calibration | None = None
    validated_drafts: list[ValidatedDraft] = []

    def serves(self, draft_identity: str) -> bool:
        """The head's own draft, or one validated for it."""
        return draft_identity == self.draft_identity or any(v.identity == draft_identity
                                                            for v in self.validated_drafts)

    @property
    def input_size(self) -> int:
        """Width of the head's input: the hidden state, plus the scalar features when it reads them."""
        return self.hidden_size + (NUM_SCALAR_FEATURES if self.features == FEATURES_DISTRIBUTION else 0)

    @property
    def block_width(self) -> int:
        """Width of the residual blocks: the input, or the bottleneck plus the scalar features."""
        return self.input_size if self.bottleneck is None else self.bottleneck + self.input_size - self.hidden_size

    @property
    def judges_current(self) -> bool:
        """True: at drafting step i the head judges y_i itself; False (the paper's): y_{i-1}."""
        return self.features == FEATURES_DISTRIBUTION


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class AcceptanceHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        width = config.input_size
        self.register_buffer("input_mean", torch.zeros(width))  # identity until fitted
        self.register_buffer("input_std", torch.ones(width))
        self.dropout = nn.Dropout(config.dropout)
        self.project = nn.Linear(config.hidden_size, config.bottleneck) if config.bottleneck is not None else None
        self.blocks = nn.Sequential(*(ResidualBlock(config.block_width) for _ in range(config.depth)))
        self.out = nn.Linear(config.block_width, 1)

    @torch.no_grad()
    def fit_input_statistics(self, hidden: torch.Tensor, scalars: torch.Tensor | None = None,
                             chunk: int = 65536) -> None:
        """Set the standardisation from training inputs: hidden [N, H] (any float dtype, any N), and for
        a `hidden+distribution` head its scalar features [N, S] (per dimension, so each part alone)."""
        parts = [hidden] if scalars is None else [hidden, scalars]
        stats = [_mean_std(part, chunk) for part in parts]
        mean, std = torch.cat([m for m, _ in stats]), torch.cat([s for _, s in stats])
        if mean.numel() != self.input_mean.numel():
            raise ValueError(f"inputs of width {mean.numel()} for a head reading {self.input_mean.numel()}")
        self.input_mean.copy_(mean.to(self.input_mean.dtype))
        self.input_std.copy_(std.to(self.input_std.dtype))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., I] (`head_inputs`) -> raw acceptance logits [...] (what training fits)."""
        x = (inputs.to(self.out.weight.dtype) - self.input_mean) / self.input_std
        hidden, scalars = self.dropout(x[..., :self.config.hidden_size]), x[..., self.config.hidden_size:]
        if self.project is not None:
            hidden = self.project(hidden)
        return self.out(self.blocks(torch.cat([hidden, scalars], dim=-1))).squeeze(-1)

    def calibrated_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        calibration = self.config.calibration
        return calibration.apply(logits) if calibration is not None else logits

    @torch.inference_mode()
    def acceptance_probability(self, inputs: torch.Tensor) -> torch.Tensor:
        """sigmoid of the (calibrated) logit for inputs [..., I]."""
        return torch.sigmoid(self.calibrated_logits(inputs))

    def head_inputs(self, hidden: torch.Tensor, scalars: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] (+ scalars [..., S] for `hidden+distribution`) -> inputs [..., I]."""
        return join_head_inputs(self.config.features, hidden, scalars)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with written_together(directory / WEIGHTS_FILE, directory / CONFIG_FILE) as (weights, config):
            save_file({k: v.contiguous() for k, v in self.state_dict().items()}, weights)
            config.write_text(self.config.model_dump_json(indent=2) + "\n")
        return directory


def read_head_config(directory: str | Path) -> HeadConfig:
    """A head's config, its files checked (the builder reads it before any model loads)."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelSourceError(f"no acceptance head at {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        return HeadConfig.model_validate(json.loads(config_path.read_text()))
    except ValueError as exc:
        raise ModelSourceError(f"corrupt head config {config_path}: {one_line(exc)}") from None


FOR_THIS_DRAFT = "pass --head none or a head trained for this draft"


def check_serves(config: HeadConfig, directory: str | Path, draft_identity: str, instead: str = FOR_THIS_DRAFT) -> None:
    """IncompatibleModelsError (one line) where the head at `directory` does not serve the draft of
    `draft_identity`; `instead`: what the user may do then."""
    if not config.serves(draft_identity):
        raise IncompatibleModelsError(
            f"head {directory} was trained for another draft model ({config.draft_name or 'identity'} "
            f"{_short(config.draft_identity)}), not this one ({_short(draft_identity)}); {instead}")


def load_head(
    directory: str | Path,
    draft_identity: str | None = None,
    hidden_size: int | None = None,
    instead: str = FOR_THIS_DRAFT,
) -> AcceptanceHead:
    """Load a head and check that it belongs to the draft (identity and hidden size) when given;
    `instead`: what the user may do where it does not."""
    directory = Path(directory)
    weights_path = directory / WEIGHTS_FILE
    config = read_head_config(directory)
    if hidden_size is not None and config.hidden_size != hidden_size:
        raise IncompatibleModelsError(
            f"head {directory} expects hidden size {config.hidden_size} but the draft has {hidden_size}")
    if draft_identity is not None:
        check_serves(config, directory, draft_identity, instead)
    head = AcceptanceHead(config)
    try:
        head.load_state_dict(load_file(weights_path))
    except Exception as exc:  # safetensors raises several types for truncated or mismatched files
        raise ModelSourceError(f"corrupt head weights {weights_path}: {one_line(exc)}") from None
    return head.eval()


def _short(identity: str) -> str:
    """A model identity's first hash digits (a GGUF's identity starts with its scheme), with the
    recipe of a derived GGUF ("1d9614638d18+q4_0")."""
    digest, plus, recipe = identity.rpartition(":")[2].partition("+")
    return digest[:12] + plus + recipe


def _mean_std(rows: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std (floored at MIN_INPUT_STD) of rows [N, D], in fp64 chunks."""
    total = torch.zeros(rows.shape[-1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk].double()
        total += part.sum(0)
        squares += (part * part).sum(0)
    count = max(len(rows), 1)
    mean = total / count
    return mean, (squares / count - mean * mean).clamp_min(0).sqrt().clamp_min(MIN_INPUT_STD)

