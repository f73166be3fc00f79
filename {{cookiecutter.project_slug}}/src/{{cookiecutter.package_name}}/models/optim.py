"""Optimizer parameter groups and learning-rate schedules shared by the LightningModules."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


def parameter_groups(net: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings only, never on biases and norm weights."""
    params = [p for p in net.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> LambdaLR:
    """Linear warm-up to the base learning rate, then cosine decay to `min_lr_ratio` of it."""

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, lr_factor)


# Keys of a `model.scheduler` node that tell Lightning when to step the schedule (and on which
# metric, for ReduceLROnPlateau); they are not the class's arguments.
STEPPING_KEYS = ("interval", "frequency", "monitor")
INTERVALS = ("step", "epoch")


def schedule_parameters(factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The arguments a scheduler class (or function) takes besides the optimizer."""
    parameters = list(inspect.signature(factory).parameters.values())
    return {
        p.name: p
        for p in parameters[1:]
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


def takes_total_steps(factory: Callable[..., Any]) -> bool:
    return "total_steps" in schedule_parameters(factory)


def schedule_arguments(
    factory: Callable[..., Any], given: Iterable[str]
) -> tuple[list[str], list[str]]:
    """The keys `given` that `factory` does not take, and the arguments it needs that are not
    given (its stepping keys and Hydra's `_..._` keys aside; `total_steps` is the run's)."""
    parameters = schedule_parameters(factory)
    named = [key for key in given if key not in STEPPING_KEYS and not key.startswith("_")]
    unknown = [key for key in named if key not in parameters]
    missing = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty and name not in (*named, "total_steps")
    ]
    return unknown, missing


def described_arguments(factory: Callable[..., Any]) -> str:
    """`step_size, gamma=0.1, last_epoch=-1`: the arguments, with their defaults."""
    return ", ".join(
        name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}"
        for name, p in schedule_parameters(factory).items()
    )


def configure_optimizers(
    net: nn.Module,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
    total_steps: int,
    total_epochs: int | None = None,
) -> dict[str, Any]:
    """Build the optimizer from its Hydra partial, and the scheduler from its partial when one is
    set: stepped every optimizer step or every epoch (`interval`), given `total_steps` (the
    optimizer steps, or the epochs) where its signature takes it and the config does not set it,
    and for ReduceLROnPlateau the metric it watches (`monitor`)."""
    weight_decay = getattr(optimizer, "keywords", {}).get("weight_decay", 0.0)
    built = optimizer(params=parameter_groups(net, weight_decay))
    if scheduler is None:
        return {"optimizer": built}
    arguments = dict(getattr(scheduler, "keywords", {}))
    stepping = {key: arguments.pop(key) for key in STEPPING_KEYS if key in arguments}
    factory = getattr(scheduler, "func", scheduler)
    positional = getattr(scheduler, "args", ())
    interval = stepping.get("interval", "step")
    if takes_total_steps(factory) and arguments.get("total_steps") is None:
        arguments["total_steps"] = total_steps if interval == "step" else total_epochs
    schedule: dict[str, Any] = {
        "scheduler": functools.partial(factory, *positional, **arguments)(built),
        "interval": interval,
        "frequency": int(stepping.get("frequency", 1)),
    }
    if stepping.get("monitor") is not None:
        schedule["monitor"] = stepping["monitor"]
    return {"optimizer": built, "lr_scheduler": schedule}


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """`configure_gradient_clipping` that also clips for fused optimizers (fused AdamW), which
    Lightning's mixed-precision plugin refuses because they unscale fp16 gradients inside their own
    step. Unscaling first (16-mixed) makes the clipping correct; bf16-mixed has nothing to unscale."""
    strategy = module.trainer.strategy
    if clip_val and isinstance(strategy, FSDPStrategy) and algorithm != "value":
        # Lightning's FSDP precision plugin refuses norm clipping; FSDP's own method does it
        # across the shards.
        strategy.model.clip_grad_norm_(clip_val)  # type: ignore[union-attr,operator]
        return
    plugin = module.trainer.precision_plugin
    handles_unscaling = getattr(optimizer, "_step_supports_amp_scaling", False)
    if not (clip_val and handles_unscaling and isinstance(plugin, MixedPrecision)):
        module.clip_gradients(
            optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm
        )
        return
    if plugin.scaler is not None:
        plugin.scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if algorithm == "value":
        nn.utils.clip_grad_value_(params, clip_val)
    else:
        nn.utils.clip_grad_norm_(params, clip_val)
