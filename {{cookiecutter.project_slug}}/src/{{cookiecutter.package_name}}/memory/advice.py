"""What a run that ran out of device memory should change, in one line. No Lightning here."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

import torch

GIB = 2**30


@dataclass(frozen=True)
class OutOfMemoryRun:
    """What the advice weighs: the batch, whether the network can recompute activations (None:
    it has no such switch), and whether the run shards or its model could."""

    batch_size: Any
    accumulate_grad_batches: int
    activation_checkpointing: bool | None
    strategy_shards: bool
    model_shards_itself: bool


def peak_and_total_gib(device: torch.device) -> tuple[float, float]:
    """The run's peak and the device's memory: the CUDA allocator's on a GPU, the process's
    largest resident size and the machine's RAM on a CPU."""
    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device) / GIB,
            torch.cuda.get_device_properties(device).total_memory / GIB,
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return peak_kib / 2**20, total / GIB


def ran_out_of_memory(error: BaseException) -> bool:
    """CUDA's allocator raises torch.OutOfMemoryError; the CPU's, a plain RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError)
        and "DefaultCPUAllocator: can't allocate memory" in str(error)
    )


def out_of_memory_device(error: BaseException) -> torch.device:
    if torch.cuda.is_available() and "CUDA" in str(error):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def out_of_memory_advice(
    run: OutOfMemoryRun, device: torch.device, run_dir: str, package: str
) -> str:
    """The batch, the measured peak and the device's memory, then what to change."""
    batch, accumulate = run.batch_size, run.accumulate_grad_batches
    peak, total = peak_and_total_gib(device)
    changes = []
    if isinstance(batch, int) and batch > 1:
        changes.append(
            f"data.batch_size={batch // 2} trainer.accumulate_grad_batches={accumulate * 2} "
            "(the same global batch)"
        )
    if run.activation_checkpointing is False:
        changes.append("model.net.activation_checkpointing=true")
    if not run.strategy_shards:
        changes.append(
            "strategy=model_parallel (FSDP2 shards weights and optimizer state)"
            if run.model_shards_itself
            else "strategy=fsdp (FSDP shards weights, gradients and optimizer state)"
        )  # fmt: skip
    changes.append(f"the largest batch that fits: {package}-bench bench.find_batch_size=true")
    return (
        f"out of memory on {device.type} with data.batch_size={batch} per device (peak "
        f"{peak:.1f} GiB of {total:.1f} GiB). Try {'; or '.join(changes)}. The checkpoints in "
        f"{run_dir} are kept."
    )
