"""Hydra writes a command's config into its run directory (`.hydra/config.yaml`, `hydra.yaml`,
`overrides.yaml`) before the command has checked anything. A refused command puts back what it
replaced there, so that the record of a run never shows a command that was refused from it."""

from __future__ import annotations

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
    """The record as the refused command found it: earlier files restored, new ones removed."""
    for path, content in replaced.items():
        try:
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)
        except OSError:
            pass  # a folder that cannot be written: nothing was replaced there either
    replaced.clear()
