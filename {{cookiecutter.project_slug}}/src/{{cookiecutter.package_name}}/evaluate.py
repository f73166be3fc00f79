"""The evaluation recipe: rebuild model and data from a checkpoint, then test it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from . import run_lock
from .checkpoints import read_checkpoint
from .errors import ConfigError
from .loggers import instantiate_callbacks, instantiate_loggers
from .recipe_steps import (
    build_trainer,
    config_errors,
    exit_143_on_stop_signals,
    resolve_machine,
    scalars,
    write_metrics,
)
from .run_settings import check_run_settings
from .targets import check_targets

log = logging.getLogger(__name__)


def read_run_config(checkpoint: dict[str, Any], ckpt_path: Path) -> dict[str, Any]:
    """The data and model config that `train` stored in the checkpoint."""
    if "run_config" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={ckpt_path} has no run_config: it was not written by this project's "
            "train command, so eval cannot rebuild its model and data."
        )
    return dict(checkpoint["run_config"])


def evaluate(cfg: DictConfig) -> dict[str, float]:
    with run_lock.hold(Path(cfg.paths.output_dir)):
        return test_checkpoint(cfg)


def test_checkpoint(cfg: DictConfig) -> dict[str, float]:
    machine = resolve_machine(cfg)
    ckpt_path = Path(str(cfg.ckpt_path)).expanduser().resolve()
    trust = bool(cfg.get("trust_checkpoint"))
    stored = read_run_config(read_checkpoint(ckpt_path, trust=trust), ckpt_path)
    data_cfg = OmegaConf.merge(stored["data"], cfg.get("data") or {})
    model_cfg = OmegaConf.merge(stored["model"], cfg.get("model") or {})
    allowed = cfg.get("allowed_targets") or ()
    check_targets(cfg, allowed)
    check_run_settings(cfg)
    check_targets({"data": data_cfg, "model": model_cfg}, allowed, source=f"{ckpt_path}")
    with config_errors():
        datamodule = instantiate(data_cfg)
        model = instantiate(model_cfg)
        loggers = instantiate_loggers(cfg.get("logger"))
        callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
        trainer = build_trainer(cfg, machine, callbacks, loggers)
    log.info("Testing %s", ckpt_path)
    # Lightning asks for the training callbacks, to restore their state; testing needs none of it.
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    with exit_143_on_stop_signals():
        trainer.test(model, datamodule, ckpt_path=str(ckpt_path), weights_only=not trust)
    metrics = scalars(trainer.callback_metrics)
    write_metrics(metrics, cfg.paths.output_dir)
    return metrics
