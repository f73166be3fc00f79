"""One live command per run directory. The lock is a POSIX record lock on `<run dir>/.lock`: the
operating system drops it when its holder ends, however it ends, and forked DataLoader workers
do not inherit it. The file names the holder: its process id and host, and its SLURM job where it
runs in one (`<pid> on <host> (SLURM job <id>)`), for the refusal message and for a search that
waits for a trial's job left running by an earlier launch."""

from __future__ import annotations

import fcntl
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

LOCK_NAME = ".lock"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
SLURM_JOB = re.compile(r"\(SLURM job (\S+)\)")


class FolderInUse(ConfigError):
    """The folder is held by a live command: the message names it."""


def slurm_job() -> str | None:
    """This process's SLURM job as squeue shows it (`<array job>_<task>` for a job of an array,
    as a sweep's jobs are), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def this_holder() -> str:
    job = slurm_job()
    return f"{os.getpid()} on {socket.gethostname()}" + (f" (SLURM job {job})" if job else "")


def holder_job(owner: str) -> str | None:
    """The SLURM job named in a holder's record (`holder`), if any."""
    found = SLURM_JOB.search(owner)
    return found.group(1) if found else None


def first_process() -> bool:
    """The process that owns the run directory: rank 0 of a multi-process run (its other ranks
    share the directory with it)."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


def holder(folder: Path) -> str | None:
    """Who holds `folder`'s lock ("<pid> on <host>", with " (SLURM job <id>)" inside a SLURM
    job), or None when no live process does."""
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
    with held(folder / LOCK_NAME, str(folder), "a command still running there", elsewhere):
        yield


@contextmanager
def held(lock: Path, what: str, doing: str, elsewhere: str) -> Iterator[None]:
    """Hold the lock file `lock` (made if missing) for `what`, or refuse with one line: `what` is
    in use by the process holding it (`doing` says what that is), and `elsewhere`."""
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
            job = holder_job(owner)
            stop = f"scancel {job}" if job else f"kill {owner.split()[0] if owner else '<pid>'}"
            raise FolderInUse(
                f"{what} is in use by process {owner or 'another process'} ({doing}): wait for "
                f"it to end, stop it ({stop}), or {elsewhere}"
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{this_holder()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)
