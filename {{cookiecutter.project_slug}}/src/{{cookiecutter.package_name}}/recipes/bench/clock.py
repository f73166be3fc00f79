"""When each measured training step starts and ends, read the same way in every loop."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class StepClock:
    """Host clock at each step's start (batch on the device) and end (optimizer stepped).

    The device is synchronized around every warm-up step and at the start of step `warmup` and
    of step `warmup + steps`, never in between: the measured window holds `steps` whole steps.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int) -> None:
        self.device = device
        self.warmup = warmup
        self.steps = steps
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.fingerprints: list[int] = []

    @property
    def total(self) -> int:
        """Steps started: warm-up, measured, and the one whose start closes the window."""
        return self.warmup + self.steps + 1

    @property
    def done(self) -> bool:
        return len(self.starts) >= self.total

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, batch: Any) -> None:
        index = len(self.starts)
        if index >= self.total:
            return
        if index < self.warmup:
            # Tells whether the loops saw the same batches; the warm-up syncs anyway.
            self.fingerprints.append(int(batch[-1].long().sum()))
        if index <= self.warmup or index == self.total - 1:
            self.synchronize()
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        if len(self.ends) < self.warmup:
            self.synchronize()
        self.ends.append(time.perf_counter())

    def summary(self) -> dict[str, Any]:
        """Step times in seconds. `data_share` is the host time between one step's end and the
        next step's start (fetching the next batch, moving it to the device) over the window."""
        if not self.done:
            raise RuntimeError(f"only {len(self.starts)} of {self.total} steps ran")
        first, last = self.warmup, self.warmup + self.steps
        window = self.starts[last] - self.starts[first]
        steps = [b - a for a, b in itertools.pairwise(self.starts[first : last + 1])]
        waits = [self.starts[i + 1] - self.ends[i] for i in range(first, last)]
        median = statistics.median(steps)
        deciles = (
            statistics.quantiles(steps, n=10, method="inclusive")  # within the times measured
            if len(steps) > 1
            else [median] * 9
        )
        warmup_steps = [b - a for a, b in itertools.pairwise(self.starts[: first + 1])]
        return {
            "step_time_median_s": median,
            "step_time_p10_s": deciles[0],
            "step_time_p90_s": deciles[-1],
            "step_time_mean_s": window / self.steps,
            "data_share": sum(waits) / window,
            "first_step_s": warmup_steps[0] if warmup_steps else None,
            "warmup_excess_s": sum(max(0.0, t - median) for t in warmup_steps),
        }


class LightningStepClock(Callback):
    """Reads a `StepClock` at Lightning's batch hooks; nothing else."""

    def __init__(self, clock: StepClock, seed: int) -> None:
        self.clock = clock
        self.seed = seed

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The same sampler seed as the other loops: Lightning draws it when it first iterates.
        torch.manual_seed(self.seed)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.start(batch)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.clock.end()


def epochs_of(loader: Any, seed: int) -> Iterator[Any]:
    """The loader's batches epoch after epoch, as Lightning draws them: the sampler seeded with
    `seed` at the first epoch and told each epoch's number at its start."""
    torch.manual_seed(seed)
    for epoch in itertools.count():
        for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
        yield from loader
