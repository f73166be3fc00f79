from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from ..errors import ConfigError


class MetricNotLogged(ConfigError):
    """The run cannot checkpoint or stop early by the metric it was told to watch."""


def not_logged(metric: str, logged: list[str]) -> MetricNotLogged:
    return MetricNotLogged(
        f"monitor.metric={metric} is not a metric that the run logs ({', '.join(logged)}): set "
        "monitor.metric to one of them."
    )


class MonitoredMetricLogged(Callback):
    """A monitored validation metric (`val...`) that the sanity check's validation did not log is
    refused there, before any training: Lightning finds it missing only at the first validation
    inside fit, an epoch (or `val_check_interval` batches) later. A monitored training metric
    exists only once training logs it; Lightning's own check covers it."""

    def __init__(self, metric: str | None) -> None:
        self.metric = metric

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logged = sorted(trainer.callback_metrics)
        if self.metric and self.metric.startswith("val") and logged and self.metric not in logged:
            raise not_logged(self.metric, logged)
