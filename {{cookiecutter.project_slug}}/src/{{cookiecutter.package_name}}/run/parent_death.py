"""A process that torchrun started stops when its torchrun agent dies. torchrun's agent watches its
workers, and the other nodes' agents watch it; a worker whose agent was killed alone would train on
unwatched, and the other nodes would wait on it. The kernel sends the worker SIGTERM when its parent
dies (Linux's parent-death signal); the run then saves at its next step and exits 143, its peers
stop with it, and the same command resumes. No torch here."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Exported by scripts/torchrun.sh, which `exec`s torchrun: the agent keeps the script's PID.
AGENT_PID = "TORCHRUN_AGENT_PID"


def stop_when_the_torchrun_agent_dies() -> None:
    """Under torchrun on Linux, ask for SIGTERM when the parent (the agent) dies; if it died
    before this ran (this process is then some other process's child), stop now. (The kernel
    watches the thread that started this process; torchrun's agent starts its workers from its
    main thread, which lives as long as the agent.)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    agent = os.environ.get(AGENT_PID, "")
    if agent.isdigit() and os.getppid() != int(agent):
        os.kill(os.getpid(), signal.SIGTERM)
