from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from ..data.base import ResumableSampler

log = logging.getLogger(__name__)


def random_states() -> dict[str, Any]:
    """The generators that training draws from (dropout, augmentation), as plain values and
    tensors, so the checkpoint still loads with weights_only=True."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return states
    numpy_state: Any = np.random.get_state()
    kind, keys, position, has_gauss, cached_gauss = numpy_state
    # int64, not uint32: Lightning's lazy loader (FSDP) cannot read uint32 storages.
    keys = torch.from_numpy(keys.astype(np.int64))
    states["numpy"] = (kind, keys, position, has_gauss, cached_gauss)
    return states


def set_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, position, has_gauss, cached_gauss = states["numpy"]
        keys = keys.numpy().astype(np.uint32)
        np.random.set_state((kind, keys, position, has_gauss, cached_gauss))


class ExactResume(Callback):
    """A resumed run continues exactly where its checkpoint was taken.

    Every checkpoint records how many batches of the current epoch were trained and the random
    generators' states. On resume, the training sampler (`data.base.ResumableSampler`) skips the
    batches already trained, and the generators are restored right before the first training step,
    so the batches and dropout masks match an uninterrupted run. (All ranks draw alike after
    `seed_everything`, so rank 0's generator states stand for all.)
    """

    def __init__(self) -> None:
        self.batches_done = 0
        self.resumed_epoch: int | None = None
        self.pending: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Lightning resumes mid-epoch without calling `on_train_epoch_start`; an epoch that the
        checkpoint finished is not resumed at all, and the next one starts from its first batch."""
        if self.pending is None or self.pending["epoch"] != trainer.current_epoch:
            return
        done = int(self.pending["batches_done"])
        if not 0 < done < trainer.num_training_batches:
            return
        self.batches_done, self.resumed_epoch = done, trainer.current_epoch
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            sampler.skip = done * int(getattr(loader, "batch_size", 1) or 1)
        else:
            log.warning(
                "The training DataLoader has no ResumableSampler: this resumed epoch starts from "
                "its first batch, so some samples are seen twice."
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != self.resumed_epoch:
            self.batches_done = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Counted at the start, so a checkpoint saved by any callback at the batch's end counts
        it as done."""
        self.batches_done += 1
        if self.pending is not None:
            set_random_states(self.pending["random_states"])
            self.pending = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["exact_resume"] = {
            "epoch": trainer.current_epoch,
            "batches_done": self.batches_done,
            "random_states": random_states(),
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.pending = checkpoint.get("exact_resume")
