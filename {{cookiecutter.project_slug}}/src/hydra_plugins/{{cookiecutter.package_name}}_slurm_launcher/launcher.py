from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn
from hydra.errors import HydraException
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)

log = logging.getLogger(__name__)

# Pending reasons that no amount of waiting changes: the job asks for more than the partition,
# its nodes or the account allow, or for something that does not exist.
NEVER_STARTS = (
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
    "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "ReqNodeNotAvail",
    "Resources_Unavailable", "MaxCpuPerAccount", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob",
    "QOSMaxMemoryPerJob", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit",
)  # fmt: skip
UNSCHEDULABLE_AFTER_S = float(os.environ.get("SLURM_UNSCHEDULABLE_AFTER_S", "60"))
POLL_S = 5.0


class SweepCannotStart(HydraException):
    """Jobs of the sweep that the scheduler will never start; they were cancelled."""


def accounting_works() -> bool:
    try:
        checked = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return checked.returncode == 0


def remove_unstarted_sweep(folder: Path) -> None:
    """The sweep folder, while it holds no more than Hydra's record of the sweep, and the folders
    above it that it leaves empty."""
    folder = Path(os.path.abspath(folder))
    if not folder.is_dir() or {path.name for path in folder.iterdir()} - {"multirun.yaml"}:
        return
    (folder / "multirun.yaml").unlink(missing_ok=True)
    folder.rmdir()
    for parent in folder.parents:
        if parent == Path.cwd() or any(parent.iterdir()):
            break
        parent.rmdir()


def cluster_problem() -> str | None:
    """None where a SLURM controller answers this machine, else what `sinfo` said."""
    try:
        probe = subprocess.run(
            ["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=60
        )
    except OSError:
        return "sinfo is not installed"
    except subprocess.TimeoutExpired:
        return "sinfo had no answer in 60 s"
    if probe.returncode == 0:
        return None
    said = [line.strip() for line in probe.stderr.splitlines() if line.strip()]
    return said[-1] if said else f"sinfo exited with status {probe.returncode}"


def reads_states_from_squeue() -> bool:
    from submitit.slurm import slurm

    return type(slurm.SlurmJob.watcher).__name__ == "SqueueInfoWatcher"


def read_states_from_squeue() -> None:
    """submitit reads job states from `sacct`, which fails on every poll (with a warning each
    time) where the cluster has no accounting database, and so never sees a cancelled job end.
    `squeue --states=all` knows every job the controller still holds (MinJobAge)."""
    from submitit.slurm import slurm

    class SqueueInfoWatcher(slurm.SlurmInfoWatcher):
        def _make_command(self) -> list[str] | None:
            to_check = sorted({x.split("_")[0] for x in self._registered - self._finished})
            if not to_check:
                return None
            return ["squeue", "--noheader", "--states=all", "--format=%i|%T|%N",
                    f"--jobs={','.join(to_check)}"]  # fmt: skip

        def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
            text = string.decode() if isinstance(string, bytes) else string
            return super().read_info("JobID|State|NodeList\n" + text)

    slurm.SlurmJob.watcher = SqueueInfoWatcher(delay_s=600)


def pending_reasons(folder: str) -> dict[str, str]:
    """Job id -> pending reason, for this sweep's jobs (their batch script lies in `folder`)."""
    listed = subprocess.run(
        ["squeue", "--noheader", "--states=PENDING", "--format=%i|%r|%o"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    reasons = {}
    for line in listed.stdout.splitlines():
        job, reason, command = [*line.split("|", 2), "", ""][:3]
        if command.startswith(folder):
            reasons[job] = reason
    return reasons


class Watchdog(threading.Thread):
    """Cancels the sweep's jobs once one of them has waited `UNSCHEDULABLE_AFTER_S` seconds for a
    reason in NEVER_STARTS, so that the launcher's wait for results ends."""

    def __init__(self, folder: str) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.stopped = threading.Event()
        self.never: dict[str, str] = {}

    def run(self) -> None:
        waited: dict[str, float] = {}
        while not self.stopped.wait(POLL_S):
            stuck = {
                job: reason
                for job, reason in pending_reasons(self.folder).items()
                if reason in NEVER_STARTS
            }
            waited = {job: waited.get(job, 0.0) + POLL_S for job in stuck}
            if stuck and max(waited.values()) >= UNSCHEDULABLE_AFTER_S:
                self.never = stuck
                subprocess.run(["scancel", *{job.split("_")[0] for job in stuck}], timeout=30)
                return


class SlurmLauncher(SubmititSlurmLauncher):
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        problem = cluster_problem()
        if problem:
            assert self.config is not None
            remove_unstarted_sweep(Path(str(self.config.hydra.sweep.dir)))
            raise SweepCannotStart(
                f"no SLURM cluster answers here ({problem}): launch the sweep from a node of the "
                "cluster (a login node), or pick another hydra/launcher."
            )
        if not accounting_works() and not reads_states_from_squeue():
            log.info("SLURM accounting is off here (sacct fails): job states come from squeue.")
            read_states_from_squeue()
        folder = str(self.params["submitit_folder"]).split("%j")[0].rstrip("/")
        watchdog = Watchdog(os.path.abspath(folder))
        watchdog.start()
        try:
            return super().launch(job_overrides, initial_job_idx)
        except Exception as error:
            refused = [
                line.removeprefix("sbatch: error: ")
                for line in str(error).splitlines()
                if line.startswith("sbatch: error: ")
            ]
            if refused:
                raise SweepCannotStart(
                    f"sbatch refused the sweep's jobs ({'; '.join(refused)}). Lower "
                    "hydra.launcher.cpus_per_task / mem_gb / gpus_per_node / timeout_min, or "
                    "pick another hydra.launcher.partition (sinfo lists what each has)."
                ) from error
            if not watchdog.never:
                raise
            reasons = sorted(set(watchdog.never.values()))
            raise SweepCannotStart(
                f"SLURM will never start job(s) {', '.join(sorted(watchdog.never))} "
                f"(Reason={', '.join(reasons)}): they ask for more than the partition or its "
                "nodes have, or for an account, QOS or constraint that does not exist. Lower "
                "hydra.launcher.cpus_per_task / mem_gb / gpus_per_node / timeout_min, or pick "
                "another hydra.launcher.partition (sinfo lists what each has). The jobs were "
                "cancelled."
            ) from error
        finally:
            watchdog.stopped.set()
