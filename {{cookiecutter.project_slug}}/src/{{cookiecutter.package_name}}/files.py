"""Files written whole: a kill leaves the old file or the new one, never a part."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(text: str, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync it and rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
