from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

STOPPED_BY_SIGNAL_EXIT_CODE = 143
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint; the same command resumes it."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path, requeued: bool) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.requeued = requeued
        then = "requeued the job" if requeued else "run the same command to resume"
        super().__init__(f"{signal_name} at step {step}: saved {checkpoint}; {then}.")


def slurm_job_id() -> str | None:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> bool:
    job_id = slurm_job_id()
    if job_id is None:
        return False
    result = subprocess.run(
        ["scontrol", "requeue", job_id], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
        return False
    log.info("Requeued SLURM job %s.", job_id)
    return True


class Preemption(Callback):
    """SIGTERM, SIGUSR1 and SIGUSR2 only set a flag. At the next step boundary (with several
    processes, the next one of every `sync_every_n_steps`) every rank agrees on it and saves a
    checkpoint together; then, for SIGUSR1/SIGUSR2 under SLURM (the warning
    `sbatch --signal` and submitit send before the time limit), the job is requeued, and the run
    stops by raising `Preempted`, which the command turns into exit code 143. A checkpoint taken
    inside a signal handler (Lightning's and submitit's way) would capture half a step."""

    def __init__(
        self,
        dirpath: str,
        filename: str = "last.ckpt",
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2"),
        requeue: bool = True,
        sync_every_n_steps: int = 10,
    ) -> None:
        self.path = Path(dirpath) / filename
        self.sync_every_n_steps = max(1, sync_every_n_steps)
        self.signals = [signal.Signals[name] for name in signals]
        self.requeue = requeue
        self.received: signal.Signals | None = None
        self.previous_handlers: dict[signal.Signals, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for number in self.signals:
            self.previous_handlers[number] = signal.signal(number, self.handle)

    def handle(self, number: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(number)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:
            # Ranks agree through a collective and a host read: not at every step.
            if trainer.global_step % self.sync_every_n_steps:
                return
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        name = self.received.name if self.received else "a signal on another rank"
        log.warning("Received %s: saving %s at step %d.", name, self.path, trainer.global_step)
        trainer.save_checkpoint(self.path)
        requeued = (
            self.requeue
            and name in REQUEUE_SIGNALS
            and trainer.is_global_zero
            and requeue_slurm_job()
        )
        self.restore_handlers()
        raise Preempted(name, trainer.global_step, self.path, requeued)

    def restore_handlers(self) -> None:
        for number, handler in self.previous_handlers.items():
            signal.signal(number, handler)
        self.previous_handlers = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.restore_handlers()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.restore_handlers()
