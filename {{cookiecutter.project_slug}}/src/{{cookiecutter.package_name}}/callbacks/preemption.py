from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from ..checkpointing.saving import finish_checkpoint_writes
from ..run import stop_signals
from .exact_resume import mid_window, no_resumable_save_here

log = logging.getLogger(__name__)

REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")


class Preempted(Exception):
    """The run stopped on a signal, after saving what it had trained; the same command resumes
    it. The command turns this into exit code 143."""

    def __init__(self, signal_name: str, where: str, saved: Path | None, requeued: bool) -> None:
        self.signal_name, self.where, self.saved = signal_name, where, saved
        self.requeued = requeued
        kept = f"saved {saved}" if saved else "nothing new to save"
        then = "requeued the job" if requeued else "run the same command to resume"
        super().__init__(f"{signal_name} {where}: {kept}; {then}.")


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


def stop(trainer: L.Trainer, where: str, saved: Path | None, requeue: bool = True) -> Preempted:
    """The exception that ends the run; for SIGUSR1/SIGUSR2 under SLURM (the warning that
    `sbatch --signal` and submitit send before the time limit) the job is requeued first."""
    received = stop_signals.received()
    name = received.name if received else "a signal on another rank"
    requeued = (
        requeue and name in REQUEUE_SIGNALS and trainer.is_global_zero and requeue_slurm_job()
    )
    return Preempted(name, where, saved, requeued)


class Preemption(Checkpoint):
    """Where a run stops on SIGTERM, SIGUSR1 or SIGUSR2 (which `stop_signals` only records).

    - Training: at the next optimizer step (the end of a gradient accumulation window) that is
      not an epoch's last batch and after which no validation is due, every rank saves a
      checkpoint, and the run stops. With several processes the ranks agree on the signal every
      `sync_every_n_steps` steps (a collective and a host sync), not at every step; once they
      have, they stop at the same next such step.
    - Validation inside training: it finishes, and training stops at the step after it.
    - Sanity check and test: at the next batch, with nothing to save (before training there is
      none; during the test, training is already saved as finished).

    A checkpoint taken inside the signal handler (Lightning's and submitit's way) would capture
    half a step. As a `Checkpoint`, Lightning calls it after the other callbacks, so a step's own
    checkpoints are written before it stops. Lightning's own SIGTERM handler, which ends `fit` with exit code 0, is replaced
    at the start of each stage.
    """

    def __init__(
        self,
        dirpath: str,
        filename: str = "last.ckpt",
        requeue: bool = True,
        sync_every_n_steps: int = 10,
    ) -> None:
        self.path = Path(dirpath) / filename
        self.requeue = requeue
        self.sync_every_n_steps = max(1, sync_every_n_steps)
        self.stopping = False

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_signals.reassert()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_signals.reassert()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_signals.reassert()

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.sanity_checking and stop_signals.received():
            raise stop(trainer, "during the sanity check", None, self.requeue)

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if stop_signals.received():
            raise stop(trainer, "during the test", None, self.requeue)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if mid_window(trainer):
            return  # inside an accumulation window: its gradients are in no checkpoint
        if not self.stopping:
            signalled = stop_signals.received() is not None
            if trainer.world_size > 1:
                if trainer.global_step % self.sync_every_n_steps:
                    return
                signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
            self.stopping = signalled  # every rank agreed on it at the same step
        if not self.stopping or no_resumable_save_here(trainer):
            return
        received = stop_signals.received()
        name = received.name if received else "a signal on another rank"
        log.warning("Received %s: saving %s at step %d.", name, self.path, trainer.global_step)
        trainer.save_checkpoint(self.path, weights_only=False)
        finish_checkpoint_writes(trainer.strategy)
        raise stop(trainer, f"at step {trainer.global_step}", self.path, self.requeue)
