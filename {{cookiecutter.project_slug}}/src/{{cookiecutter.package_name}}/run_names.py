"""Run directories named by the command, not the clock, so the same command finds its run again.
Imported by the CLI before Hydra starts: no torch here."""

from __future__ import annotations

import hashlib
import re

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
MAX_LENGTH = 100


def run_name(explicit: str | None, override_dirname: str) -> str:
    """`run_name` when given; else the overrides (`key=value,...`, sorted by Hydra) made safe for
    a folder name, shortened with a hash when long; `default` for no overrides."""
    if explicit:
        return UNSAFE.sub("_", str(explicit))
    name = UNSAFE.sub("_", override_dirname) or "default"
    if len(name) <= MAX_LENGTH:
        return name
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:10]
    return f"{name[: MAX_LENGTH - 11]}-{digest}"


def resolve_run_name(*, _root_: DictConfig) -> str:
    """`${run_name:}` in hydra.run.dir: this command's run name."""
    return run_name(_root_.get("run_name"), HydraConfig.get().job.override_dirname)


def register_run_name_resolver() -> None:
    OmegaConf.register_new_resolver("run_name", resolve_run_name, replace=True)
