"""Callbacks that tests add to real runs (`+callbacks.<name>._target_=tests.faults.<Class>`, with
`allowed_targets=[tests]`) to record what a run saw and to inject failures."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class RecordBatches(Callback):
    """Appends `<global step> <digest of the batch's inputs>` for every training batch."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        digest = hashlib.sha1(batch[0].detach().cpu().numpy().tobytes()).hexdigest()[:12]
        with self.path.with_name(f"{self.path.name}.rank{trainer.global_rank}").open("a") as f:
            f.write(f"{trainer.global_step} {digest}\n")


class SignalAt(Callback):
    """Sends a real signal at the end of training step `step` (before that step's checkpoint),
    once: `marker` remembers that it fired, so the resumed run goes on. SIGKILL goes to the whole
    process group, like a node that dies."""

    def __init__(self, step: int, marker: str, signal_name: str = "SIGKILL") -> None:
        self.step, self.marker, self.signal_name = step, Path(marker), signal_name

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step != self.step or self.marker.exists():
            return
        trainer.strategy.barrier()
        if not trainer.is_global_zero:
            return
        self.marker.write_text(str(self.step))
        number = signal.Signals[self.signal_name]
        if number == signal.SIGKILL:
            os.killpg(os.getpgid(0), number)
        os.kill(os.getpid(), number)


class NanGradientAt(Callback):
    """Makes the gradients of the given steps NaN, as a diverging loss would."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step in self.steps:
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.fill_(torch.nan)
