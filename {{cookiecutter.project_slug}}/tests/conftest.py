from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from . import warm_start
from .helpers import PROJECT_ROOT, ComposeFn, compose_config
from .killing import References, run


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers share the cores: each worker, and every run it starts, gets
    its share of torch threads instead of all of them (on two cores this cut the suite's wall time
    by a sixth and its CPU time by a quarter). Each process that runs tests starts its server of
    commands forked with torch and Hydra imported (tests/warm_start.py) while it collects."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if "PYTEST_XDIST_WORKER" in os.environ or not getattr(config.option, "numprocesses", None):
        warm_start.prepare()  # where tests run (not in xdist's controller)


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """What a test's run in this process sets in the environment goes with the test: Lightning
    sets LOCAL_RANK, WORLD_SIZE and MASTER_PORT for DDP, and a later test's command run with
    LOCAL_RANK inherited takes itself for a process of a launcher and waits for ranks that never
    come (a 600 s hang in CI)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


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


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A single-node SLURM cluster (scripts/local_slurm.py) for the tests of one worker, and the
    environment that reaches it; skipped, with the script's reason, where it cannot start."""
    folder = tmp_path_factory.mktemp("slurm")
    script = [sys.executable, str(PROJECT_ROOT / "scripts" / "local_slurm.py")]
    started = subprocess.run([*script, "start", str(folder)], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.skip(f"no local SLURM cluster: {started.stderr.strip()}")
    bin_dir = str(Path(sys.executable).parent)
    yield {
        **os.environ,
        "SLURM_CONF": str(folder / "slurm.conf"),
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([*script, "stop", str(folder)], capture_output=True, check=False)
