from __future__ import annotations

from pathlib import Path

import pytest

from tiny import save_tiny_pair  # tests/ is on the path (pyproject.toml, [tool.pytest.ini_options] pythonpath)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests on the real default model pair")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="real model pair: needs --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run single-threaded ~10x faster on a busy 2-core machine (no spin-waiting); the
    module's tests on one torch thread (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of tiny random Qwen2 models with a byte tokenizer."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_pair):
    from specdec.builder import EngineConfig, build_engine

    draft, target = tiny_pair
    return build_engine(EngineConfig(draft=str(draft), target=str(target)), progress=False)
