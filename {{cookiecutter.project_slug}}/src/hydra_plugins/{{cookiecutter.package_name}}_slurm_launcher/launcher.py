from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import HydraException
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)
from omegaconf import OmegaConf, open_dict

from {{ cookiecutter.package_name }}.sweeps.queued import (
    record_queued,
)
from {{ cookiecutter.package_name }}.sweeps.returns import (
    UnreadableReturn,
    read_job_return,
    write_job_return,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    read_json,
    record_job_ended_outside,
    returned_to_sweeper,
)

from ._jobs import (
    Ended,
    Finished,
    Progress,
    Unschedulable,
    ended_as,
    pause,
    queue_states,
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
# A job that neither squeue nor sacct knows any longer (UNKNOWN), or that was preempted and not
# requeued, for this long has ended, as LOST or PREEMPTED.
LOST_AFTER_S = 120.0
LINGERING = {"UNKNOWN": "LOST", "PREEMPTED": "PREEMPTED"}


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


def remove_unsubmitted(submitit_dir: Path, written_before: set[Path], sweep_dir: Path) -> None:
    """The files submitit wrote for jobs that sbatch refused, and the sweep folder where that
    leaves no more than Hydra's record of the sweep."""
    written = set(submitit_dir.iterdir()) - written_before if submitit_dir.is_dir() else set()
    for path in written:
        if path.is_file():
            path.unlink()
    with contextlib.suppress(OSError):
        submitit_dir.rmdir()  # where it is empty
    remove_unstarted_sweep(sweep_dir)


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


def gpu_partitions() -> tuple[list[str], str | None] | None:
    """The partitions whose nodes have GPUs (`sinfo`'s generic resources), and the default
    partition; None where sinfo does not answer."""
    try:
        listed = subprocess.run(
            ["sinfo", "--noheader", "--format=%P|%G"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    with_gpus, default = set(), None
    for line in listed.stdout.splitlines():
        name, _, resources = line.strip().partition("|")
        if name.endswith("*"):
            name = default = name.rstrip("*")
        if "gpu" in resources:
            with_gpus.add(name)
    return sorted(with_gpus), default


def cpu_only_advice(gpus: int | None, partition: str | None) -> str:
    """What makes the jobs CPU-only, where they ask for GPUs that their partition does not have;
    "" where they ask for none, or it has them."""
    if not gpus:
        return ""
    asked = f"The jobs ask for {gpus} GPU{'s' * (gpus > 1)} per node (trainer.devices={gpus})"
    cpu_only = "add trainer=cpu (a CPU run asks for no GPU)"
    known = gpu_partitions()
    if known is None:
        return f"{asked}: on nodes without GPUs, {cpu_only}. "
    with_gpus, default = known
    if (partition or default) in with_gpus:
        return ""
    if not with_gpus:
        return f"{asked} and no partition of this cluster has one (sinfo): {cpu_only}. "
    where = f"partition {partition}" if partition else f"the default partition ({default})"
    return (
        f"{asked} and {where} has none: {cpu_only}, or pick a partition with GPUs "
        f"(hydra.launcher.partition={' or '.join(with_gpus)}). "
    )


class JobEndedOutside(RuntimeError):
    """A job that SLURM ended (cancelled, out of time, its node failed) before it had a result."""


class SlurmLauncher(SubmititSlurmLauncher):
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None
        problem = cluster_problem()
        if problem:
            remove_unstarted_sweep(Path(str(self.config.hydra.sweep.dir)))
            raise SweepCannotStart(
                f"no SLURM cluster answers here ({problem}): launch the sweep from a node of the "
                "cluster (a login node), or pick another hydra/launcher."
            )
        if not accounting_works() and not reads_states_from_squeue():
            log.info("SLURM accounting is off here (sacct fails): job states come from squeue.")
            read_states_from_squeue()
        numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
        folders = [
            self.job_dir(number, overrides)
            for number, overrides in zip(numbers, job_overrides, strict=True)
        ]
        jobs = self.submit(job_overrides, numbers)
        job_dirs = {job.job_id: folder for job, folder in zip(jobs, folders, strict=True)}
        # First of all: a search run again after this driver is killed finds its jobs by these.
        for job_id, folder in job_dirs.items():
            record_queued(folder, job_id)
        for job, number, overrides in zip(jobs, numbers, job_overrides, strict=True):
            shown = " ".join(filter_overrides(overrides))
            log.info(f"\t#{number} : {shown} -> SLURM job {job.job_id}")
        ended = self.wait_for(jobs, [f"Job #{number}" for number in numbers], job_dirs)
        return [
            self.returned(job, number, overrides, job_dirs[job.job_id], ended[job.job_id])
            for job, number, overrides in zip(jobs, numbers, job_overrides, strict=True)
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """In the job: Hydra's run of the task, and its outcome written as JSON in the job's
        folder (sweeps/returns.py), which the launcher reads instead of submitit's pickle."""
        returned: JobReturn = super().__call__(*args, **kwargs)
        write_job_return(returned)
        return returned

    def job_dir(self, number: int, overrides: Sequence[str]) -> Path:
        assert self.config is not None and self.hydra_context is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.num = number
        sweep = config.hydra.sweep
        return Path(os.path.abspath(Path(str(sweep.dir), str(sweep.subdir))))

    def returned(
        self, job: Any, number: int, overrides: Sequence[str], job_dir: Path,
        result: Finished | Ended,
    ) -> JobReturn:  # fmt: skip
        """What goes back to the sweeper: the job's own record, or how SLURM ended it."""
        if isinstance(result, Finished):
            try:
                return read_job_return(job_dir, list(overrides))
            except UnreadableReturn as error:
                result = Ended("FAILED", f" outside the run: {error}")
        return self.ended_outside(job, number, overrides, job_dir, result)

    def submit(self, job_overrides: Sequence[Sequence[str]], numbers: range) -> list[Any]:
        """One SLURM job per job of the sweep, submitted as hydra-submitit-launcher submits them
        (an array); sbatch refusing them ends the sweep in one line."""
        import submitit

        assert self.config is not None
        init_keys = ("submitit_folder", "max_num_timeout")
        executor = submitit.AutoExecutor(
            cluster="slurm", folder=self.params["submitit_folder"],
            slurm_max_num_timeout=self.params["max_num_timeout"],
        )  # fmt: skip
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            key if key in shared else f"slurm_{key}": value
            for key, value in self.params.items() if key not in init_keys
        })  # fmt: skip
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        submitit_dir = Path(str(self.params["submitit_folder"]).split("%j")[0])
        written_before = set(submitit_dir.iterdir()) if submitit_dir.is_dir() else set()
        state = Singleton.get_state()
        job_params = [
            (list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", state)
            for number, overrides in zip(numbers, job_overrides, strict=True)
        ]
        try:
            # submitit prints sbatch's complaint as well as raising it: it is said once, below.
            with contextlib.redirect_stderr(io.StringIO()):
                return list(executor.map_array(self, *zip(*job_params, strict=True)))
        except Exception as error:
            refused = [
                line.removeprefix("sbatch: error: ")
                for line in str(error).splitlines()
                if line.startswith("sbatch: error: ")
            ]
            if not refused:
                raise
            remove_unsubmitted(submitit_dir, written_before, sweep_dir)
            raise SweepCannotStart(
                f"sbatch refused the sweep's jobs ({'; '.join(refused)}). {self.cpu_advice()}"
                "Lower hydra.launcher.cpus_per_task / mem_gb / gpus_per_node / timeout_min, or "
                "pick another hydra.launcher.partition (sinfo lists what each has)."
            ) from error

    def cpu_advice(self) -> str:
        return cpu_only_advice(self.params.get("gpus_per_node"), self.params.get("partition"))

    def wait_for(
        self, jobs: list[Any], labels: list[str], job_dirs: dict[str, Path]
    ) -> dict[str, Finished | Ended]:
        """Whether each job finished, or how it ended without a result; one line per job and change of
        state meanwhile. Jobs that SLURM will never start (UNSCHEDULABLE_AFTER_S seconds pending
        for a reason in NEVER_STARTS) are cancelled, and end the sweep."""
        progress = Progress({job.job_id: label for job, label in zip(jobs, labels, strict=True)})
        unschedulable = Unschedulable(NEVER_STARTS, UNSCHEDULABLE_AFTER_S)
        ended: dict[str, Finished | Ended] = {}
        lingering_since: dict[tuple[str, str], float] = {}
        last_seen: dict[str, str] = {}
        while True:
            waiting = [job for job in jobs if job.job_id not in ended]
            answered = queue_states(job.job_id for job in waiting)
            seen = answered or {}
            for job in waiting:
                if job.job_id in seen:
                    state = last_seen[job.job_id] = seen[job.job_id].state
                else:
                    # squeue forgets an ended job after a while (MinJobAge); sacct, if kept,
                    # does not.
                    state = job.state.split(" ")[0]
                    was_pending = last_seen.get(job.job_id, "PENDING") == "PENDING"
                    if answered is not None and state == "UNKNOWN" and was_pending:
                        state = "CANCELLED"  # a pending array task scancel'ed leaves no record
                gone = False
                if state in LINGERING:
                    since = lingering_since.setdefault((job.job_id, state), time.monotonic())
                    gone = time.monotonic() - since > LOST_AFTER_S
                result = ended_as(job, LINGERING[state] if gone else state, gone)
                if result is None:
                    progress.saw(job.job_id, seen.get(job.job_id))
                    continue
                ended[job.job_id] = result
                progress.end(job.job_id, status_of(result, job_dirs[job.job_id]))
            if len(ended) == len(jobs):
                return ended
            stuck = unschedulable.saw(seen)
            if stuck:
                self.cancel_unschedulable(stuck)
            pause([job for job in jobs if job.job_id not in ended], POLL_S)

    def cancel_unschedulable(self, stuck: dict[str, str]) -> None:
        subprocess.run(["scancel", *sorted(stuck)], capture_output=True, timeout=60)
        raise SweepCannotStart(
            f"SLURM will never start job(s) {', '.join(sorted(stuck))} "
            f"(Reason={', '.join(sorted(set(stuck.values())))}): they ask for more than the "
            "partition or its nodes have, or for an account, QOS or constraint that does not "
            f"exist. {self.cpu_advice()}Lower hydra.launcher.cpus_per_task / mem_gb / "
            "gpus_per_node / timeout_min, or pick another hydra.launcher.partition (sinfo lists "
            "what each has). The jobs were cancelled."
        )

    def ended_outside(
        self, job: Any, number: int, overrides: Sequence[str], job_dir: Path, ended: Ended
    ) -> JobReturn:
        """A job that SLURM ended before it had a result: SLURM's state is recorded in its
        folder for the summary, and it goes back to the sweeper as a failure."""
        assert self.config is not None
        if ended.state == "CANCELLED":
            reason = f"SLURM job {job.job_id} ended CANCELLED; the same command runs it again"
        elif ended.state == "LOST":
            reason = f"SLURM no longer knows job {job.job_id}, and it left no result"
        else:
            reason = f"SLURM job {job.job_id} ended {ended.state}{ended.detail}"
        reason += f" (its log: {job.paths.stderr})"
        record_job_ended_outside(job_dir, list(overrides), ended.state, reason)
        failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
        failed.return_value = JobEndedOutside(reason)
        return returned_to_sweeper(self.config, failed)


def status_of(result: Finished | Ended, job_dir: Path) -> str:
    """What the summary says of an ended job: the status it recorded, else SLURM's state."""
    if isinstance(result, Ended):
        return result.state
    return str(read_json(job_dir / "job_status.json").get("status", "FINISHED"))
