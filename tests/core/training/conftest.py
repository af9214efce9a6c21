"""Fixtures for the training pipeline tests: one private local Ray instance, a tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.training.stdlib_prompts import Prompt

TINY_PROMPTS = [Prompt(f"tiny:{i}", f"Write a function number {i} that adds {i}.", "validation" if i < 2 else "train")
                for i in range(7)]


def record_checkpoint(run: Path, name: str, history: list[dict]) -> Path:
    """A checkpoint folder `name` of run folder `run` holding `history`, recorded as Ray Train's
    controller records one (its snapshot, in Ray 2.60's format): a rerun resumes from it."""
    import ray

    folder = run / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "history.json").write_text(json.dumps(history))
    result = {"version": 0, "checkpoint_dir_name": name, "metrics": history[-1] if history else {}}
    snapshot = {"ray_version": ray.__version__, "checkpoint_results": [result], "checkpoint_report_indices": [0],
                "latest_checkpoint_result": result, "pending_training_results": [], "pending_validation_specs": [],
                "current_report_index": 1, "validated_checkpoint_dir_names": [],
                "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    return folder


def start_local_ray():
    """A private local Ray instance (never the shared cluster, never `ray stop`)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


@pytest.fixture(scope="module")
def ray_local():
    yield start_local_ray()


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind():
    """Later test modules start Ray their own way (ray.init twice fails): shut down what ran here."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def tiny_config(tiny_pair, tmp_path, **train) -> dict:
    draft, target = tiny_pair
    return {
        "models": {"draft": str(draft), "target": str(target)},
        "data": {"dir": str(tmp_path / "data"), "shard_size": 3, "seed": 1,
                 "response": {"temperature": 1.0, "max_new_tokens": 12, "policy": "fixed", "k": 3},
                 "labels": {"temperatures": [0.0, 1.0], "draws": 2}},
        "scaling": {"num_workers": 2, "threads": 1},
        "train": {"storage": str(tmp_path / "runs"), "output": str(tmp_path / "head"), "depth": 1,
                  "epochs": 1, "batch_size": 16, "lr": 1e-2, **train},
    }


@pytest.fixture(scope="session")
def tiny_dataset(tiny_pair, tmp_path_factory):
    """(raw config dict, manifest) of a dataset generated once on the tiny pair by two Ray workers."""
    from specdec.training.config import parse_config
    from specdec.training.data import generate_dataset

    raw = tiny_config(tiny_pair, tmp_path_factory.mktemp("pipeline"))
    start_local_ray()  # left running for the requesting module; no_ray_left_behind stops it
    return raw, generate_dataset(parse_config(raw), prompts=TINY_PROMPTS, progress=False)
