from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from ..checkpointing.saving import finish_checkpoint_writes
from ..errors import TrainingError
from ..run import stop_signals
from .exact_resume import mid_window, no_resumable_save_here

log = logging.getLogger(__name__)

REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")
# What a start that has trained nothing yet keeps before its job's end to save and requeue: it
# gives up where its first step that can be saved would come later.
SAVE_RESERVE_S = 10.0


class Preempted(Exception):
    """The run stopped on a signal, after saving what it had trained; the same command resumes
    it. The command requeues the SLURM job where that is due (`finish`), as the last thing before
    its exit, and turns this into its `exit_code`."""

    def __init__(self, signal_name: str, where: str, saved: Path | None, requeue: bool) -> None:
        self.signal_name, self.where, self.saved = signal_name, where, saved
        self.requeue, self.requeued = requeue, False
        super().__init__(self.message())

    def message(self) -> str:
        kept = f"saved {self.saved}" if self.saved else "nothing new to save"
        then = "requeued the job" if self.requeued else "run the same command to resume"
        stopped_by = "Stopped by Ctrl-C" if self.by_ctrl_c else self.signal_name
        return f"{stopped_by} {self.where}: {kept}; {then}."

    def finish(self) -> str:
        """Requeue the job where due, then say how the run stopped. Requeueing makes SLURM send
        SIGTERM to this job's processes, which Lightning's teardown left at its default action:
        done earlier, the process could die before its last line."""
        if self.requeue:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.requeued = requeue_slurm_job()
        return self.message()

    @property
    def by_ctrl_c(self) -> bool:
        return self.signal_name == "SIGINT"

    @property
    def exit_code(self) -> int:
        """130 for Ctrl-C, as a shell reports it; 143 for the others (never 0: a scheduler would
        record success)."""
        if self.by_ctrl_c:
            return stop_signals.INTERRUPTED_EXIT_CODE
        return stop_signals.STOPPED_BY_SIGNAL_EXIT_CODE


class TimeLimitTooShort(TrainingError):
    """A SLURM job whose time limit ends before its start-up reaches a step it can save: requeued,
    it would start over with nothing gained, for ever."""


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


@dataclass(frozen=True)
class JobTimes:
    """When this start of a SLURM job began and when the job ends (Unix time), and its time limit
    as SLURM writes it."""

    started: float
    ends: float
    limit: str


def job_times(job_id: str) -> JobTimes | None:
    """From squeue (a requeued job's start is its latest); None where squeue cannot tell."""
    try:
        listed = subprocess.run(
            ["squeue", "--noheader", f"--jobs={job_id}", "--format=%S|%e|%l"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        started, ends, limit = listed.stdout.strip().split("|")
        return JobTimes(
            datetime.fromisoformat(started).timestamp(), datetime.fromisoformat(ends).timestamp(),
            limit,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


class FirstSaveDue:
    """A requeue warning (SIGUSR1/SIGUSR2 under SLURM) that came before this start of the job had
    anything to save: in its start-up, its sanity check, or a test that is all this start runs.
    Requeued there, the job would start over and, warned as early again, requeue with nothing
    gained for ever. So the run goes on to the first step that it can save (or to the test's end)
    while the job's time allows that and `SAVE_RESERVE_S` for the save. Where it does not (a
    step's measured time says it cannot get there, or an alarm at that last moment rings first),
    it ends with one line saying the time limit is too short: exit code 1, not requeued."""

    def __init__(
        self, signal_name: str, going_to: str, not_done: str, times: JobTimes | None = None
    ) -> None:
        self.signal_name, self.going_to, self.not_done = signal_name, going_to, not_done
        self.signalled = stop_signals.received_at() or time.time()
        job_id = slurm_job_id()
        self.times = times or (job_times(job_id) if job_id else None)
        self.alarm_set = self.announced = False
        self.previous_alarm: Any = signal.SIG_DFL

    @property
    def deadline(self) -> float | None:
        return self.times.ends - SAVE_RESERVE_S if self.times else None

    def announce(self, where: str) -> None:
        self.announced = True
        left = f"; the job ends in {self.times.ends - time.time():.0f} s" if self.times else ""
        log.warning(
            "Received %s %s, before this start had anything to save: requeued now, the job would "
            "only start over. Going on to %s%s.", self.signal_name, where, self.going_to, left,
        )  # fmt: skip

    def too_short(self, step_seconds: float | None = None) -> TimeLimitTooShort:
        times = self.times
        assert times is not None, "a deadline comes from squeue's times"
        elapsed = time.time() - times.started
        lead = max(0.0, times.ends - self.signalled)
        step = f", and a step takes {step_seconds:.0f} s" if step_seconds is not None else ""
        minutes = math.ceil((elapsed + lead) / 60) + 1
        return TimeLimitTooShort(
            f"SLURM's time limit for this job ({times.limit}) is too short for its start-up: "
            f"{elapsed:.0f} s after it started it had not {self.not_done}{step}, with "
            f"{max(0.0, times.ends - time.time()):.0f} s left. Its {self.signal_name} warning came "
            "before it had anything to save, so a requeued job would only start over: it ends "
            f"here, not requeued. Give sbatch a longer --time (at least {minutes} minutes: the "
            f"start-up, the warning's {lead:.0f} s lead and time to train)."
        )

    def arm(self) -> None:
        """An alarm at the deadline ends the run from wherever it is (a step that takes too long,
        a validation on the way): it has nothing to lose."""
        deadline = self.deadline
        if deadline is None or self.alarm_set:
            return
        left = deadline - time.time()
        if left <= 0:
            raise self.too_short()
        if threading.current_thread() is threading.main_thread():
            self.previous_alarm = signal.signal(signal.SIGALRM, self.out_of_time)
            self.alarm_set = True
            signal.setitimer(signal.ITIMER_REAL, left)

    def out_of_time(self, number: int, frame: FrameType | None) -> None:
        self.disarm()
        raise self.too_short()

    def disarm(self) -> None:
        if self.alarm_set:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous_alarm or signal.SIG_DFL)
            self.alarm_set = False

    def check_step(self, trainer: L.Trainer, step_seconds: float) -> None:
        """After a step at which no checkpoint can be saved: another step must still fit (the
        ranks agree, so that all end together)."""
        deadline = self.deadline
        late = deadline is not None and time.time() + step_seconds > deadline
        if trainer.world_size > 1:
            late = trainer.strategy.reduce_boolean_decision(late, all=False)
        if late:
            self.disarm()
            raise self.too_short(step_seconds)


def stop(trainer: L.Trainer, where: str, saved: Path | None, requeue: bool = True) -> Preempted:
    """The exception that ends the run; for SIGUSR1/SIGUSR2 under SLURM (the warning that
    `sbatch --signal` and submitit send before the time limit) the first rank requeues the job
    as the command ends (`Preempted.finish`)."""
    received = stop_signals.received()
    name = received.name if received else "a signal on another rank"
    due = requeue and name in REQUEUE_SIGNALS and trainer.is_global_zero and bool(slurm_job_id())
    return Preempted(name, where, saved, due)


class Preemption(Checkpoint):
    """Where a run stops on SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C (which `stop_signals` only
    records).

    - Training: at the next optimizer step (the end of a gradient accumulation window) that is
      not an epoch's last batch and after which no validation is due, every rank saves a
      checkpoint, and the run stops. With several processes the ranks agree on the signal every
      `sync_every_n_steps` steps (a collective and a host sync), not at every step; once they
      have, they stop at the same next such step.
    - Validation inside training: it finishes, and training stops at the step after it.
    - Sanity check and test: at the next batch, with nothing to save (before training there is
      none; during the test, training is already saved as finished).
    - Except SLURM's requeue warnings (SIGUSR1/SIGUSR2, requeue on) before a start of the job has
      anything to save (its start-up, its sanity check, a test that is all it runs): requeued
      there, the job would start over for ever. The run goes on to its first step that can be
      saved (or the test's end) where the job's time allows, else ends in one line
      (`FirstSaveDue`).

    A checkpoint taken inside the signal handler (Lightning's and submitit's way) would capture
    half a step. As a `Checkpoint`, Lightning calls it after the other callbacks, so a step's own
    checkpoints are written before it stops. Lightning's own SIGTERM handler, which ends `fit`
    with exit code 0, is replaced at the start of each stage.
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
        self.trained_from: int | None = None  # the step this start's training began at
        self.step_ended = 0.0  # time.monotonic() at the end of the last step (or the start)
        self.first_save: FirstSaveDue | None = None

    def answer_warnings_in_start_up(self) -> None:
        """Called as `fit` is about to start: from here to the loop (preparing and setting up the
        data, the callbacks and the model, compiling, restoring), a requeue warning sets the
        job's deadline at once, so that a start-up longer than the time left ends in one line
        (`FirstSaveDue`), not in SLURM's TIMEOUT. The job's times are asked of SLURM now, not in
        the signal's handler."""
        job_id = slurm_job_id() if self.requeue else None
        times = job_times(job_id) if job_id else None
        if times is None:
            return

        def warned() -> None:
            name = self.requeue_warning()
            if name is not None and self.first_save is None:
                self.first_save = FirstSaveDue(
                    name, "the first step that it can save", "reached a step it could save", times
                )
                self.first_save.arm()

        stop_signals.when_warned(warned)
        warned()  # a warning that came before

    def requeue_warning(self) -> str | None:
        """The signal received, where stopping on it would requeue the job."""
        received = stop_signals.received()
        if received is None or not self.requeue or received.name not in REQUEUE_SIGNALS:
            return None
        return received.name if slurm_job_id() else None

    def go_on_to_first_save(self, name: str, where: str, testing: bool = False) -> None:
        if self.first_save is not None:
            if not self.first_save.announced:  # set by a warning during the setup
                self.first_save.announce(where)
            return
        if testing:
            self.first_save = FirstSaveDue(name, "the end of the test", "finished its test")
        else:
            self.first_save = FirstSaveDue(
                name, "the first step that it can save", "reached a step it could save"
            )
        self.first_save.announce(where)
        self.first_save.arm()

    def stop_alarm(self) -> None:
        if self.first_save is not None:
            self.first_save.disarm()

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_signals.reassert()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A requeue warning that came before training (the ranks agree on it, and from here on
        stop at the same step)."""
        stop_signals.reassert()
        stop_signals.when_warned(None)  # the loop answers warnings from here on
        self.trained_from, self.step_ended = trainer.global_step, time.monotonic()
        name = self.requeue_warning()
        warned = name is not None
        if trainer.world_size > 1:
            warned = trainer.strategy.reduce_boolean_decision(warned, all=False)
        if warned:
            self.stopping = True
            self.go_on_to_first_save(name or "a signal on another rank", "as training started")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop_alarm()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_signals.reassert()
        stop_signals.when_warned(None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop_alarm()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.stop_alarm()

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if not trainer.sanity_checking or stop_signals.received() is None:
            return
        name = self.requeue_warning()
        if name is None:
            raise stop(trainer, "during the sanity check", None, self.requeue)
        self.go_on_to_first_save(name, "during the sanity check")

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if stop_signals.received() is None:
            return
        name = self.requeue_warning()
        if name is not None and self.trained_from is None:  # this start only tests
            self.go_on_to_first_save(name, "during the test", testing=True)
            return
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
        now = time.monotonic()
        step_seconds, self.step_ended = now - self.step_ended, now
        if not self.stopping:
            signalled = stop_signals.received() is not None
            if trainer.world_size > 1:
                if trainer.global_step % self.sync_every_n_steps:
                    return
                signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
            self.stopping = signalled  # every rank agreed on it at the same step
        if not self.stopping:
            return
        if no_resumable_save_here(trainer):
            if self.first_save is not None:
                self.first_save.check_step(trainer, step_seconds)
            return
        self.stop_alarm()
        received = stop_signals.received()
        name = received.name if received else "a signal on another rank"
        if name != "SIGINT":  # Ctrl-C's one line comes as the run stops
            log.warning("Received %s: saving %s at step %d.", name, self.path, trainer.global_step)
        trainer.save_checkpoint(self.path, weights_only=False)
        finish_checkpoint_writes(trainer.strategy)
        raise stop(trainer, f"at step {trainer.global_step}", self.path, self.requeue)
