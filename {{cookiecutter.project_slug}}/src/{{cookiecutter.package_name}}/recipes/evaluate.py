"""The evaluation recipe: rebuild model and data from a checkpoint, then test it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..checkpointing.trained import rebuild
from ..loggers import (
    finished_at_the_end,
    instantiate_callbacks,
    instantiate_loggers,
    log_run_config,
)
from ..run import lock as run_lock
from ..run.checks import check_config
from ..run.plan import RunPlan
from ..run.steps import (
    build_trainer,
    exit_143_on_stop_signals,
    scalars,
    write_metrics,
)

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    plan = check_config(cfg)
    with run_lock.hold(plan.run_dir):
        return test_checkpoint(cfg, plan)


def test_checkpoint(cfg: DictConfig, plan: RunPlan) -> dict[str, float]:
    sharded = Path(str(cfg.ckpt_path)).expanduser().is_dir()  # read whole into memory here
    trained = rebuild(cfg.ckpt_path, cfg.trust_checkpoint, cfg.data, cfg.model, sharded)
    model, datamodule, ckpt_path = trained.model, trained.datamodule, trained.path
    loggers = instantiate_loggers(cfg.get("logger"), plan.tracked, trained_from=str(ckpt_path))
    callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
    trainer = build_trainer(cfg.trainer, plan.machine, plan.matmul_precision, callbacks, loggers)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    log_run_config(loggers, resolved, trained_from=str(ckpt_path))
    log.info("Testing %s", ckpt_path)
    # Lightning asks for the training callbacks, to restore their state; testing needs none of it.
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    with exit_143_on_stop_signals(), finished_at_the_end(loggers):
        trust = bool(cfg.get("trust_checkpoint"))
        tested = None if sharded else str(ckpt_path)
        trainer.test(model, datamodule, ckpt_path=tested, weights_only=not trust)
    metrics = scalars(trainer.callback_metrics)
    write_metrics(metrics, cfg.paths.output_dir)
    return metrics


if __name__ == "__main__":  # `python -m <package>.recipes.evaluate` runs `<package>-eval`
    from .. import cli

    cli.evaluate()
