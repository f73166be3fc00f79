"""Ending the loader's worker processes at exit (torch-free: the stop signals' handler uses it)."""

from __future__ import annotations

import multiprocessing


def kill_daemon_children() -> None:
    """DataLoader workers ignore the stop signals (`base.init_worker`), so that a signal to the
    whole process group reaches the run first. Python's exit handler ends daemonic children with
    SIGTERM and then waits for them, which would be for ever: they are killed here."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()
