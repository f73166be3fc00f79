"""One live command per run directory. The lock is a POSIX record lock on `<run dir>/.lock`: the
operating system drops it when its holder ends, however it ends, and forked DataLoader workers
do not inherit it. The file holds the holder's process id and host, for the refusal message."""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

LOCK_NAME = ".lock"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


def first_process() -> bool:
    """The process that owns the run directory: rank 0 of a multi-process run (its other ranks
    share the directory with it)."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


def holder(folder: Path) -> str | None:
    """Who holds `folder`'s lock ("<pid> on <host>"), or None when no live process does."""
    path = folder / LOCK_NAME
    if not path.is_file():
        return None
    descriptor = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "another process"
    else:
        fcntl.lockf(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)


@contextmanager
def hold(folder: Path, elsewhere: str = "pick another run_name=...") -> Iterator[None]:
    """Hold `folder` for this command, or refuse with one line naming the process holding it
    (and `elsewhere`, how to run somewhere else)."""
    if not first_process():
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
            pid = owner.split()[0] if owner else "<pid>"
            raise ConfigError(
                f"{folder} is in use by process {owner or 'another process'} (a command still "
                f"running there): wait for it to end, stop it (kill {pid}), or {elsewhere}"
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)
