"""Values a config can hold but a run cannot use, refused before anything is built, each with one
line that names the key and what to write instead. No torch here."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..errors import PACKAGE, ConfigError
from .plan import strategy_of

SEED_RANGE = (0, 2**32 - 1)


def whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def refuse(key: str, value: Any, rule: str) -> ConfigError:
    numeral = isinstance(value, str) and any(c.isdigit() for c in value)
    hint = " (in ASCII numerals, e.g. 10)" if numeral else ""
    return ConfigError(f"{key}={value!r}: {rule}{hint}.")


def check_whole(key: str, value: Any, low: int, allowed: tuple[Any, ...] = (None,)) -> None:
    if value in allowed and not isinstance(value, bool):
        return
    if not whole(value) or value < low:
        alternatives = "".join(f", or {'null' if a is None else repr(a)}" for a in allowed)
        raise refuse(key, value, f"use a whole number of {low} or more{alternatives}")


# Batches a run cannot do without: none would train nothing, or validate nothing where the best
# checkpoint and early stopping read the validation's metric (Lightning's traceback).
NEEDED_BATCHES = {
    "train": "0 trains nothing",
    "val": "0 validates nothing, and the best checkpoint and early stopping read validation",
}


def check_limit(key: str, value: Any, why_not_none: str | None = None) -> None:
    """Lightning's limit_*_batches: a count, or a fraction between 0 and 1; above 0 where the run
    needs such batches (`why_not_none` says why)."""
    low = 0 if why_not_none is None else 1
    if value is None or (whole(value) and value >= low):
        return
    if not number(value) or not 0.0 <= value <= 1.0 or (low and value == 0):
        rule = (
            "use a whole number of batches, or a fraction from 0.0 to 1.0"
            if low == 0
            else f"use 1 or more batches, or a fraction above 0.0 up to 1.0 ({why_not_none})"
        )
        raise refuse(key, value, rule)


def check_val_check_interval(value: Any) -> None:
    """Validate every `value` training batches, or that fraction of an epoch."""
    if value is None or (whole(value) and value >= 1):
        return
    if not number(value) or not 0.0 < value <= 1.0:
        raise refuse(
            "trainer.val_check_interval",
            value,
            "use a whole number of 1 or more training batches, a fraction of an epoch above 0.0 "
            "up to 1.0, or null",
        )


# Keys that hold true or false, with any other word they also take. Python reads every other value
# as one of the two ("no" and 0.5 as true), so `trust_checkpoint=no` would unpickle in full.
SWITCHES: dict[str, tuple[str, ...]] = {
    "resume": (),
    "extend": (),
    "test": (),
    "trust_checkpoint": (),
    "kv_cache": (),
    "compile_decode": (),
    "stream": (),
    "model.compile": (),
    "model.optimizer.fused": (),
    "model.net.bias": (),
    "model.net.qkv_bias": (),
    "model.net.out_bias": (),
    "model.net.mlp_bias": (),
    "model.net.qk_norm": (),
    "model.net.tie_embeddings": (),
    "model.net.activation_checkpointing": (),
    "model.net.channels_last": (),
    "model.freeze_backbone": (),
    "model.backbone.pretrained": (),
    "data.augment.flip": (),
    "data.channels_last": (),
    "data.download": (),
    "data.verify_images": (),
    "data.verify_checksums": (),
    "trainer.barebones": (),
    "trainer.deterministic": ("warn",),
    "trainer.detect_anomaly": (),
    "trainer.enable_checkpointing": (),
    "trainer.enable_model_summary": (),
    "trainer.enable_progress_bar": (),
    "trainer.inference_mode": (),
    "trainer.sync_batchnorm": (),
    "trainer.use_distributed_sampler": (),
    "trainer.strategy.find_unused_parameters": (),
    "trainer.strategy.gradient_as_bucket_view": (),
    "trainer.strategy.cpu_offload": (),
    "trainer.profiler.export_to_chrome": (),
    "callbacks.*.auto_insert_metric_name": (),
    "callbacks.*.check_finite": (),
    "callbacks.*.enable_version_counter": (),
    "callbacks.*.requeue": (),
    "callbacks.*.save_last": ("link",),
    "callbacks.*.save_weights_only": (),
    "logger.*.default_hp_metric": (),
    "logger.*.log_model": ("all",),
    "logger.*.offline": (),
    "extras.print_config": (),
    "extras.ignore_warnings": (),
    "bench.plain": (),
    "bench.find_batch_size": (),
    "bench.generation": (),
    "bench.compile_decode": (),
    "bench.checkpointing": (),
}


def switch_values(cfg: DictConfig, pattern: str) -> Iterator[tuple[str, Any]]:
    group, wildcard, leaf = pattern.partition(".*.")
    if not wildcard:
        yield pattern, OmegaConf.select(cfg, pattern, default=None)
        return
    node = OmegaConf.select(cfg, group, default=None)
    if isinstance(node, DictConfig):
        for name, child in node.items():
            if isinstance(child, DictConfig) and leaf in child:
                yield f"{group}.{name!s}.{leaf}", child.get(leaf)


def check_switches(cfg: DictConfig) -> None:
    for pattern, words in SWITCHES.items():
        for key, value in switch_values(cfg, pattern):
            if value is None or isinstance(value, bool) or value in words:
                continue
            alternatives = "".join(f" or {word}" for word in words)
            raise ConfigError(f"{key}={value!r}: use true or false{alternatives}.")


def check_trainer(trainer: DictConfig) -> None:
    fast = trainer.get("fast_dev_run")
    if not (fast is None or isinstance(fast, bool) or (whole(fast) and fast >= 0)):
        raise refuse("trainer.fast_dev_run", fast, "use true, false or a number of batches")
    for key in ("max_epochs", "max_steps"):
        check_whole(f"trainer.{key}", trainer.get(key), -1)
        if trainer.get(key) == 0:
            raise refuse(f"trainer.{key}", 0, "0 trains nothing: use 1 or more, or -1 for no limit")
    check_whole("trainer.min_epochs", trainer.get("min_epochs"), 0)
    check_whole("trainer.num_nodes", trainer.get("num_nodes", 1), 1)
    check_whole("trainer.log_every_n_steps", trainer.get("log_every_n_steps"), 1)
    check_whole("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), 1)
    check_whole("trainer.check_val_every_n_epoch", trainer.get("check_val_every_n_epoch"), 1)
    devices = trainer.get("devices")
    if not (
        devices in ("auto", -1)
        or (whole(devices) and devices >= 1)
        or (
            isinstance(devices, (list, tuple, ListConfig))
            and len(devices) > 0
            and all(whole(d) and d >= 0 for d in devices)
        )
    ):
        raise refuse(
            "trainer.devices",
            devices,
            "use a count of 1 or more, -1 or auto for all, or a list of device indices ([0,1])",
        )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (not number(clip) or not clip >= 0):
        raise refuse("trainer.gradient_clip_val", clip, "use a number of 0 or more, or null")
    for split in ("train", "val", "test", "predict"):
        key = f"limit_{split}_batches"
        check_limit(f"trainer.{key}", trainer.get(key), NEEDED_BATCHES.get(split))
    check_val_check_interval(trainer.get("val_check_interval"))


def check_learning_rate(cfg: DictConfig) -> None:
    optimizer = OmegaConf.select(cfg, "model.optimizer", default=None)
    if not isinstance(optimizer, DictConfig) or "lr" not in optimizer:
        return
    lr = optimizer.get("lr")
    if not number(lr) or not math.isfinite(lr) or lr <= 0:
        raise refuse("model.optimizer.lr", lr, "use a positive, finite learning rate, e.g. 0.001")


def check_optimizer(cfg: DictConfig) -> None:
    decay = OmegaConf.select(cfg, "model.optimizer.weight_decay", default=None)
    if decay is not None and (not number(decay) or not math.isfinite(decay) or decay < 0):
        raise refuse("model.optimizer.weight_decay", decay, "use a finite number, 0 or more")
    scheduler = OmegaConf.select(cfg, "model.scheduler", default=None)
    if not isinstance(scheduler, DictConfig):
        return
    if "warmup_steps" in scheduler:
        check_whole("model.scheduler.warmup_steps", scheduler.get("warmup_steps"), 0, allowed=())
    ratio = scheduler.get("min_lr_ratio", 0.0)
    if not number(ratio) or not 0.0 <= ratio <= 1.0:
        raise refuse(
            "model.scheduler.min_lr_ratio",
            ratio,
            "use a number from 0 to 1 (the lowest learning rate, as a share of the highest)",
        )


def check_network(cfg: DictConfig) -> None:
    dropout = OmegaConf.select(cfg, "model.net.dropout", default=None)
    if dropout is not None and (not number(dropout) or not 0.0 <= dropout < 1.0):
        raise refuse("model.net.dropout", dropout, "use a probability from 0 up to (not) 1")
    widths = OmegaConf.select(cfg, "model.net.channels", default=None)
    if widths is not None and not (
        isinstance(widths, ListConfig) and all(whole(width) and width >= 1 for width in widths)
    ):
        raise refuse("model.net.channels", widths, "use a list of widths of 1 or more ([32,64])")


def check_context(cfg: DictConfig) -> None:
    """A language model sees windows of `data.block_size` tokens: its context must hold them."""
    model = OmegaConf.select(cfg, "model.net.block_size", default=None)
    data = OmegaConf.select(cfg, "data.block_size", default=None)
    for key, value in (("data.block_size", data), ("model.net.block_size", model)):
        if value is not None and (not whole(value) or value < 1):
            raise refuse(key, value, "use a whole number of 1 or more")
    if whole(model) and whole(data) and data > model:
        raise ConfigError(
            f"data.block_size={data} is longer than the model's context, model.net.block_size="
            f"{model}: set data.block_size alone (the model's follows it)."
        )


MATMUL_PRECISIONS = ("highest", "high", "medium")


def check_model_parallel(cfg: DictConfig) -> None:
    """`strategy=model_parallel` lays its processes out as data_parallel x tensor_parallel, which
    must make up all of them; this project's models shard with FSDP2 only, over data_parallel."""
    strategy = cfg.trainer.get("strategy")
    if not isinstance(strategy, DictConfig) or not strategy_of(strategy).model_parallel:
        return
    data, tensor = strategy.get("data_parallel_size"), strategy.get("tensor_parallel_size")
    for key, value in (("data_parallel_size", data), ("tensor_parallel_size", tensor)):
        check_whole(f"trainer.strategy.{key}", value, 1, allowed=("auto",))
    ours = str(OmegaConf.select(cfg, "model._target_", default="")).startswith(f"{PACKAGE}.")
    if ours and tensor not in (1, "auto"):
        raise refuse(
            "trainer.strategy.tensor_parallel_size",
            tensor,
            "this project's models shard with FSDP2 over data_parallel_size only (no tensor "
            "parallelism in their configure_model): use 1, and set data_parallel_size to the "
            "number of processes",
        )
    cpu = str(cfg.trainer.get("accelerator")) == "cpu"
    if cpu and "auto" in (data, tensor):
        raise ConfigError(
            "strategy=model_parallel on CPU needs trainer.strategy.data_parallel_size set to the "
            "number of processes (trainer.devices x trainer.num_nodes), e.g. "
            "trainer.strategy.data_parallel_size=2 trainer.devices=2."
        )
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple, ListConfig)):
        devices = len(devices)
    sizes = (data, tensor, devices, nodes)
    if all(whole(size) for size in sizes) and data * tensor != devices * nodes:
        raise ConfigError(
            f"trainer.strategy.data_parallel_size={data} x tensor_parallel_size={tensor} "
            f"must equal the processes, trainer.devices={devices} x trainer.num_nodes="
            f"{nodes}: make them agree."
        )


def check_paths(cfg: DictConfig) -> None:
    """An empty folder would put the run's files at the top of the file system."""
    paths = cfg.get("paths")
    for key in paths or {}:
        try:
            value = paths.get(key)
        except Exception:  # an interpolation only a running command resolves
            continue
        if isinstance(value, str) and not value.strip():  # None: not known until the run starts
            raise ConfigError(f"paths.{key} is empty: give a folder, or leave it as it was.")


# Numbers that launchers (torchrun, SLURM) hand each process, which torch, Lightning and
# torchmetrics read with int() on import or start-up.
LAUNCHER_NUMBERS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
)  # fmt: skip


def check_launcher_environment() -> None:
    for name in LAUNCHER_NUMBERS:
        value = os.environ.get(name)
        if value is not None and not value.strip().isdigit():
            raise ConfigError(
                f"{name}={value!r} in the environment is not a whole number. Launchers (torchrun, "
                f"SLURM) set it for each process: unset {name}, or start the run through its "
                "launcher."
            )


def check_launched_processes(trainer: DictConfig) -> None:
    """With LOCAL_RANK set, Lightning takes this process for one a launcher started and waits
    for trainer.devices x trainer.num_nodes of them: a launcher that started another number (or
    a shell that kept a launcher's variables) would have it wait for ever."""
    started = os.environ.get("WORLD_SIZE")
    if "LOCAL_RANK" not in os.environ or started is None or "SLURM_JOB_ID" in os.environ:
        return
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    per_node = (
        devices if whole(devices) else len(devices) if isinstance(devices, ListConfig) else None
    )
    if per_node is None or not whole(nodes) or per_node * nodes == int(started):
        return
    raise ConfigError(
        f"LOCAL_RANK and WORLD_SIZE={started} in the environment: a launcher started "
        f"{started} process(es), but trainer.devices={devices} x trainer.num_nodes={nodes} "
        f"asks for {per_node * nodes}. Make them agree, or unset LOCAL_RANK and WORLD_SIZE "
        "to let the run start its own processes."
    )


def check_run_settings(cfg: DictConfig) -> None:
    check_launcher_environment()
    matmul = cfg.get("matmul_precision")
    if matmul is not None and matmul not in MATMUL_PRECISIONS:
        raise refuse("matmul_precision", matmul, "use highest, high (TF32), medium or null")
    seed = cfg.get("seed")
    if seed is not None and (not whole(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise refuse("seed", seed, f"use a whole number from 0 to {SEED_RANGE[1]}, or null")
    check_paths(cfg)
    check_switches(cfg)
    check_trainer(cfg.trainer)
    check_launched_processes(cfg.trainer)
    check_learning_rate(cfg)
    check_optimizer(cfg)
    check_network(cfg)
    check_context(cfg)
    check_model_parallel(cfg)
