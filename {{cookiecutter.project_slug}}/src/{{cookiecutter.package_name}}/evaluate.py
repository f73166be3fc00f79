"""The evaluation recipe: rebuild model and data from a checkpoint, then test it."""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .loggers import instantiate_callbacks, instantiate_loggers
from .train import build_trainer, scalars, write_metrics

log = logging.getLogger(__name__)


def read_run_config(ckpt_path: Path) -> dict[str, Any]:
    """The data and model config that `train` stored in the checkpoint."""
    if not ckpt_path.is_file():
        raise ConfigError(
            f"ckpt_path={ckpt_path} does not exist. Pass a checkpoint written by training, e.g. "
            "ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
        )
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ConfigError(
            f"ckpt_path={ckpt_path} cannot be read as a safe (weights_only) checkpoint: "
            f"{str(error).splitlines()[0]}. It may be truncated or written by other code."
        ) from error
    if "run_config" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={ckpt_path} has no run_config: it was not written by this project's "
            "train command, so eval cannot rebuild its model and data."
        )
    return dict(checkpoint["run_config"])


def evaluate(cfg: DictConfig) -> dict[str, float]:
    ckpt_path = Path(str(cfg.ckpt_path)).expanduser().resolve()
    stored = read_run_config(ckpt_path)
    data_cfg = OmegaConf.merge(stored["data"], cfg.get("data") or {})
    model_cfg = OmegaConf.merge(stored["model"], cfg.get("model") or {})
    datamodule = instantiate(data_cfg)
    model = instantiate(model_cfg)
    loggers = instantiate_loggers(cfg.get("logger"))
    callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
    trainer = build_trainer(cfg, callbacks, loggers)
    log.info("Testing %s", ckpt_path)
    # Lightning asks for the training callbacks, to restore their state; testing needs none of it.
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    trainer.test(model, datamodule=datamodule, ckpt_path=str(ckpt_path), weights_only=True)
    metrics = scalars(trainer.callback_metrics)
    write_metrics(metrics, cfg.paths.output_dir)
    return metrics
