from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, except that the checkpoint a run resumed from goes like any
    other once `save_top_k` newer ones exist. Lightning keeps it for ever: files piled up across
    repeated kills, and a run resumed from its best checkpoint kept it beside the next best."""

    def _should_remove_checkpoint(self, trainer: L.Trainer, previous: str, current: str) -> bool:
        inside = Path(self.dirpath or "").absolute() in Path(previous).absolute().parents
        return previous != current and inside
