"""The training recipe: compose -> instantiate -> fit -> test the best checkpoint -> metrics."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from . import run_lock, stop_signals
from .callbacks import ExactResume, MonitoredMetricLogged, RunConfigInCheckpoint
from .callbacks.exact_resume import fit_state
from .callbacks.monitored_metric import MetricNotLogged, not_logged
from .callbacks.preemption import stop
from .checkpointing.door import UNREADABLE, is_sharded, read_checkpoint, read_fit_state
from .checkpoints import check_same_model, finish_checkpoint_writes, newest_valid_checkpoint
from .data.base import SplitDataModule
from .errors import ConfigError, TrainingError, raised_by_a_spawned_process
from .loggers import instantiate_callbacks, instantiate_loggers
from .memory_advice import out_of_memory_advice, out_of_memory_device, ran_out_of_memory
from .memory_plan import fit_warning, plan_for_run, shards_itself
from .recipe_steps import (
    build_model_and_data,
    build_trainer,
    exit_143_on_stop_signals,
    leave_process_group,
    resolve_machine,
    scalars,
    write_json,
    write_metrics,
)
from .run_names import identifying
from .run_settings import check_run_settings, is_model_parallel
from .runtime import check_fp8, is_global_zero, use_hydra_logging_only
from .targets import allow
from .trained import load_init_weights

log = logging.getLogger(__name__)

STOPPING_KEYS = ("trainer.max_epochs", "trainer.max_steps", "trainer.max_time")


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


def check_strategy_fits(cfg: DictConfig, model: L.LightningModule) -> None:
    if is_model_parallel(cfg.trainer.get("strategy")) and not shards_itself(type(model)):
        raise ConfigError(
            f"strategy=model_parallel needs a LightningModule that applies FSDP2 itself in "
            f"configure_model(); {type(model).__name__} has none. Use strategy=ddp, or "
            "strategy=fsdp on GPUs."
        )


def check_vocabulary(datamodule: L.LightningDataModule, net: Any) -> None:
    """A model that has no embedding for some of the data's tokens fails on the first one."""
    data_tokens = getattr(datamodule, "vocab_size", None)
    model_tokens = getattr(net, "vocab_size", None)
    if not isinstance(data_tokens, int) or not isinstance(model_tokens, int):
        return
    if model_tokens < data_tokens:
        raise ConfigError(
            f"model.net.vocab_size={model_tokens} is smaller than the data's vocabulary "
            f"({data_tokens} tokens): set it to {data_tokens} or more."
        )


def check_images(datamodule: L.LightningDataModule, net: Any) -> None:
    """The network takes the data's images: as many channels, and big enough for its poolings."""
    size, smallest = getattr(datamodule, "image_size", None), getattr(net, "min_image_size", None)
    if isinstance(size, int) and isinstance(smallest, int) and size < smallest:
        raise ConfigError(
            f"data.image_size={size} is smaller than the {smallest} pixels that the network's "
            f"poolings halve to one: use {smallest} or more, or fewer model.net.channels."
        )
    given, taken = getattr(datamodule, "channels", None), getattr(net, "in_channels", None)
    if isinstance(given, int) and isinstance(taken, int) and given != taken:
        raise ConfigError(
            f"model.net.in_channels={taken}, but the data's images have {given} channel(s): "
            f"set model.net.in_channels={given}."
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


def interval_too_long(interval: Any) -> ConfigError:
    return ConfigError(
        f"trainer.val_check_interval={interval} is more than the training batches of an epoch: "
        "lower it, or set trainer.check_val_every_n_epoch=null to count batches across epochs."
    )


def check_validation_interval(cfg: DictConfig, datamodule: Any) -> None:
    """A validation interval longer than an epoch, refused before a logger starts a run and
    prints (Lightning refuses it once they have), where the data is loaded by then. The count of
    one process bounds each one's under DDP; the cases in between are left to Lightning."""
    interval, limit = cfg.trainer.get("val_check_interval"), cfg.trainer.get("limit_train_batches")
    if not isinstance(interval, int) or isinstance(interval, bool):
        return
    if cfg.trainer.get("check_val_every_n_epoch") is None:
        return
    try:
        batches = len(datamodule.train_dataloader())
    except TypeError:  # an iterable data set has no length
        return
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    if interval > batches:
        raise interval_too_long(interval)


def check_trained_something(trainer: L.Trainer, cfg: DictConfig) -> None:
    if trainer.num_training_batches == 0:
        raise ConfigError(
            f"the training data gives no batch of data.batch_size={cfg.data.get('batch_size')} "
            "(a batch that is not full is dropped): lower data.batch_size, or give more data."
        )


def log_memory_plan(cfg: DictConfig, precision: str, accelerator: str, trainer: L.Trainer) -> None:
    if not trainer.is_global_zero:
        return
    try:
        plan = plan_for_run(cfg, precision, trainer.num_devices)
    except Exception as error:  # an estimate never stops a run; the reason is logged
        log.info("No memory estimate: %s", str(error).splitlines()[0] if str(error) else error)
        return
    log.info("Memory estimate: %s", plan.summary())
    warning = fit_warning(plan, accelerator)
    if warning:
        log.warning("Memory: %s", warning)


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """What `eval` needs to rebuild the model and data from a checkpoint: plain values only."""
    return {
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
    }


@dataclass
class Start:
    """The checkpoint a run starts from; `resumed` when it is this run directory's own."""

    path: str | None = None
    weights_only: bool = True
    resumed: bool = False


def starting_checkpoint(cfg: DictConfig, model: L.LightningModule) -> Start:
    """The newest valid checkpoint of this run directory, else `ckpt_path`, else none; only a
    trusted external checkpoint may load without weights_only=True."""
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    max_steps = int(cfg.trainer.get("max_steps") or -1)

    def ends_unfinished(state: dict[str, Any]) -> str | None:
        at_end = 0 < max_steps <= int(state.get("global_step", 0))
        if not at_end or fit_state(state).get("fit_finished"):
            return None
        return (
            "written at the last step, before fit ended: Lightning would skip the end of the "
            "epoch and of fit from it, so the run goes on from an earlier checkpoint"
        )

    newest = newest_valid_checkpoint(ckpt_dir, ends_unfinished) if cfg.get("resume") else None
    if newest:
        log.info("Resuming from %s", newest)
        return Start(str(newest), True, True)
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        checkpoint = read_checkpoint(path, trust=bool(cfg.get("trust_checkpoint")))
        check_same_model(checkpoint, model, path)
        if is_sharded(path) and not is_model_parallel(cfg.trainer.get("strategy")):
            raise ConfigError(
                f"ckpt_path={path} is a folder of shards, which only strategy=model_parallel "
                "continues: add it (with trainer.strategy.data_parallel_size), or start a new "
                f"run from its weights with init_from={path}."
            )
        done, limit = epochs_done(checkpoint), cfg.trainer.get("max_epochs")
        if isinstance(done, int) and isinstance(limit, int) and 0 <= limit < done:
            raise ConfigError(
                f"trainer.max_epochs={limit}, but ckpt_path={path} has trained {done} epochs, and "
                "this run continues its counters: give a higher limit, or start a new run from "
                f"its weights with init_from={path}."
            )
        log.info("Starting from ckpt_path=%s", path)
        return Start(str(path), not cfg.get("trust_checkpoint"))
    log.info("Starting fresh: no checkpoint in %s", ckpt_dir)
    return Start()


def start_from_weights(cfg: DictConfig, model: L.LightningModule, start: Start) -> None:
    """`init_from`: a new run from another run's weights, with a fresh optimizer, schedule and
    step counter. With LoRA adapters only they train, and checkpoints hold only them."""
    if not cfg.get("init_from"):
        return
    if cfg.get("ckpt_path"):
        raise ConfigError(
            "init_from and ckpt_path are both set: ckpt_path continues another run (its optimizer "
            "and step counter too), init_from starts a new run from its weights. Keep one."
        )
    base = load_init_weights(
        model, Path(str(cfg.init_from)), trust=bool(cfg.get("trust_checkpoint"))
    )
    adapted: list[str] = getattr(model, "adapted", [])
    if adapted:
        model.base_weights = base  # type: ignore[assignment]
    if is_global_zero():
        log.info("Starting from the weights of %s", base["path"])
    if adapted and is_global_zero():
        trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info(
            "LoRA on %d layers: %d of %d parameters train (%.2f %%)",
            len(adapted), trains, total, 100 * trains / total,
        )  # fmt: skip
    if start.resumed and start.path:
        stored = read_fit_state(Path(start.path))
        recorded = stored.get("base_weights")
        if recorded and recorded["sha256"] != base["sha256"]:
            raise ConfigError(
                f"init_from={base['path']} has changed since this run started from it (its "
                f"checkpoint {start.path} was trained on other weights): restore that file, or "
                "start a new run with another run_name=..."
            )


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


def identifying_overrides() -> list[str] | None:
    """The command's overrides that change what is trained (Hydra's `override_dirname` leaves out
    the same keys), or None outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    return identifying(hydra.overrides.task, list(hydra.job.config.override_dirname.exclude_keys))


def check_limits_ahead(cfg: DictConfig, last: Path) -> None:
    """`extend=true` trains a run further: a limit the run has already reached would have
    Lightning refuse it mid-start, or end it at once as finished at the lower limit."""
    try:
        state = read_fit_state(last)
    except (*UNREADABLE, OSError):
        return  # nothing to compare with: the run resumes from what loads, or starts fresh
    reached = {
        "trainer.max_epochs": (int(state.get("epoch", 0)), "epochs"),
        "trainer.max_steps": (int(state.get("global_step", 0)), "steps"),
    }
    for key, (done, unit) in reached.items():
        limit = OmegaConf.select(cfg, key, default=None)
        if isinstance(limit, int) and 0 <= limit <= done:
            raise ConfigError(
                f"{key}={limit} with extend=true: the run has already trained {done} {unit}; "
                f"give a higher limit to train it further (its results stay as they are)."
            )


def epochs_done(state: dict[str, Any]) -> Any:
    """The epochs that a checkpoint's fit loop completed (Lightning's `current_epoch` once it is
    restored), or None."""
    found: Any = state
    for key in ("loops", "fit_loop", "epoch_progress", "current", "completed"):
        found = found.get(key) if isinstance(found, dict) else None
    return found


def check_run_identity(cfg: DictConfig) -> None:
    """A run directory holds one run. The overrides it was started with are recorded in it, and a
    different command that comes to the same directory (an explicit run_name=..., an Optuna trial of
    another study) is refused instead of resumed or taken as finished. `extend=true` may change
    the stopping limits (train a finished run further); the new ones are recorded."""
    overrides = identifying_overrides()
    if overrides is None or not is_global_zero():
        return
    path = Path(cfg.paths.output_dir) / "run_overrides.json"
    if cfg.get("resume") and path.is_file():
        recorded = json.loads(path.read_text())
        changed = sorted(set(recorded) ^ set(overrides))
        if cfg.get("extend"):
            changed = [o for o in changed if o.split("=")[0].lstrip("+~") not in STOPPING_KEYS]
        if changed:
            only_limits = all(o.split("=")[0].lstrip("+~") in STOPPING_KEYS for o in changed)
            extend = " To train that run further with the new limit, add extend=true." * only_limits
            raise ConfigError(
                f"{path.parent} holds a run of other settings ({' '.join(changed)} differ): pick "
                f"another run_name=..., or delete that directory to start over.{extend}"
            )
        if recorded == overrides:
            return
        check_limits_ahead(cfg, path.parent / "checkpoints" / "last.ckpt")
        # New limits: the run is no longer finished (metrics.json goes before they are recorded,
        # so a kill in between leaves a run that trains on, never one finished at the old limit).
        (path.parent / "metrics.json").unlink(missing_ok=True)
    write_json(overrides, path)


def finished_metrics(cfg: DictConfig) -> dict[str, float] | None:
    path = Path(cfg.paths.output_dir) / "metrics.json"
    if not cfg.get("resume") or not path.is_file():
        return None
    log.info(
        "This run already finished (%s): not training again. To train it further, raise "
        "trainer.max_epochs (or max_steps) and add extend=true; to train anew, pick another "
        "run_name=... or delete that directory.",
        path,
    )
    return {name: float(value) for name, value in json.loads(path.read_text()).items()}


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


def load_data_before_loggers(datamodule: Any) -> bool:
    """Data that the data module refuses (a file that does not decode, a shard that fails its
    checksum) is refused before a logger starts its run and prints about it. Only where loading
    is known to be safe to do early and once: the project's data modules that download nothing;
    Lightning's own `setup` call then finds the splits loaded."""
    downloads = type(datamodule).prepare_data is not L.LightningDataModule.prepare_data
    if isinstance(datamodule, SplitDataModule) and not downloads:
        datamodule.setup("fit")
        return True
    return False


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
    allow(cfg)
    check_run_settings(cfg)
    with run_lock.hold(Path(cfg.paths.output_dir)):
        check_run_identity(cfg)
        done = finished_metrics(cfg)
        if done is not None:
            return done
        with exit_143_on_stop_signals():
            try:
                metrics = fit_and_test(cfg)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not ran_out_of_memory(error):
                    raise
                device = out_of_memory_device(error)
                shards = shards_itself(get_class(cfg.model._target_))
                advice = out_of_memory_advice(
                    cfg, device, cfg.paths.output_dir, __package__, shards
                )
                raise TrainingError(advice) from error
            leave_process_group()
            return metrics


def fit_and_test(cfg: DictConfig) -> dict[str, float]:
    use_hydra_logging_only()
    machine = resolve_machine(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    progress = ExactResume()
    model, datamodule = build_model_and_data(cfg.model, cfg.data)
    net = getattr(model, "net", None)
    check_fp8(cfg, machine.accelerator, net if isinstance(net, torch.nn.Module) else model)
    check_vocabulary(datamodule, net)
    check_images(datamodule, net)
    check_strategy_fits(cfg, model)
    start = starting_checkpoint(cfg, model)
    start_from_weights(cfg, model, start)
    if load_data_before_loggers(datamodule):
        check_validation_interval(cfg, datamodule)
    output_dir = Path(cfg.paths.output_dir)
    found = set(output_dir.iterdir()) if output_dir.is_dir() else set()
    loggers = instantiate_loggers(cfg.get("logger"))
    callbacks = instantiate_callbacks(cfg.get("callbacks"), have_logger=bool(loggers))
    monitored = OmegaConf.select(cfg, "monitor.metric", default=None)
    callbacks += [RunConfigInCheckpoint(run_config(cfg)), progress]
    callbacks += [MonitoredMetricLogged(str(monitored) if monitored else None)]
    trainer = build_trainer(cfg, machine, callbacks, loggers)
    log_batch_size(cfg.data.get("batch_size"), trainer)
    log_memory_plan(cfg, machine.precision, machine.accelerator, trainer)
    hyperparameters = OmegaConf.to_container(cfg, resolve=True)
    for logger in trainer.loggers:
        logger.log_hyperparams(hyperparameters)  # type: ignore[arg-type]

    finished = fit_state(read_fit_state(Path(start.path))) if start.resumed and start.path else {}
    if finished.get("fit_finished") and not cfg.get("extend"):
        log.info("Training had finished (%s): testing only.", start.path)
        metrics, best, saved = dict(finished["metrics"]), finished["best_model_path"], start.path
        metrics.update(validate_before_fine_tuning(cfg, trainer, model, datamodule))
    else:
        progress.restores_progress = start.resumed
        progress.restores_stop = not finished.get("fit_finished")
        with bad_data_leaves_no_logs(trainer, output_dir, found), fit_setting_errors(cfg):
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
    if stop_signals.received():
        raise stop(trainer, "after training", Path(saved) if saved else None)

    if cfg.get("test"):
        tested = best or saved
        log.info("Testing %s", tested or "the weights in memory (no checkpoint was saved)")
        trainer.test(model, datamodule=datamodule, ckpt_path=tested or None, weights_only=True)
        metrics.update(scalars(trainer.callback_metrics))

    metrics.update(getattr(datamodule, "baseline", {}))
    if trainer.world_size > 1:
        write_json(metrics, Path(cfg.paths.output_dir) / f"metrics-rank{trainer.global_rank}.json")
    if trainer.is_global_zero:
        write_metrics(metrics, cfg.paths.output_dir)
    return metrics


if __name__ == "__main__":  # `python -m <package>.train` runs `<package>-train`
    from . import cli

    cli.train()
