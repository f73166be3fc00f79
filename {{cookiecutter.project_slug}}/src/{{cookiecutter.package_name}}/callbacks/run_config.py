from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class RunConfigInCheckpoint(Callback):
    """Stores the data and model config (plain values) in every checkpoint, so that `eval` can
    rebuild the model and its data from the checkpoint alone."""

    def __init__(self, run_config: dict[str, Any]) -> None:
        self.run_config = run_config

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["run_config"] = self.run_config
