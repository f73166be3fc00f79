"""Helpers shared by the tests: composing configs as the command line would, reading results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

PACKAGE = "{{ cookiecutter.package_name }}"
CONFIG_MODULE = f"{PACKAGE}.configs"
PROJECT_ROOT = Path(__file__).parents[1]
CONFIG_DIR = PROJECT_ROOT / "src" / PACKAGE / "configs"

ComposeFn = Callable[..., DictConfig]


def compose_config(config_name: str, overrides: list[str], run_dir: Path) -> DictConfig:
    """The config a command line would compose, with its run directory under `run_dir`."""
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.root_dir = str(run_dir)
        cfg.paths.output_dir = str(run_dir / "run")
        del cfg.hydra
    return cfg


def read_metrics(cfg: DictConfig) -> dict[str, float]:
    return json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())


def checkpoints(cfg: DictConfig) -> list[Path]:
    return sorted((Path(cfg.paths.output_dir) / "checkpoints").glob("*.ckpt"))


def assert_checkpoints_load_safely(cfg: DictConfig) -> None:
    """Every checkpoint the run wrote loads with weights_only=True and carries its run config."""
    written = checkpoints(cfg)
    assert written, "the run wrote no checkpoint"
    for path in written:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        assert set(checkpoint["run_config"]) == {"data", "model"}


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`python <args>`; its standard input is `input`, or nothing."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        input="" if input is None else input,
    )
