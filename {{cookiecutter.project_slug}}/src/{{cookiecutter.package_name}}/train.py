"""The training recipe: compose -> instantiate -> fit -> test the best checkpoint -> metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from .callbacks import ExactResume, RunConfigInCheckpoint
from .callbacks.preemption import STOPPED_BY_SIGNAL_EXIT_CODE, Preempted
from .checkpoints import (
    AtomicCheckpointIO,
    check_same_model,
    newest_valid_checkpoint,
    read_checkpoint,
)
from .errors import ConfigError, TrainingError
from .loggers import instantiate_callbacks, instantiate_loggers
from .runtime import (
    configure_matmul_precision,
    resolve_accelerator,
    resolve_precision,
    use_hydra_logging_only,
)
from .targets import check_targets

log = logging.getLogger(__name__)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}


@contextmanager
def config_errors() -> Iterator[None]:
    """Hydra's error for a class that cannot be found or built, as one line naming the key; our
    own errors raised while building pass through as they are."""
    try:
        yield
    except InstantiationException as error:
        if isinstance(error.__cause__, (ConfigError, TrainingError)):
            raise error.__cause__ from None
        message = str(error).replace(
            ", set env var HYDRA_FULL_ERROR=1 to see chained exception", ""
        )
        what, _, key = message.partition("\nfull_key: ")
        what = " ".join(what.split())
        raise ConfigError(
            f"{key or 'config'}: {what} Check that key's values and `_target_`."
        ) from error


def trainer_plugins() -> list[Any]:
    """Atomic checkpoint writes; under SLURM, Lightning's own requeue handler off (it saves in the
    middle of a step): callbacks.preemption saves and requeues at a step boundary instead."""
    plugins: list[Any] = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def build_trainer(cfg: DictConfig, callbacks: list[Any], loggers: list[Any]) -> L.Trainer:
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    precision = resolve_precision(str(cfg.trainer.precision), accelerator)
    configure_matmul_precision(cfg.get("matmul_precision"))
    use_hydra_logging_only()
    log.info("Accelerator %s, precision %s", accelerator, precision)
    return instantiate(
        cfg.trainer,
        accelerator=accelerator,
        precision=precision,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=trainer_plugins(),
    )


def log_batch_size(per_device: int | None, trainer: L.Trainer) -> None:
    if per_device is None or not trainer.is_global_zero:
        return
    devices, nodes = trainer.num_devices, trainer.num_nodes
    accumulation = trainer.accumulate_grad_batches
    log.info(
        "Batch size %d per device x %d devices x %d nodes x %d accumulated = %d global",
        per_device,
        devices,
        nodes,
        accumulation,
        per_device * devices * nodes * accumulation,
    )


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """What `eval` needs to rebuild the model and data from a checkpoint: plain values only."""
    return {
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
    }


def write_json(metrics: dict[str, float], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def write_metrics(metrics: dict[str, float], output_dir: str) -> None:
    write_json(metrics, Path(output_dir) / "metrics.json")
    summary = "  ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
    log.info("Metrics: %s", summary)
    log.info("Outputs in %s", output_dir)


def starting_checkpoint(cfg: DictConfig, model: L.LightningModule) -> tuple[str | None, bool]:
    """The newest valid checkpoint of this run directory, else `ckpt_path`, else none; and
    whether it loads with weights_only=True (only a trusted external checkpoint may not)."""
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    newest = newest_valid_checkpoint(ckpt_dir) if cfg.get("resume") else None
    if newest:
        log.info("Resuming from %s", newest)
        return str(newest), True
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        checkpoint = read_checkpoint(path, trust=bool(cfg.get("trust_checkpoint")))
        check_same_model(checkpoint, model, path)
        log.info("Starting from ckpt_path=%s", path)
        return str(path), not cfg.get("trust_checkpoint")
    log.info("Starting fresh: no checkpoint in %s", ckpt_dir)
    return None, True


def finished_metrics(cfg: DictConfig) -> dict[str, float] | None:
    path = Path(cfg.paths.output_dir) / "metrics.json"
    if not cfg.get("resume") or not path.is_file():
        return None
    log.info(
        "This run already finished (%s): not training again. Pick another run_name=..., or "
        "delete that directory, to train again.",
        path,
    )
    return {name: float(value) for name, value in json.loads(path.read_text()).items()}


def train(cfg: DictConfig) -> dict[str, float]:
    done = finished_metrics(cfg)
    if done is not None:
        return done
    check_targets(cfg, cfg.get("allowed_targets") or ())
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    with config_errors():
        datamodule = instantiate(cfg.data)
        model = instantiate(cfg.model)
        loggers = instantiate_loggers(cfg.get("logger"))
        callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
        callbacks += [RunConfigInCheckpoint(run_config(cfg)), ExactResume()]
        trainer = build_trainer(cfg, callbacks, loggers)
    log_batch_size(cfg.data.get("batch_size"), trainer)
    hyperparameters = OmegaConf.to_container(cfg, resolve=True)
    for logger in trainer.loggers:
        logger.log_hyperparams(hyperparameters)  # type: ignore[arg-type]

    ckpt_path, weights_only = starting_checkpoint(cfg, model)
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
    except Preempted as stop:
        log.warning("Stopped: %s", stop)
        raise SystemExit(STOPPED_BY_SIGNAL_EXIT_CODE) from None
    metrics = scalars(trainer.callback_metrics)

    if cfg.get("test"):
        checkpointing = trainer.checkpoint_callback
        best = checkpointing.best_model_path if isinstance(checkpointing, ModelCheckpoint) else ""
        log.info("Testing %s", best or "the weights in memory (no checkpoint was saved)")
        trainer.test(model, datamodule=datamodule, ckpt_path=best or None, weights_only=True)
        metrics.update(scalars(trainer.callback_metrics))

    metrics.update(getattr(datamodule, "baseline", {}))
    if trainer.world_size > 1:
        write_json(metrics, Path(cfg.paths.output_dir) / f"metrics-rank{trainer.global_rank}.json")
    if trainer.is_global_zero:
        write_metrics(metrics, cfg.paths.output_dir)
    return metrics
