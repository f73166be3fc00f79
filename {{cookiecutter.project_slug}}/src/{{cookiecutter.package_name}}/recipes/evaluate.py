"""The evaluation recipe: rebuild model and data from a checkpoint, then test it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from omegaconf import DictConfig

from ..checkpointing.trained import rebuild
from ..loggers import instantiate_callbacks, instantiate_loggers
from ..run import lock as run_lock
from ..run.checks import check_config
from ..run.steps import (
    Machine,
    build_trainer,
    exit_143_on_stop_signals,
    scalars,
    write_metrics,
)

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    machine = check_config(cfg)
    with run_lock.hold(Path(cfg.paths.output_dir)):
        return test_checkpoint(cfg, machine)


def test_checkpoint(cfg: DictConfig, machine: Machine) -> dict[str, float]:
    sharded = Path(str(cfg.ckpt_path)).expanduser().is_dir()  # read whole into memory here
    trained = rebuild(cfg, load_weights=sharded)
    model, datamodule, ckpt_path = trained.model, trained.datamodule, trained.path
    loggers = instantiate_loggers(cfg.get("logger"))
    callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
    trainer = build_trainer(cfg, machine, callbacks, loggers)
    log.info("Testing %s", ckpt_path)
    # Lightning asks for the training callbacks, to restore their state; testing needs none of it.
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    with exit_143_on_stop_signals():
        trust = bool(cfg.get("trust_checkpoint"))
        tested = None if sharded else str(ckpt_path)
        trainer.test(model, datamodule, ckpt_path=tested, weights_only=not trust)
    metrics = scalars(trainer.callback_metrics)
    write_metrics(metrics, cfg.paths.output_dir)
    return metrics


if __name__ == "__main__":  # `python -m <package>.recipes.evaluate` runs `<package>-eval`
    from .. import cli

    cli.evaluate()
