"""Callbacks of this project; Lightning's own are configured in `configs/callbacks`."""

from .exact_resume import ExactResume
from .run_config import RunConfigInCheckpoint
from .throughput import Throughput

__all__ = ["ExactResume", "RunConfigInCheckpoint", "Throughput"]
