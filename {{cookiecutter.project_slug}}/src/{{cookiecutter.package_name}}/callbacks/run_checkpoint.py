from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from .exact_resume import mid_window
from .run_config import RunConfigInCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, except that:

    - the checkpoint a run resumed from goes like any other once `save_top_k` newer ones exist.
      Lightning keeps it for ever: files piled up across repeated kills, and a run resumed from
      its best checkpoint kept it beside the next best;
    - with `save_weights_only=true` the checkpoint still holds the run's config (Lightning calls
      no callback's `on_save_checkpoint` for a weights-only save), so that eval, predict, export
      and serve rebuild the model from it as from any other;
    - a save that Lightning put off until the next validation (due at an epoch's last batch, or
      before the monitored metric exists) is in the checkpoint's state, so that a run resumed
      before that validation still makes it there. Lightning forgets it, and the resumed run
      ended without a checkpoint file that the uninterrupted run had.
    """

    paying_deferred_save = False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if mid_window(trainer):
            return  # a checkpoint here would hold none of the window's gradients
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.paying_deferred_save = bool(getattr(self, "_defer_save_until_validation", False))
        try:
            super().on_validation_end(trainer, pl_module)
        finally:
            self.paying_deferred_save = False

    def state_dict(self) -> dict[str, Any]:
        deferred = bool(getattr(self, "_defer_save_until_validation", False))
        owed = deferred and not self.paying_deferred_save  # the save being written pays it
        return {**super().state_dict(), "save_deferred_to_validation": owed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._defer_save_until_validation = bool(
            state_dict.get("save_deferred_to_validation", False)
        )

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if not self.save_weights_only:
            super()._save_checkpoint(trainer, filepath)
            return
        connector = trainer._checkpoint_connector
        dump = connector.dump_checkpoint

        def with_run_config(weights_only: bool | None = None) -> dict[str, Any]:
            checkpoint = dump(weights_only)
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, RunConfigInCheckpoint):
                    callback.on_save_checkpoint(trainer, trainer.lightning_module, checkpoint)
            return checkpoint

        connector.dump_checkpoint = with_run_config  # type: ignore[method-assign]
        try:
            super()._save_checkpoint(trainer, filepath)
        finally:
            del connector.dump_checkpoint

    def _should_remove_checkpoint(self, trainer: L.Trainer, previous: str, current: str) -> bool:
        inside = Path(self.dirpath or "").absolute() in Path(previous).absolute().parents
        return previous != current and inside
