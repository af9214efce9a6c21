"""The Ray Train checkpoint of both training jobs (the head's, train.py; the feature draft's,
draft.py): a state file and the metrics history, written by rank 0, read back on resume."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

STATE_FILE, HISTORY_FILE = "state.pt", "history.json"


def has_checkpoint(storage: str, run: str) -> bool:
    """Whether run `run` under `storage` reported a checkpoint (Ray Train's `checkpoint_*` folders):
    a run that failed before its first has nothing to resume, so its settings bind nothing."""
    return any(Path(storage).resolve().joinpath(run).glob("checkpoint_*"))


def resume(load_model, optimizer, model_key: str, progress_key: str) -> tuple[int, list[dict]]:
    """Load the run's latest checkpoint into the model (`load_model(state[model_key])`) and the
    optimizer; returns (its progress, state[progress_key], and the metrics history), (0, []) when
    the run is new."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return 0, []
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / STATE_FILE, weights_only=True)
        history = json.loads((Path(directory) / HISTORY_FILE).read_text())
    load_model(state[model_key])
    optimizer.load_state_dict(state["optimizer"])
    return state[progress_key], history


def report(metrics: dict, state: dict, history: list[dict], rank: int, files: dict[str, str] | None = None) -> None:
    """Report `metrics`; rank 0 with a checkpoint of `state`, the history and any further `files`
    ({name: text})."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        torch.save(state, Path(directory) / STATE_FILE)
        (Path(directory) / HISTORY_FILE).write_text(json.dumps(history, indent=2) + "\n")
        for name, text in (files or {}).items():
            (Path(directory) / name).write_text(text)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def read_final(result, run: str, files: tuple[str, ...] = ()) -> tuple[dict, list[dict], dict[str, str]]:
    """(state, history, {name: text} of `files`) of a finished run's last checkpoint (Ray Train's Result)."""
    from specdec.errors import SpecDecError

    if result.checkpoint is None:
        raise SpecDecError(f"training run {run!r} produced no checkpoint")
    with result.checkpoint.as_directory() as directory:
        return (torch.load(Path(directory) / STATE_FILE, weights_only=True),
                json.loads((Path(directory) / HISTORY_FILE).read_text()),
                {name: (Path(directory) / name).read_text() for name in files})
