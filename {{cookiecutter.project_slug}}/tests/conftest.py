from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig

from .helpers import ComposeFn, compose_config


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
