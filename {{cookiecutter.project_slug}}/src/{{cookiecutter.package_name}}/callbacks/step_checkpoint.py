from __future__ import annotations

from typing import Any

import lightning as L

from .exact_resume import mid_window, no_resumable_save_here
from .run_checkpoint import RunCheckpoint


class StepCheckpoint(RunCheckpoint):
    """A RunCheckpoint for `every_n_train_steps` / `train_time_interval`, except that a save due
    where a checkpoint would not resume exactly is made at the next step where one would: not at
    a step that a validation follows (Lightning resumes a checkpoint taken there as if the
    validation had run, and early stopping then misses it), not at an epoch's last batch
    (Lightning resumes it one epoch behind), and never inside a gradient accumulation window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owed = False

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if mid_window(trainer):
            return
        every = self._every_n_train_steps
        if no_resumable_save_here(trainer):
            self.owed |= every >= 1 and trainer.global_step % every == 0
            return
        if self.owed and not self._should_skip_saving_checkpoint(trainer):
            self.owed = False
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "owed": self.owed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.owed = bool(state_dict.get("owed", False))
