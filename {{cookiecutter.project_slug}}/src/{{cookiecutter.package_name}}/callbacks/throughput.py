"""Samples/s, tokens/s, achieved TFLOP/s and MFU, measured without a host sync per step.

The clock is read on the host once every `log_every_n_steps` steps. The host runs ahead of the
GPU by at most a few queued steps, so over a window of many steps the host clock measures the
GPU's pace without `torch.cuda.synchronize()`. The first window (compilation, warm-up) and any
window that spans a validation run are not reported.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback

from ..errors import ConfigError

log = logging.getLogger(__name__)

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' data sheets: 16-bit tensor cores
# (bf16/fp16) and TF32. Longer names first: "H100 NVL" must match before "H100".
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 NVL": {"bf16": 835.0, "tf32": 418.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0},
    "H200 NVL": {"bf16": 835.0, "tf32": 418.0},
    "GH200": {"bf16": 989.0, "tf32": 494.0},
    "H100": {"bf16": 989.0, "tf32": 494.0},
    "H200": {"bf16": 989.0, "tf32": 494.0},
    "B200": {"bf16": 2250.0, "tf32": 1100.0},
    "A100": {"bf16": 312.0, "tf32": 156.0},
    "L40S": {"bf16": 362.0, "tf32": 183.0},
    "L4": {"bf16": 121.0, "tf32": 60.0},
    "A10": {"bf16": 125.0, "tf32": 62.5},
    "RTX 4090": {"bf16": 165.0, "tf32": 82.6},
}


def accelerator_idles(trainer: L.Trainer) -> bool:
    """Whether time spent waiting for data leaves an accelerator idle. On a CPU the loader and
    the model share the cores, and a tiny model's in-memory batches already take 5-15 %."""
    return not isinstance(trainer.accelerator, CPUAccelerator)


def positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The table's peak for this GPU name and Lightning precision string, or None if unknown."""
    column = "bf16" if precision.startswith(("bf16", "16")) else "tf32"
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks[column]
    return None


class Throughput(Callback):
    """Logs `perf/*` every `log_every_n_steps` training steps.

    The LightningModule may define `flops_per_sample` (training FLOPs, forward and backward) and
    `tokens_per_sample`; without them only samples/s is logged. `peak_tflops` overrides the table.

    `perf/data_share` is the host time between one step's end and the next step's start (the
    batch being fetched and moved) over the window, as the bench command reports it. The first
    window above `data_wait_warning` on a GPU (or another accelerator, not a CPU) gets one
    warning saying what to change.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        peak_tflops: float | None = None,
        data_wait_warning: float | None = 0.1,
    ) -> None:
        settings = "callbacks.throughput"
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int):
            raise ConfigError(
                f"{settings}.log_every_n_steps={log_every_n_steps!r}: use a whole number of 1 or "
                "more."
            )
        if log_every_n_steps < 1:
            raise ConfigError(f"{settings}.log_every_n_steps={log_every_n_steps}: use 1 or more.")
        for key, value in (("peak_tflops", peak_tflops), ("data_wait_warning", data_wait_warning)):
            if value is not None and not positive(value):
                raise ConfigError(
                    f"{settings}.{key}={value!r}: use a positive, finite number, or null "
                    f"({'the table of GPUs' if key == 'peak_tflops' else 'no warning'})."
                )
        self.log_every_n_steps = log_every_n_steps
        self.peak_override = peak_tflops
        self.data_wait_warning = data_wait_warning
        self.warned = False
        self.peak: float | None = None
        self._window_start: float | None = None
        self._window_samples = 0
        self._window_steps = 0
        self._window_wait = 0.0
        self._window_saved = False
        self._last_end: float | None = None
        self._skip_window = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = self.peak_override
        if self.peak is None and pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            self.peak = peak_tflops(name, str(trainer.precision))

    def _restart_window(self, skip: bool) -> None:
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_steps = 0
        self._window_wait = 0.0
        self._window_saved = False
        self._last_end = None
        self._skip_window = skip

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart_window(skip=self._window_start is None)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart_window(skip=True)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._window_saved = True

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._last_end is not None:
            self._window_wait += time.perf_counter() - self._last_end

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._window_samples += int(inputs.shape[0])
        self._window_steps += 1
        if self._window_steps < self.log_every_n_steps or self._window_start is None:
            self._last_end = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._window_start
        if not self._skip_window and elapsed > 0:
            metrics = self.metrics(pl_module, self._window_samples / elapsed, trainer)
            if not self._window_saved:  # a save's time would count as waiting for data
                metrics["perf/data_share"] = self._window_wait / elapsed
                self.warn_about_data_wait(trainer, metrics["perf/data_share"])
            pl_module.log_dict(metrics)
        self._restart_window(skip=False)
        self._last_end = time.perf_counter()

    def warn_about_data_wait(self, trainer: L.Trainer, share: float) -> None:
        if self.warned or self.data_wait_warning is None or share <= self.data_wait_warning:
            return
        if not accelerator_idles(trainer):
            return
        self.warned = True
        if not trainer.is_global_zero:
            return
        workers = getattr(trainer.datamodule, "num_workers", None)  # type: ignore[attr-defined]
        log.warning(
            "Training waited for data %.0f %% of the time over the last %d steps (step %d): "
            "raise data.num_workers (now %s), keep data in memory or in memory-mapped shards, "
            "or make the batch larger. (callbacks.throughput.data_wait_warning=null silences this.)",
            100 * share, self.log_every_n_steps, trainer.global_step, workers,
        )  # fmt: skip

    def metrics(
        self, pl_module: L.LightningModule, samples_per_sec: float, trainer: L.Trainer
    ) -> dict[str, float]:
        metrics = {
            "perf/samples_per_sec": samples_per_sec,
            "perf/global_samples_per_sec": samples_per_sec * trainer.world_size,
        }
        tokens = getattr(pl_module, "tokens_per_sample", None)
        if tokens:
            metrics["perf/tokens_per_sec"] = samples_per_sec * tokens
        flops = getattr(pl_module, "flops_per_sample", None)
        if flops:
            tflops = samples_per_sec * flops / 1e12
            metrics["perf/tflops"] = tflops
            if self.peak:
                metrics["perf/mfu"] = tflops / self.peak
        return metrics
