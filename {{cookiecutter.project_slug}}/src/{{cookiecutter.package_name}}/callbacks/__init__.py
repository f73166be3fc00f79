"""Callbacks of this project; Lightning's own are configured in `configs/callbacks`."""

from .exact_resume import ExactResume
from .model_summary import ModelSummary
from .monitored_metric import MonitoredMetricLogged
from .non_finite import NonFiniteGuard
from .preemption import Preempted, Preemption
from .run_checkpoint import RunCheckpoint
from .run_config import RunConfigInCheckpoint
from .step_checkpoint import StepCheckpoint
from .throughput import Throughput

__all__ = [
    "ExactResume",
    "ModelSummary",
    "MonitoredMetricLogged",
    "NonFiniteGuard",
    "Preempted",
    "Preemption",
    "RunCheckpoint",
    "RunConfigInCheckpoint",
    "StepCheckpoint",
    "Throughput",
]
