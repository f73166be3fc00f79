"""Optimizer parameter groups and learning-rate schedules shared by the LightningModules."""

from __future__ import annotations

import math
from collections.abc import Callable
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


def configure_optimizers(
    net: nn.Module,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
    total_steps: int,
) -> dict[str, Any]:
    """Build the optimizer from its Hydra partial, and a per-step scheduler when one is set."""
    weight_decay = getattr(optimizer, "keywords", {}).get("weight_decay", 0.0)
    built = optimizer(params=parameter_groups(net, weight_decay))
    if scheduler is None:
        return {"optimizer": built}
    return {
        "optimizer": built,
        "lr_scheduler": {
            "scheduler": scheduler(built, total_steps=total_steps),
            "interval": "step",
        },
    }


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
