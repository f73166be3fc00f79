"""Hydra writes a command's config into its run directory (`.hydra/config.yaml`, `hydra.yaml`,
`overrides.yaml`) before the command has checked anything. A refused command puts back what it
replaced there, so that the record of a run never shows a command that was refused from it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import hydra.core.utils

replaced: dict[Path, bytes | None] = {}


def keep_what_hydra_replaces() -> None:
    save = hydra.core.utils._save_config

    def saving(cfg: Any, filename: str, output_dir: Path) -> None:
        path = Path(output_dir) / filename
        if path not in replaced:
            try:
                replaced[path] = path.read_bytes()
            except OSError:  # not there yet
                replaced[path] = None
        save(cfg, filename, output_dir)

    hydra.core.utils._save_config = saving


def put_back() -> None:
    """The files the refused command replaced, as it found them. (Where there were none, the run
    directory is the command's own, which goes once nothing but Hydra's files is in it.)"""
    for path, content in replaced.items():
        if content is not None:  # a folder that cannot be written had nothing replaced either
            with contextlib.suppress(OSError):
                path.write_bytes(content)
    replaced.clear()
