"""Strategies that need more than a config can say (classes built from names, policies)."""

from __future__ import annotations

import functools
from typing import Any

from hydra.utils import get_class
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy


def fsdp_strategy(
    sharding_strategy: Any = "FULL_SHARD",
    wrap_min_params: int = 1_000_000,
    activation_checkpointing: list[str] | None = None,
    cpu_offload: bool = False,
) -> FSDPStrategy:
    """FSDP with size-based wrapping; `activation_checkpointing` names module classes to
    recompute in the backward pass (e.g. the transformer block) to save memory."""
    checkpointed = {get_class(name) for name in activation_checkpointing or []}
    return FSDPStrategy(
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=functools.partial(
            size_based_auto_wrap_policy, min_num_params=int(wrap_min_params)
        ),
        activation_checkpointing_policy=checkpointed or None,
        cpu_offload=cpu_offload,
        state_dict_type="full",
    )
