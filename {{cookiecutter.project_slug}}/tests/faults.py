"""Callbacks that tests add to real runs (`+callbacks.<name>._target_=tests.faults.<Class>`, with
the class listed in `allowed_targets`) to record what a run saw and to inject failures."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

# Where a run can be killed, each reached through the hook that the phase itself calls.
PHASES = (
    "sanity_check",  # a batch of the sanity check
    "train_step",  # the end of training step `at`, before that step's checkpoint
    "train_batch",  # the end of the `at`-th training batch (with accumulation, maybe mid-step)
    "validation",  # a batch of the `at`-th validation inside fit
    "checkpoint_write",  # half-way through writing the `at`-th checkpoint file
    "shard_write",  # the `at`-th folder of shards written, but not its .metadata (in the background)
    "epoch_end",  # the end of the `at`-th training epoch, before its checkpoints
    "early_stop",  # right after early stopping decided to stop, before its checkpoints
    "fit_end",  # fit's last hook, before the recipe saves the finished fit
    "test",  # a batch of the test
    "test_end",  # the test finished, metrics.json not yet written
)


def send(signal_name: str, whole_group: bool) -> None:
    number = signal.Signals[signal_name]
    if whole_group:
        os.killpg(os.getpgid(0), number)
    else:
        os.kill(os.getpid(), number)


class FaultAt(Callback):
    """Sends a real signal the `at`-th time the run reaches `phase`, once: `marker` remembers that
    it fired, so the resumed run goes on. SIGKILL always goes to the whole process group (a node
    that dies: DDP ranks and DataLoader workers with it); other signals go to the main process
    or, with `whole_group`, to the group (as `timeout`, SLURM and Kubernetes send them)."""

    def __init__(
        self, phase: str, marker: str, at: int = 1, signal_name: str = "SIGKILL",
        whole_group: bool = False,
    ) -> None:  # fmt: skip
        if phase not in PHASES:
            raise ValueError(f"phase={phase}: one of {', '.join(PHASES)}")
        self.phase, self.marker, self.at = phase, Path(marker), at
        self.signal_name = signal_name
        self.whole_group = whole_group or signal_name == "SIGKILL"
        self.seen: dict[str, int] = {}

    def reached(self, trainer: L.Trainer, phase: str, count: int | None = None) -> None:
        if phase != self.phase or self.marker.exists() or not trainer.is_global_zero:
            return
        self.seen[phase] = self.seen.get(phase, 0) + 1 if count is None else count
        if self.seen[phase] == self.at:
            self.marker.write_text(f"{phase} {self.at}")
            send(self.signal_name, self.whole_group)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """The phases reached inside a checkpoint write: half-way through the `at`-th file,
        the first write after early stopping decided (Lightning calls early stopping and
        the checkpoints after every other callback, so no other hook lies between them), and a
        folder of shards whose every rank has written its part, the moment before rank 0 writes
        the `.metadata` that completes it."""
        if self.phase == "shard_write" and stage == "fit" and trainer.is_global_zero:
            self.kill_before_metadata()
        if self.phase not in ("checkpoint_write", "early_stop") or stage != "fit":
            return
        checkpoint_io = trainer.strategy.checkpoint_io
        save = checkpoint_io.save_checkpoint
        writes = [0]

        def dies_mid_write(checkpoint: dict[str, Any], path: Any, *args: Any, **kw: Any) -> None:
            writes[0] += 1
            if self.marker.exists():
                return save(checkpoint, path, *args, **kw)
            if self.phase == "early_stop" and trainer.should_stop:
                self.marker.write_text("early_stop")
                send(self.signal_name, self.whole_group)
            if self.phase == "checkpoint_write" and writes[0] == self.at:
                self.marker.write_text(f"checkpoint_write {self.at}")
                if self.signal_name != "SIGKILL":
                    send(self.signal_name, self.whole_group)
                    return save(checkpoint, path, *args, **kw)
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                path = Path(path)
                partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_bytes(buffer.getvalue()[: buffer.tell() // 2])
                send("SIGKILL", True)
            return save(checkpoint, path, *args, **kw)

        checkpoint_io.save_checkpoint = dies_mid_write  # type: ignore[method-assign]

    def kill_before_metadata(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        finish = FileSystemWriter.finish
        writes = [0]

        def dies_before_metadata(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] == self.at and not self.marker.exists():
                self.marker.write_text(f"shard_write {self.at}")
                send("SIGKILL", True)
            return finish(writer, *args, **kwargs)

        FileSystemWriter.finish = dies_before_metadata  # type: ignore[method-assign]

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seen["validations"] = self.seen.get("validations", 0) + 1

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.sanity_checking:
            self.reached(trainer, "sanity_check")
        else:
            self.reached(trainer, "validation", self.seen.get("validations", 0))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self.reached(trainer, "train_step", trainer.global_step)
        self.reached(trainer, "train_batch")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reached(trainer, "epoch_end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reached(trainer, "fit_end")

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self.reached(trainer, "test")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reached(trainer, "test_end")


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


class NanGradientAt(Callback):
    """Makes the gradients of the given steps NaN, as a diverging loss would."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step in self.steps:
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.fill_(torch.nan)


class SlowSteps(Callback):
    """Sleeps after every training step, so that a test can signal a run while it trains."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


class SlowSetup(Callback):
    """Sleeps in its `setup`, as a callback that downloads or indexes something would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def setup(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


class PausedWhile(Callback):
    """Holds the run at the end of each training step for as long as `path` exists, so that a
    test can act while the run is mid-training (it burns no CPU), then let it finish."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        while self.path.exists():
            time.sleep(0.2)


class OutOfMemoryAt(Callback):
    """Raises the error PyTorch raises when the device's memory runs out, at the start of
    training step `at` (counted from 1), as a batch too large for the device would."""

    def __init__(self, at: int, allocator: str = "cuda") -> None:
        self.at, self.allocator = at, allocator

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.global_step + 1 != self.at:
            return
        if self.allocator == "cpu":  # the CPU allocator raises a plain RuntimeError
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate "
                "memory: you tried to allocate 21474836480 bytes. Error code 12 (Cannot allocate "
                "memory)"
            )
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.21 GiB is free."
        )
