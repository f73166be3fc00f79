"""The training recipe, `<package>-train`: compose -> check -> resolve the machine -> build ->
start point -> fit -> test the best checkpoint -> record the metrics (`train`)."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from ..callbacks import ExactResume, MonitoredMetricLogged, RunConfigInCheckpoint
from ..callbacks.exact_resume import fit_state
from ..callbacks.monitored_metric import MetricNotLogged, not_logged
from ..callbacks.preemption import Preemption, stop
from ..checkpointing.door import read_fit_state
from ..checkpointing.saving import finish_checkpoint_writes
from ..errors import PACKAGE, ConfigError, TrainingError, raised_by_a_spawned_process
from ..loggers import finished_at_the_end, instantiate_callbacks, instantiate_loggers
from ..memory.advice import (
    OutOfMemoryRun,
    out_of_memory_advice,
    out_of_memory_device,
    ran_out_of_memory,
)
from ..memory.plan import fit_warning, plan_memory
from ..run import lock as run_lock
from ..run import stop_signals
from ..run.checks import check_built, check_config, interval_too_long
from ..run.identity import check_run_identity, finished_metrics
from ..run.machine import use_hydra_logging_only
from ..run.plan import RunPlan
from ..run.start import Start, start_from_weights, starting_checkpoint
from ..run.steps import (
    build_model_and_data,
    build_trainer,
    exit_143_on_stop_signals,
    leave_process_group,
    scalars,
    write_json,
    write_metrics,
)

log = logging.getLogger(__name__)


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


@contextmanager
def fit_setting_errors(cfg: DictConfig) -> Iterator[None]:
    """What Lightning finds only once it counts the training batches, as one line; under
    `strategy=ddp_spawn` the processes' errors arrive as their tracebacks' text."""
    try:
        yield
    except Exception as error:
        ours = raised_by_a_spawned_process(error)
        if ours is not None:
            raise ours from error
        spawned = type(error).__name__ == "ProcessRaisedException"  # its text ends as the child's
        if (isinstance(error, ValueError) or spawned) and "`val_check_interval`" in str(error):
            raise interval_too_long(cfg.trainer.get("val_check_interval")) from error
        lightnings = isinstance(error, (RuntimeError, MisconfigurationException)) or spawned
        pattern = r"any of the following: (.*)$|returned metrics: \[(.*?)\]"
        logged = re.search(pattern, str(error)) if lightnings else None
        if logged is None:
            raise
        names = re.findall(r"[`']([^`']+)[`']", logged.group(1) or logged.group(2))
        raise not_logged(str(OmegaConf.select(cfg, "monitor.metric")), names) from error


def check_trained_something(trainer: L.Trainer, cfg: DictConfig) -> None:
    if trainer.num_training_batches == 0:
        raise ConfigError(
            f"the training data gives no batch of data.batch_size={cfg.data.get('batch_size')} "
            "(a batch that is not full is dropped): lower data.batch_size, or give more data."
        )


def log_memory_plan(cfg: DictConfig, plan: RunPlan, trainer: L.Trainer) -> None:
    if not trainer.is_global_zero:
        return
    try:
        estimate = plan_memory(
            cfg.model, int(cfg.data.batch_size), plan.machine.precision,
            trainer.num_devices * trainer.num_nodes, plan.strategy.shards,
        )  # fmt: skip
    except Exception as error:  # an estimate never stops a run; the reason is logged
        log.info("No memory estimate: %s", str(error).splitlines()[0] if str(error) else error)
        return
    log.info("Memory estimate: %s", estimate.summary())
    warning = fit_warning(estimate, plan.machine.accelerator)
    if warning:
        log.warning("Memory: %s", warning)


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """What `eval` needs to rebuild the model and data from a checkpoint: plain values only."""
    return {
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
    }


def validate_before_fine_tuning(
    cfg: DictConfig, trainer: L.Trainer, model: L.LightningModule, datamodule: Any
) -> dict[str, float]:
    """The starting weights' validation metrics (`init/...`), for a run with `init_from`. A resumed
    run measures them again: the adapters start where the base is, so the values are the same."""
    if not cfg.get("init_from"):
        return {}
    measured = trainer.validate(model, datamodule, verbose=False)
    return {
        f"init/{name}": float(value) for name, value in (measured[0] if measured else {}).items()
    }


def best_checkpoint(trainer: L.Trainer) -> str:
    checkpointing = trainer.checkpoint_callback
    return checkpointing.best_model_path if isinstance(checkpointing, ModelCheckpoint) else ""


def save_finished_fit(trainer: L.Trainer, progress: ExactResume, cfg: DictConfig) -> str | None:
    """`last.ckpt` as `fit` left the run, marked finished with its best checkpoint, so that a run
    stopped from here on only tests again. (Saves nothing under fast_dev_run, as Lightning.)"""
    if trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by Lightning, not declared
        return None
    path = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    progress.fit_finished, progress.best_model_path = True, best_checkpoint(trainer)
    trainer.save_checkpoint(path, weights_only=False)
    finish_checkpoint_writes(trainer.strategy)
    return str(path)


@contextmanager
def bad_data_leaves_no_logs(
    trainer: L.Trainer, output_dir: Path, found: set[Path]
) -> Iterator[None]:
    """Data that the data module refuses while it sets up (a file that does not decode, a shard
    that fails its checksum) is bad input like any other: what the loggers started in the run
    folder goes, so that the folder, holding only what was there before, can go too. So does
    what a new run trained before its monitored metric turned out not to be logged."""
    try:
        yield
    except ConfigError as error:
        checkpoints = output_dir / "checkpoints"
        discard = isinstance(error, MetricNotLogged) and checkpoints not in found
        if (trainer.global_step == 0 or discard) and output_dir.is_dir():
            for logger in trainer.loggers:  # a tracker's run writes its last files as it ends
                finish = getattr(getattr(logger, "_experiment", None), "finish", None)
                if callable(finish):
                    finish(exit_code=1)
            for path in set(output_dir.iterdir()) - found:
                if path.is_dir() and (path != checkpoints or discard):
                    shutil.rmtree(path, ignore_errors=True)
        raise


def train(cfg: DictConfig) -> dict[str, float]:
    """compose (Hydra, in cli) -> check -> resolve the machine -> build -> start point -> fit ->
    test -> record; the same command finishes a run killed anywhere in between."""
    plan = check_config(cfg)
    with run_lock.hold(plan.run_dir):
        check_run_identity(plan.start)
        done = finished_metrics(plan.start)
        if done is not None:
            return done
        with exit_143_on_stop_signals(), out_of_memory_is_one_line(cfg, plan):
            metrics = fit_and_test(cfg, plan)
        leave_process_group()
        return metrics


def fit_and_test(cfg: DictConfig, plan: RunPlan) -> dict[str, float]:
    use_hydra_logging_only()
    if plan.seed is not None:
        L.seed_everything(plan.seed, workers=True)
    model, datamodule = build_model_and_data(cfg.model, cfg.data)
    check_built(cfg, plan, model, datamodule)
    start = starting_checkpoint(plan.start, model)
    start_from_weights(plan.start, model, start)
    run = start_run(cfg, plan)
    with finished_at_the_end(run.trainer.loggers):  # each job its own tracker run
        fitted = fit(cfg, run, model, datamodule, start)
        metrics = test(cfg, run.trainer, model, datamodule, fitted)
        record(cfg, run.trainer, metrics, datamodule)
    return metrics


@contextmanager
def out_of_memory_is_one_line(cfg: DictConfig, plan: RunPlan) -> Iterator[None]:
    """An out-of-memory error ends the run with one line of advice for this run."""
    try:
        yield
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not ran_out_of_memory(error):
            raise
        net = cfg.model.get("net") or {}
        run = OutOfMemoryRun(
            batch_size=cfg.data.get("batch_size"),
            accumulate_grad_batches=int(cfg.trainer.get("accumulate_grad_batches") or 1),
            activation_checkpointing=(
                bool(net.get("activation_checkpointing"))
                if "activation_checkpointing" in net
                else None
            ),
            strategy_shards=plan.strategy.shards,
            model_shards_itself=plan.model_shards_itself,
        )
        advice = out_of_memory_advice(run, out_of_memory_device(error), str(plan.run_dir), PACKAGE)
        raise TrainingError(advice) from error


@dataclass
class Started:
    """A run's trainer with its loggers and callbacks, and what its folder held before."""

    trainer: L.Trainer
    progress: ExactResume
    found: set[Path]


def start_run(cfg: DictConfig, plan: RunPlan) -> Started:
    """Loggers, callbacks and the trainer; the loggers get the run's hyperparameters."""
    output_dir = plan.run_dir
    found = set(output_dir.iterdir()) if output_dir.is_dir() else set()
    progress = ExactResume()
    loggers = instantiate_loggers(cfg.get("logger"), plan.tracked)
    callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
    monitored = OmegaConf.select(cfg, "monitor.metric", default=None)
    callbacks += [RunConfigInCheckpoint(run_config(cfg)), progress]
    callbacks += [MonitoredMetricLogged(str(monitored) if monitored else None)]
    trainer = build_trainer(cfg.trainer, plan.machine, plan.matmul_precision, callbacks, loggers)
    log_batch_size(cfg.data.get("batch_size"), trainer)
    log_memory_plan(cfg, plan, trainer)
    hyperparameters = OmegaConf.to_container(cfg, resolve=True)
    for logger in trainer.loggers:
        logger.log_hyperparams(hyperparameters)  # type: ignore[arg-type]
    return Started(trainer, progress, found)


@dataclass
class Fitted:
    metrics: dict[str, float]
    best: str  # the best checkpoint, or ""
    saved: str | None  # last.ckpt as fit left it


def fit(
    cfg: DictConfig, run: Started, model: L.LightningModule, datamodule: Any, start: Start
) -> Fitted:
    """Fit from the start point, or only measure the starting weights again where fit had
    finished; a stop signal received during fit ends the run here (exit code 143)."""
    trainer, progress = run.trainer, run.progress
    finished = fit_state(read_fit_state(Path(start.path))) if start.resumed and start.path else {}
    if finished.get("fit_finished") and not cfg.get("extend"):
        log.info("Training had finished (%s): testing only.", start.path)
        metrics, best, saved = dict(finished["metrics"]), finished["best_model_path"], start.path
        metrics.update(validate_before_fine_tuning(cfg, trainer, model, datamodule))
        return Fitted(metrics, best, saved)
    progress.restores_progress = start.resumed
    progress.restores_stop = not finished.get("fit_finished")
    output_dir = Path(cfg.paths.output_dir)
    with bad_data_leaves_no_logs(trainer, output_dir, run.found), fit_setting_errors(cfg):
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, Preemption):
                callback.answer_warnings_in_start_up()
        before = validate_before_fine_tuning(cfg, trainer, model, datamodule)
        trainer.fit(model, datamodule, ckpt_path=start.path, weights_only=start.weights_only)
        stop_signals.rearm()
        check_trained_something(trainer, cfg)
    metrics, best = scalars(trainer.callback_metrics), best_checkpoint(trainer)
    metrics.update(before)
    if before and trainer.is_global_zero:
        log.info(
            "Validation loss %.4f before fine-tuning, %.4f after",
            before["init/val/loss"], metrics.get("val/loss", float("nan")),
        )  # fmt: skip
    saved = save_finished_fit(trainer, progress, cfg)
    if saved and trainer.is_global_zero:
        log.info("Last checkpoint: %s", saved)
    if stop_signals.received():
        raise stop(trainer, "after training", Path(saved) if saved else None)
    return Fitted(metrics, best, saved)


def test(
    cfg: DictConfig, trainer: L.Trainer, model: L.LightningModule, datamodule: Any, fitted: Fitted
) -> dict[str, float]:
    """The fit's metrics, with the test metrics of its best checkpoint where `test` is on."""
    metrics = dict(fitted.metrics)
    if cfg.get("test"):
        tested = fitted.best or fitted.saved
        log.info("Testing %s", tested or "the weights in memory (no checkpoint was saved)")
        trainer.test(model, datamodule=datamodule, ckpt_path=tested or None, weights_only=True)
        metrics.update(scalars(trainer.callback_metrics))
    return metrics


def record(cfg: DictConfig, trainer: L.Trainer, metrics: dict[str, float], datamodule: Any) -> None:
    """`metrics.json` (one per rank under DDP, and the run's on rank 0)."""
    metrics.update(getattr(datamodule, "baseline", {}))
    if trainer.world_size > 1:
        write_json(metrics, Path(cfg.paths.output_dir) / f"metrics-rank{trainer.global_rank}.json")
    if trainer.is_global_zero:
        write_metrics(metrics, cfg.paths.output_dir)


if __name__ == "__main__":  # `python -m <package>.recipes.train` runs `<package>-train`
    from .. import cli

    cli.train()
