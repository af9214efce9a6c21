"""What both training jobs (the head's, train.py; the feature draft's, draft.py) share: the Ray
Train checkpoint (a state file and the metrics history, written by rank 0, read back on resume), the
run settings a resume must keep, and Ray itself, started once their checks passed."""

from __future__ import annotations

import json
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel

from specdec.errors import one_line
from specdec.files import held, write_atomically
from specdec.training.config import ConfigError

STATE_FILE, HISTORY_FILE = "state.pt", "history.json"
# Ray Train's record of a run's checkpoints, in the run's folder: what a rerun resumes from
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"


def recorded_checkpoint(storage: str, run: str) -> Path | None:
    """The folder of the checkpoint Ray Train resumes run `run` under `storage` from (the latest its
    snapshot records), None where it records none. Not the newest `checkpoint_*` folder: a worker
    copies a checkpoint into its folder, then the controller (polling every 2 s) records it, so a run
    killed mid-copy or before the poll leaves a folder Ray Train never resumes from, which was
    counted as trained (a rerun refused as past train.epochs, or its settings bound by a run that
    had nothing to resume)."""
    directory = Path(storage).resolve() / run
    if not (directory / SNAPSHOT_FILE).is_file():
        return None
    from ray.train import Result

    try:
        checkpoint = Result.from_path(directory).checkpoint
    except Exception as exc:  # (a snapshot of another Ray version, or cut short): Ray Train's fit() would fail on it
        raise ConfigError(f"run {run!r} in {storage}: Ray Train cannot resume it ({one_line(exc)}); "
                          "start a new run under another name") from None
    return Path(checkpoint.path) if checkpoint else None


def has_checkpoint(storage: str, run: str) -> bool:
    """Whether Ray Train recorded a checkpoint of run `run` under `storage`: a run that failed before
    its first has nothing to resume, so its settings bind nothing."""
    return recorded_checkpoint(storage, run) is not None


def connect_ray(connect: Callable[[], None] | None) -> None:
    """Ray for a job whose checks passed: `connect` (the CLI's: `--address`, else a private local
    instance), else `ray.init()`; nothing where Ray is up."""
    import ray

    if not ray.is_initialized():
        (connect or ray.init)()


def fit(trainer):
    """`trainer.fit()` (its Result), where Ctrl-C raises KeyboardInterrupt. Ray Train's SIGINT handler,
    set inside fit(), aborts the run (the workers stop; a rerun resumes from the last checkpoint Ray
    Train recorded) and then exits from within fit(): a SystemExit (code 1 whatever it asked), the
    only one fit() raises (a failed run raises TrainingFailedError). That handler outlives fit(),
    where it would swallow Ctrl-C (it aborts a run that ended): the one before is put back."""
    before = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    except SystemExit:
        raise KeyboardInterrupt from None
    finally:
        if signal.getsignal(signal.SIGINT) is not before:  # (only on the main thread: Ray Train sets it there alone)
            signal.signal(signal.SIGINT, before)


@contextmanager
def runs_held(storage: str, names: Iterable[str], section: str) -> Iterator[None]:
    """Runs `names` under `storage` held by this process for the block (`<storage>/<name>.lock`): a
    second training of one of them at once, whose checkpoints and settings would land among this
    one's, is refused in one line (ConfigError)."""
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(held(Path(storage).resolve() / f"{name}.lock", ConfigError,
                                     f"run {name!r} in {storage} is being trained", f"choose another {section}.name"))
        yield


def check_run_settings(storage: str, name: str, section: str, settings: BaseModel, resumable: tuple[str, ...],
                       data: dict) -> None:
    """A run name resumes only the run it started: refuse (ConfigError) other settings of its config
    section (`section`: `train` or `draft`, but the `resumable` ones) or other data under it, then
    record these. A run without a checkpoint binds nothing (it failed before its first)."""
    path = Path(storage).resolve() / f"{name}.settings.json"
    wanted = {section: settings.model_dump(exclude=set(resumable)), "data": data}
    if path.is_file() and has_checkpoint(storage, name):
        found = json.loads(path.read_text())
        # a setting added after the run started reads as its default there; head runs before
        # 2026-12-05 recorded their section alone, and no data
        fields = type(settings).model_fields
        was = {k: fields[k].default for k in wanted[section]} | found.get(section, found)
        changed = sorted(k for k in wanted[section] if was[k] != wanted[section][k])
        if found.get("data", data) != data:
            changed.append("data")
        if changed:
            raise ConfigError(f"run {name!r} in {storage} was started with other settings ({', '.join(changed)}); "
                              f"choose another {section}.name to start a new run")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(wanted, indent=2) + "\n")


def latest_history(storage: str, run: str) -> list[dict]:
    """The metrics history of the checkpoint Ray Train resumes run `run` under `storage` from
    (recorded_checkpoint; [] without one)."""
    checkpoint = recorded_checkpoint(storage, run)
    return json.loads((checkpoint / HISTORY_FILE).read_text()) if checkpoint else []


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
