from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from .helpers import ComposeFn, compose_config
from .killing import References, run


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers share the cores: each worker, and every run it starts, gets
    its share of torch threads instead of all of them (on two cores this cut the suite's wall time
    by a sixth and its CPU time by a quarter)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture
def train_config(tmp_path: Path) -> ComposeFn:
    """Compose `train` for a quick CPU run: no config print, CSV logs only."""

    def make(*overrides: str) -> DictConfig:
        defaults = ["trainer=cpu", "logger=csv", "extras.print_config=false"]
        return compose_config("train", [*defaults, *overrides], tmp_path)

    return make


@pytest.fixture
def eval_config(tmp_path: Path) -> ComposeFn:
    def make(*overrides: str) -> DictConfig:
        defaults = ["trainer=cpu", "logger=none", "extras.print_config=false"]
        return compose_config("eval", [*defaults, *overrides], tmp_path / "eval")

    return make


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The uninterrupted run of a train command (tests/killing.py), trained once per module."""
    runs: dict[str, Path] = {}

    def reference(args: list[str]) -> Path:
        key = " ".join(args)
        if key not in runs:
            cwd = tmp_path_factory.mktemp("reference")
            code, output = run(args, cwd)
            assert code == 0, output[-3000:]
            runs[key] = cwd
        return runs[key]

    return reference
