"""A failed run returns only once its other ranks have exited. Lightning's launcher starts the
other ranks on a machine as children of the first, each with its LOCAL_RANK; a failure that
every rank meets (a checkpoint that cannot be written) ends the first one a moment before the
others, whose last lines would otherwise come after the shell's prompt. No torch here."""

from __future__ import annotations

import os
import time
from pathlib import Path

WAIT_SECONDS = 60.0


def is_rank(pid: int) -> bool:
    """Whether the process was started as another rank: Lightning gives each its LOCAL_RANK (a
    DataLoader's workers, forked, have their parent's environment)."""
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(b"LOCAL_RANK=") and v != b"LOCAL_RANK=0" for v in environment)


def child_ranks() -> list[int]:
    """This process's children that run as other ranks (Linux only, else none)."""
    children: list[int] = []
    for task in Path("/proc/self/task").glob("*/children"):
        try:
            children += [int(pid) for pid in task.read_text().split()]
        except OSError:
            continue
    return [pid for pid in children if is_rank(pid)]


def wait_for_other_ranks(seconds: float = WAIT_SECONDS) -> None:
    """Reap the child ranks as they exit, for up to `seconds`."""
    deadline = time.monotonic() + seconds
    waiting = set(child_ranks())
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                waiting.discard(pid)
        time.sleep(0.05)
