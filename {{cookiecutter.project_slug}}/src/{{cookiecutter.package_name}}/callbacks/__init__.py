"""Callbacks of this project; Lightning's own are configured in `configs/callbacks`."""

from .run_config import RunConfigInCheckpoint
from .throughput import Throughput

__all__ = ["RunConfigInCheckpoint", "Throughput"]
