"""Files written whole (a kill leaves the old file or the new one, never a part), and paths from
the command line made absolute."""

from __future__ import annotations

import glob
import os
from pathlib import Path


def write_text_atomically(text: str, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync it and rename it over `path`. What a
    killed write to `path` left behind goes first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)


def remove_stale_temporaries(path: Path) -> None:
    """Partial files that killed writes to `path` left behind (their process is gone)."""
    for temporary in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = temporary.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            temporary.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def absolute(path: str | Path) -> Path:
    """`path` made absolute, its links followed. A loop of links (which `Path.resolve` reports as
    a RuntimeError before Python 3.13) stays as it is, for the check of what the path holds to
    report."""
    path = Path(path).expanduser()
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return Path(os.path.abspath(path))
