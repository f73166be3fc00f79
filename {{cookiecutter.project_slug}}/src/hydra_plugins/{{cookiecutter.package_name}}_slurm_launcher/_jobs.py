"""What a sweep's SLURM jobs are doing while the launcher waits for them: one `squeue` call per
poll for all of them, one log line per job and change of state, and how each one ended. Small
pieces (of job ids, or of submitit jobs), so that whatever waits for SLURM jobs (the launcher, a
search that adopts a job it started before) can use them. The module's name starts with `_`:
Hydra's plugin scan skips it."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The states a job ends in (SLURM's job state codes).
ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
         "TIMEOUT")  # fmt: skip
# States a job passes through on its way on: not worth a line.
PASSING = ("COMPLETING", "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT")
# A pending job whose reason SLURM has not given yet.
NO_REASON = ("", "None")


@dataclass(frozen=True)
class Seen:
    """A job as `squeue` shows it."""

    state: str
    reason: str = ""
    nodes: str = ""


def queue_states(job_ids: Iterable[str]) -> dict[str, Seen] | None:
    """Each of these jobs (`123`, or an array task `123_4`) that the controller still holds, in
    one `squeue` call; None where squeue did not answer (a controller that does not, or ids it
    has all forgotten). A pending array task that `scancel` ended is not held at all: SLURM
    keeps no record of it."""
    main_ids = sorted({job.split("_")[0] for job in job_ids})
    if not main_ids:
        return {}
    try:
        listed = subprocess.run(
            ["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T|%r|%N",
             f"--jobs={','.join(main_ids)}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    seen = {}
    for line in listed.stdout.splitlines():
        job, state, reason, nodes = [*line.strip().split("|", 3), "", "", ""][:4]
        seen[job] = Seen(state.split()[0] if state else "UNKNOWN", reason, nodes)
    return seen


def alive(job_id: str) -> Seen | None:
    """How SLURM shows the job where it has not ended (pending, running, requeued...); None
    where it has, or squeue does not know it or does not answer."""
    seen = (queue_states([job_id]) or {}).get(job_id)
    return seen if seen is not None and seen.state not in ENDED else None


class Progress:
    """One log line per job and change of state: pending (with SLURM's reason, once it gives
    one), running (on which nodes), requeued, ..., and the status it ended with."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels  # SLURM job id -> what the user calls the job ("Job #3")
        self.shown: dict[str, str] = {}
        self.ended: set[str] = set()

    def saw(self, job_id: str, seen: Seen | None) -> None:
        if seen is None or seen.state in (*PASSING, *ENDED, "UNKNOWN"):
            return
        state = seen.state
        if self.shown.get(job_id) == state:
            return
        if state == "PENDING" and seen.reason in NO_REASON:
            return
        self.shown[job_id] = state
        detail = {"PENDING": f" ({seen.reason})", "RUNNING": f" on {seen.nodes}" * bool(seen.nodes)}
        self.say(job_id, state + detail.get(state, ""))

    def end(self, job_id: str, status: str) -> None:
        self.ended.add(job_id)
        self.say(job_id, f"{status} ({len(self.ended)} of {len(self.labels)} jobs ended)")

    def say(self, job_id: str, what: str) -> None:
        log.info("%s (SLURM %s): %s", self.labels[job_id], job_id, what)


class Unschedulable:
    """The jobs that have waited `after_s` seconds or more for a reason that waiting cannot
    change (`reasons`)."""

    def __init__(self, reasons: Iterable[str], after_s: float) -> None:
        self.reasons, self.after_s = tuple(reasons), after_s
        self.since: dict[str, float] = {}

    def saw(self, seen: dict[str, Seen]) -> dict[str, str]:
        """Job id -> reason, for the jobs stuck long enough."""
        now = time.monotonic()
        stuck = {
            job: job_seen.reason
            for job, job_seen in seen.items()
            if job_seen.state == "PENDING" and job_seen.reason in self.reasons
        }
        self.since = {job: self.since.get(job, now) for job in stuck}
        return {job: stuck[job] for job, since in self.since.items() if now - since >= self.after_s}


@dataclass(frozen=True)
class Ended:
    """How a job ended that has no result of its own: SLURM's state, and what else is known."""

    state: str
    detail: str = ""


def has_result(job: Any) -> bool:
    """Whether the submitit job (each of its tasks) has written its result."""
    return all(task.paths.result_pickle.exists() for task in job._sub_jobs or [job])


def pause(jobs: list[Any], seconds: float) -> None:
    """Until the next look at the queue, or until one of the jobs has its result."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not any(has_result(job) for job in jobs):
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


class Finished:
    """A job that wrote its result (read from its folder's job_return.json, not from submitit's
    pickle)."""


# A job that SLURM says has ended may have its result still on its way through a slow disk.
RESULT_WAIT_S = 15.0


def ended_as(job: Any, state: str, gone: bool = False) -> Finished | Ended | None:
    """None while the submitit job runs or waits; once it has ended (SLURM's `state`, or `gone`
    from SLURM's sight), Finished where it wrote its result, or how it ended without one."""
    if not has_result(job):
        if state not in ENDED and not gone:
            return None
        if state not in ("COMPLETED", "FAILED"):
            return Ended(state)
        deadline = time.monotonic() + RESULT_WAIT_S
        while not has_result(job) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not has_result(job):
            return Ended(state, " without a result")
    return Finished()
