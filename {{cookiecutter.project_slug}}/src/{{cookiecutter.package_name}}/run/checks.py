"""The validation phase of every command. `check_config` runs every check of a config that can run
before anything is built, in one pass, before any run folder is written, and returns the run's
plan (`run.plan.RunPlan`), which the steps after it take instead of the config; `check_built`
runs the checks that need the built data module and model, before a logger starts or a checkpoint
is read. Bad input gets one `ConfigError`, which the command prints as its one `error:` line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class
from omegaconf import DictConfig

from ..data.base import SplitDataModule, most_processes, usable_cores
from ..errors import ConfigError
from ..memory.plan import shards_itself
from ..targets import allow
from .machine import check_fp8, resolve_accelerator, resolve_precision
from .plan import Machine, RunPlan, StartPlan, Strategy, TrackedJob, strategy_of
from .schedule import check_schedule
from .settings import check_run_settings


def check_config(cfg: DictConfig) -> RunPlan:
    """Targets, settings and the machine, before anything is built or written: the run's plan."""
    allow(cfg)
    check_run_settings(cfg)
    check_schedule(cfg)
    machine = resolve_machine(cfg)
    trainer = cfg.get("trainer") or {}
    strategy = strategy_of(trainer.get("strategy", "auto"))
    target = cfg.model.get("_target_") if cfg.get("model") is not None else None
    model_shards_itself = bool(target) and shards_itself(get_class(str(target)))
    if target:
        check_strategy_fits(strategy, model_shards_itself, str(target).rpartition(".")[2])
    run_dir = Path(cfg.paths.output_dir)
    start = StartPlan(
        run_dir=run_dir,
        resume=bool(cfg.get("resume")),
        extend=bool(cfg.get("extend")),
        ckpt_path=path_or_none(cfg.get("ckpt_path")),
        init_from=path_or_none(cfg.get("init_from")),
        trust_checkpoint=bool(cfg.get("trust_checkpoint")),
        max_epochs=trainer.get("max_epochs"),
        max_steps=trainer.get("max_steps"),
        continues_shards=strategy.model_parallel,
    )
    run_name = cfg.get("run_name")
    tracked = TrackedJob(run_dir, str(cfg.get("task_name") or "train"), run_name and str(run_name))
    return RunPlan(
        machine=machine, strategy=strategy, start=start, run_dir=run_dir, seed=cfg.get("seed"),
        matmul_precision=cfg.get("matmul_precision"), test=bool(cfg.get("test")),
        model_shards_itself=model_shards_itself, tracked=tracked,
    )  # fmt: skip


def path_or_none(value: Any) -> Path | None:
    return Path(str(value)).expanduser() if value else None


def resolve_machine(cfg: DictConfig) -> Machine:
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    devices, cores = cfg.trainer.get("devices"), usable_cores()
    if accelerator == "cpu" and isinstance(devices, int) and devices > most_processes(cores):
        raise ConfigError(
            f"trainer.devices={devices} on the CPU starts a process a device, far more than this "
            f"machine's {cores} cores can run: use at most {most_processes(cores)}, or a GPU "
            "machine with trainer=gpu."
        )
    return Machine(accelerator, resolve_precision(str(cfg.trainer.precision), accelerator))


def check_built(cfg: DictConfig, plan: RunPlan, model: L.LightningModule, datamodule: Any) -> None:
    """What only the built model and data tell: FP8 on this machine, the vocabulary, the
    images, and a validation interval within an epoch (the data is loaded here, where that is
    known to be safe, so that data it refuses is refused before a logger starts)."""
    net = getattr(model, "net", None)
    fp8 = cfg.model.get("fp8")
    check_fp8(
        fp8,
        plan.strategy,
        plan.machine.accelerator,
        net if isinstance(net, torch.nn.Module) else model,
    )
    check_vocabulary(datamodule, net)
    check_images(datamodule, net)
    if load_data_before_loggers(datamodule):
        check_validation_interval(cfg, datamodule)


def check_strategy_fits(strategy: Strategy, model_shards_itself: bool, model_name: str) -> None:
    if strategy.model_parallel and not model_shards_itself:
        raise ConfigError(
            f"strategy=model_parallel needs a LightningModule that applies FSDP2 itself in "
            f"configure_model(); {model_name} has none. Use strategy=ddp, or "
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
