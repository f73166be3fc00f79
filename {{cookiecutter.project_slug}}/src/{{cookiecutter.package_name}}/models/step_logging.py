"""Logging training-step values only when Lightning writes them out."""

from __future__ import annotations

import lightning as L


def is_logging_step(module: L.LightningModule) -> bool:
    """Whether Lightning sends step values to the loggers after this training step: every
    `log_every_n_steps` steps, and on an epoch's last batch so that short runs report too. Each
    `self.log` call costs the host about a millisecond, which a small model's step feels, and a
    value logged on the other steps would reach no logger."""
    trainer = module.trainer
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning, not declared
    return (trainer.global_step + 1) % every == 0 or trainer.is_last_batch or trainer.should_stop
