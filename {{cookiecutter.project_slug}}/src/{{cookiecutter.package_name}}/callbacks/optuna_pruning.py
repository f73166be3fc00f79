from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class OptunaPruning(Callback):
    """Reports the monitored metric to this job's Optuna trial after each validation, and stops
    the job by raising `optuna.TrialPruned` when the study's pruner judges the trial hopeless.

    `trial` is set by the optuna sweeper (`optuna_trial.*`: storage, study name, trial id and the
    pruner's settings); outside a search this does nothing.
    """

    def __init__(self, monitor: str, trial: Any = None) -> None:
        self.monitor = monitor
        self.trial_info = dict(trial) if trial else {}
        self.trial: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.trial_info.get("storage") or not trainer.is_global_zero:
            return
        import optuna

        pruner_settings = dict(self.trial_info.get("pruner") or {})
        study = optuna.load_study(
            study_name=self.trial_info["study_name"],
            storage=self.trial_info["storage"],
            pruner=optuna.pruners.MedianPruner(**pruner_settings)
            if pruner_settings
            else optuna.pruners.NopPruner(),
        )
        self.trial = optuna.trial.Trial(study, int(self.trial_info["trial_id"]))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if self.trial is None or trainer.sanity_checking or value is None:
            return
        self.trial.report(float(value), step=trainer.global_step)
        if self.trial.should_prune():
            import optuna

            raise optuna.TrialPruned(
                f"trial {self.trial.number} pruned at step {trainer.global_step}: "
                f"{self.monitor}={float(value):.4g}"
            )
