"""The Ray Train checkpoint of both training jobs (the head's, train.py; the feature draft's,
draft.py): a state file and the metrics history, written by rank 0, read back on resume."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

STATE_FILE, HISTORY_FILE = "state.pt", "history.json"


def restored() -> tuple[dict | None, list[dict]]:
    """(state, history) of the run's latest checkpoint; (None, []) when the run is new."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return None, []
    with checkpoint.as_directory() as directory:
        return (torch.load(Path(directory) / STATE_FILE, weights_only=True),
                json.loads((Path(directory) / HISTORY_FILE).read_text()))


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
