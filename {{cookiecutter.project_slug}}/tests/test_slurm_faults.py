"""Faults of a cluster against a real scheduler (the single-node SLURM of scripts/local_slurm.py):
a time-limit warning that comes before a start of the job has anything to save, and a node that
fails under a running job."""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from .killing import SMALL_RUN, assert_same_outcome, fault, run, run_dir
from .test_slurm import queue, sbatch, wait_for

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_state(job: str, env: dict[str, str]) -> str:
    states = {row[0]: row[1] for row in queue(env, "%i", "%T")}
    return states.get(job, "UNKNOWN")


def first_start_ends(job: str, env: dict[str, str], timeout: float = 180.0) -> str:
    """The job's state once its first start is over: PENDING where it was requeued, or how it
    ended."""
    deadline = time.monotonic() + timeout
    started = False
    while time.monotonic() < deadline:
        state = job_state(job, env)
        started |= state in ("RUNNING", "COMPLETING")
        if state in ENDED or (started and state == "PENDING"):
            return state
        time.sleep(0.5)
    raise AssertionError(f"the first start of job {job} did not end within {timeout:.0f} s")


def job_log(folder: Path, job: str) -> str:
    (output,) = folder.glob(f"*-{job}.out")
    return output.read_text()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_warned_in_its_sanity_check_trains_to_a_step_it_saves_then_requeues(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """SIGUSR1 in the sanity check of the job's first start, before there is anything to save:
    requeued there, the job started over with nothing gained (and a job warned as early on every
    start, as `--time=1 --signal=USR1@55` is on a loaded node, never trained). The run trains on
    to its first step that can be saved, saves, requeues, and ends as the same job left alone."""
    warned = [*SMALL_RUN, *fault("sanity_check", 1, tmp_path / "fired", "SIGUSR1")]
    reference = sbatch(tmp_path / "reference", slurm_cluster, *SMALL_RUN, tasks=1)
    job = sbatch(tmp_path / "warned", slurm_cluster, *warned, tasks=1, options=("--time=3",))
    assert wait_for(reference, slurm_cluster) == "COMPLETED"
    assert wait_for(job, slurm_cluster) == "COMPLETED", job_log(tmp_path / "warned", job)[-3000:]
    log = job_log(tmp_path / "warned", job)
    assert "SIGUSR1 during the sanity check, before this start had anything to save" in log
    stops = re.findall(r"Stopped: SIGUSR1 (.*)", log)
    assert len(stops) == 1 and "nothing new to save" not in stops[0], log[-3000:]
    (saved,) = re.findall(r"at step (\d+): saved (\S+); requeued the job", stops[0])
    assert int(saved[0]) >= 1, "the start that was warned trained and saved a step"
    assert log.count("Requeued SLURM job") == 1 and "Resuming from" in log
    assert_same_outcome(tmp_path / "reference", tmp_path / "warned")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_time_limit_too_short_for_the_start_up_ends_the_job_in_one_line_unrequeued(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`--time=1 --signal=USR1@55`, warned in the sanity check, and a first step that takes two
    minutes: the start cannot reach a step it could save before the limit, so it is not requeued
    to start over; it ends, before SLURM's limit does, with one line that says what to set."""
    command = [*SMALL_RUN, *fault("sanity_check", 1, tmp_path / "fired", "SIGUSR1"),
               "+callbacks.slow._target_=tests.faults.SlowSteps", "+callbacks.slow.seconds=120"]  # fmt: skip
    job = sbatch(tmp_path, slurm_cluster, *command, tasks=1,
                 options=("--time=1", "--signal=USR1@55"))  # fmt: skip
    state = first_start_ends(job, slurm_cluster)
    log = job_log(tmp_path, job)
    assert state == "FAILED", f"{state}:\n{log[-3000:]}"
    assert "Requeued SLURM job" not in log and "Stopped:" not in log
    (line,) = [line for line in log.splitlines() if line.startswith("error: ")]
    assert "time limit for this job (1:00) is too short for its start-up" in line
    assert "had not reached a step it could save" in line and "longer --time" in line
    assert "Traceback" not in log


def running(job: str, env: dict[str, str], timeout: float = 120.0) -> None:
    """Returns in the poll (every 50 ms) that first sees the job RUNNING."""
    deadline = time.monotonic() + timeout
    while job_state(job, env) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start within {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.1, 0.3, 1.0])
def test_a_warning_at_any_moment_of_a_jobs_first_second_requeues_it(
    delay: float, slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`scancel --signal=USR1` 0.1, 0.3 and 1 s after the poll that first sees the job RUNNING:
    its task is starting Python, importing, or setting up. The run takes the warning on to its
    first step that can be saved, saves, requeues and finishes. (Sent in that first poll, it
    lands before the job's step has tasks, and SLURM delivers it to no process, or while Python
    itself starts: `test_stop_signals` sends it then, through the sbatch script's task shell.)"""
    job = sbatch(tmp_path, slurm_cluster, *SMALL_RUN, tasks=1)
    running(job, slurm_cluster)
    time.sleep(delay)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster, check=True, timeout=30)
    state = wait_for(job, slurm_cluster)
    log = job_log(tmp_path, job)
    assert state == "COMPLETED" and "User defined signal" not in log, f"{state}:\n{log[-3000:]}"
    (stopped,) = re.findall(r"Stopped: (SIGUSR1 .*)", log)
    assert stopped.endswith("requeued the job."), stopped
    assert log.count("Requeued SLURM job") == 1 and "Resuming from" in log


@pytest.mark.slurm
@pytest.mark.slow
def test_a_warning_during_a_start_up_longer_than_the_job_ends_it_in_one_line_not_timeout(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`--time=1 --signal=USR1@55` and a callback whose setup takes 150 s: the warning comes while
    the run sets up, before any hook of the loop. It sets the job's deadline at once, so the job
    ends at it with the one line, FAILED, before SLURM's limit (it used to end TIMEOUT with
    SLURM's lines only)."""
    command = [*SMALL_RUN, "+callbacks.slow_setup._target_=tests.faults.SlowSetup",
               "+callbacks.slow_setup.seconds=150"]  # fmt: skip
    job = sbatch(tmp_path, slurm_cluster, *command, tasks=1,
                 options=("--time=1", "--signal=USR1@55"))  # fmt: skip
    state = first_start_ends(job, slurm_cluster)
    log = job_log(tmp_path, job)
    assert state == "FAILED", f"{state}:\n{log[-3000:]}"
    (line,) = [line for line in log.splitlines() if line.startswith("error: ")]
    assert "time limit for this job (1:00) is too short for its start-up" in line, line
    assert "longer --time" in line and "Traceback" not in log
    assert "Requeued SLURM job" not in log


def node_state(env: dict[str, str]) -> str:
    shown = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%N|%t"], env=env, capture_output=True,
        text=True, check=True, timeout=30,
    )  # fmt: skip
    return shown.stdout.strip()


def on_the_node(job: str, env: dict[str, str]) -> bool:
    """Whether a process of the job still runs on the node (a job step's slurmstepd outlives its
    tasks by seconds there). Resumed before they end, the node reports the step and SLURM kills
    the job's next start."""
    listed = subprocess.run(["scontrol", "listpids", job], env=env, capture_output=True)
    return listed.returncode == 0


def set_node(env: dict[str, str], node: str, *settings: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", *settings], env=env, check=True)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_on_a_failed_node_is_requeued_waits_and_finishes_as_if_never_stopped(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """The node set DOWN under a running job (`#SBATCH --requeue`): SLURM requeues the job, which
    waits while the node stays down (the test cluster used to bring it back within 0.1 s), runs
    again once the node is resumed, and ends as the same job never interrupted."""
    command = [*SMALL_RUN, "+callbacks.slow._target_=tests.faults.SlowSteps",
               "+callbacks.slow.seconds=0.5"]  # fmt: skip
    job = sbatch(tmp_path / "failed", slurm_cluster, *command, tasks=1)
    batches = tmp_path / "failed" / "batches.txt.rank0"
    deadline = time.monotonic() + 120
    while not (batches.is_file() and len(batches.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and job_state(job, slurm_cluster) != "FAILED"
        time.sleep(0.1)
    node = node_state(slurm_cluster).split("|")[0]
    set_node(slurm_cluster, node, "State=DOWN", "Reason=test")
    # Submitted while the node is down, the reference waits too, then runs beside the other.
    reference = sbatch(tmp_path / "reference", slurm_cluster, *command, tasks=1)
    deadline = time.monotonic() + 60
    while on_the_node(job, slurm_cluster):  # the first start's processes, ended by SLURM
        assert time.monotonic() < deadline, "the first start's processes still run"
        time.sleep(0.2)
    for _ in range(6):
        assert node_state(slurm_cluster) == f"{node}|down", "the node stays down until resumed"
        assert job_state(job, slurm_cluster) == "PENDING", "the job waits for the node"
        assert job_state(reference, slurm_cluster) == "PENDING"
        time.sleep(0.5)
    set_node(slurm_cluster, node, "State=RESUME")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], env=slurm_cluster)
    assert wait_for(reference, slurm_cluster) == "COMPLETED"
    assert wait_for(job, slurm_cluster) == "COMPLETED", job_log(tmp_path / "failed", job)[-3000:]
    log = job_log(tmp_path / "failed", job)
    assert "Resuming from" in log, log[-3000:]
    last = run_dir(tmp_path / "failed") / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["exact_resume"]["fit_finished"]
    assert_same_outcome(tmp_path / "reference", tmp_path / "failed")


def fake_slurm(folder: Path) -> dict[str, str]:
    """A SLURM job's environment without a cluster: `scontrol` records its arguments, `squeue`
    says the job started a minute ago and ends in an hour."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {folder / "scontrol.log"}\n')
    now = time.time()
    started, ends = (
        datetime.fromtimestamp(now + s).isoformat(timespec="seconds") for s in (-60, 3600)
    )
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{started}|{ends}|1:01:00'\n")
    for tool in ("scontrol", "squeue"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


@pytest.mark.slow
def test_a_start_that_only_tests_finishes_its_test_when_warned(tmp_path: Path) -> None:
    """Training had finished before this start; warned during the test, which is all it runs, the
    job used to requeue and test again from the start, and again if warned as early. It finishes
    the test instead, and the run is complete (exit code 0, not requeued)."""
    command = [*SMALL_RUN, *fault("fit_end", 1, tmp_path / "fit-end", "SIGTERM"),
               *fault("test", 1, tmp_path / "test", "SIGUSR1", name="test_fault")]  # fmt: skip
    code, output = run(command, tmp_path / "run")
    assert code == 143 and "SIGTERM after training: saved" in output, output[-3000:]
    code, output = run(command, tmp_path / "run", fake_slurm(tmp_path))
    assert code == 0, output[-3000:]
    assert "Received SIGUSR1 during the test, before this start had anything to save" in output
    assert re.search(r"Going on to the end of the test; the job ends in \d+ s", output)
    assert not (tmp_path / "scontrol.log").exists(), "not requeued"
    assert (run_dir(tmp_path / "run") / "metrics.json").is_file()
