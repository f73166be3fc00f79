"""What the bench knows of the device: its name, the matrix-product ceiling it measures there,
the dtypes a precision computes in, and the memory a loop peaked at."""

from __future__ import annotations

import gc
import platform
import statistics
import time
from pathlib import Path

import torch

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    return f"{cpu} ({torch.get_num_threads()} threads)"


def ceiling_dtype(precision: str, device: torch.device) -> torch.dtype:
    """On a GPU, the dtype the model's matrix products run in under this precision; on a CPU,
    float32 (few CPUs multiply 16-bit floats natively)."""
    if device.type == "cpu":
        return torch.float32
    return AUTOCAST_DTYPES.get(precision) or TRUE_DTYPES.get(precision) or torch.float32


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The median rate of a size x size x size matrix product over 5 timings, on the threads the
    loops use: the ceiling the model's matmuls can reach on this device in this dtype (float32
    follows `matmul_precision`)."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    repeats = 10 if device.type == "cuda" else 2
    for _ in range(2):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / repeats)
    return 2 * size**3 / statistics.median(times) / 1e12


def release_memory(device: torch.device) -> None:
    """Free what the last loop left, forget compiled graphs, and restart the memory peak."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
