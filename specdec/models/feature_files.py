"""A feature draft's files: its directory (`config.json`, the trained weights in `model.safetensors`,
a training `report.json`), read beside the target's own files (its embeddings and LM head rows,
never copied), and the byte layout of the target's states in training shards and on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError

from specdec.drafts import draft_dir
from specdec.errors import IncompatibleModelsError, ModelSourceError, one_line, validation_message
from specdec.files import written_together
from specdec.models.feature_draft import FeatureDraft, FeatureDraftConfig

CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE = "config.json", "model.safetensors", "report.json"


def pack_states(states: torch.Tensor) -> bytes:
    """bfloat16 states [...] -> their bytes, row-major (the training shards' and the wire's layout)."""
    return states.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


def unpack_states(data: bytes, tokens: int, hidden_size: int) -> torch.Tensor:
    """The inverse of `pack_states`: [tokens, reads, H] bfloat16 (reads from the length)."""
    import numpy as np

    flat = torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16)
    return flat.view(tokens, -1, hidden_size)


def save_feature_draft(model: FeatureDraft, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Its own weights (`FeatureDraft.own_state`) in `dtype` and its config into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model.own_state().items()}
    config = model.config.model_copy(update={"dtype": str(dtype).removeprefix("torch.")})
    with written_together(directory / WEIGHTS_FILE, directory / CONFIG_FILE) as (weights, config_path):
        save_file(state, str(weights))
        config_path.write_text(json.dumps(config.model_dump(), indent=2) + "\n")
    return directory


def is_feature_draft(source: str | Path) -> bool:
    """Whether `source` names a feature draft's directory (its config names the target it reads)."""
    path = draft_dir(source) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "target_identity" in config and "layer_config" in config


def read_config(directory: str | Path) -> FeatureDraftConfig:
    path = draft_dir(directory) / CONFIG_FILE
    try:
        return FeatureDraftConfig.model_validate_json(path.read_text())
    except OSError as exc:
        raise ModelSourceError(f"no feature draft at {directory}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise ModelSourceError(f"{path} is not a feature draft's config: {validation_message(exc)}") from None
    except ValueError as exc:
        raise ModelSourceError(f"{path} is not a feature draft's config: {one_line(exc)}") from None


def target_tensors(target_dir: str | Path, vocab_ids: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [V, H], LM head rows [V_trim, H]) read from the target's safetensors files, nothing
    else loaded; `vocab_ids` None keeps every row of the head."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    wanted = {"embed": ("model.embed_tokens.weight", "embed_tokens.weight"), "head": ("lm_head.weight",)}
    found: dict[str, torch.Tensor] = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for role, candidates in wanted.items():
                name = next((n for n in candidates if n in names), None)
                if role in found or name is None:
                    continue
                found[role] = f.get_tensor(name)
                if role == "head" and vocab_ids is not None:
                    found[role] = found[role][vocab_ids]
    if "embed" not in found:
        raise ModelSourceError(f"no embeddings in the target's files at {target_dir}")
    if "head" not in found:  # tied: the LM head is the embedding matrix
        found["head"] = found["embed"] if vocab_ids is None else found["embed"][vocab_ids]
    return found["embed"].to(dtype), found["head"].to(dtype)


def load_feature_draft(directory: str | Path, target_dir: str | Path, target_identity: str,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> FeatureDraft:
    """The draft at `directory` (or the shipped one it names) on the target at `target_dir`, whose
    identity must be the one it was trained on: its features mean nothing to another model."""
    from safetensors.torch import load_file

    directory = draft_dir(directory)
    config = read_config(directory)
    if config.target_identity != target_identity:
        raise IncompatibleModelsError(f"the feature draft at {directory} was trained on another target "
                                      f"({config.target_identity[:24]}), not {target_identity[:24]}")
    target = json.loads((Path(target_dir) / CONFIG_FILE).read_text())
    layers, width = target.get("num_hidden_layers"), target.get("hidden_size")
    if layers is not None and any(not 0 <= layer < layers for layer in config.layers):
        raise IncompatibleModelsError(f"the feature draft at {directory} reads layers {config.layers}; its target "
                                      f"has {layers}")
    if width is not None and config.layer_config.get("hidden_size") != width:
        raise IncompatibleModelsError(f"the feature draft at {directory} is {config.layer_config.get('hidden_size')} "
                                      f"wide; its target's states are {width}")
    try:  # a weights file missing (left out of a copy, a Git LFS pointer), cut short or of another shape
        weights = load_file(str(directory / WEIGHTS_FILE))
        vocab_ids = weights["vocab_ids"]
        embed, head = target_tensors(target_dir, vocab_ids, dtype)
        model = FeatureDraft(config, embed, head, vocab_ids)
        model.load_own_state({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()})
    except ModelSourceError:
        raise
    except Exception as exc:  # safetensors' own error class, KeyError, RuntimeError (sizes), OSError
        reason = f"no {exc.args[0]!r} tensor" if isinstance(exc, KeyError) else one_line(exc)
        raise ModelSourceError(f"cannot load the feature draft's weights at {directory / WEIGHTS_FILE}: "
                               f"{reason}") from None
    return model.to(device=device, dtype=dtype).eval()
