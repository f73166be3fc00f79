"""An Optuna search whose driver dies while a trial's job still runs (a SLURM job goes on under the
scheduler, a joblib worker on its own): the same command, run again, waits for that job and takes
its result instead of training the trial again or sampling another in its place. The search
through SLURM runs on the local cluster of tests/test_slurm.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from hydra_plugins.{{ cookiecutter.package_name }}_optuna_sweeper import (
    _impl,
)

from .helpers import PACKAGE
from .test_scale_out import PINNED, SEARCH, summary_rows
from .test_slurm import QUICK, TINY, queue

FolderInUse = _impl.FolderInUse  # run/lock.py's, as the sweeper sees it


def start(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """The train command in a process group of its own, as a shell starts it; its output in
    `log`, which the test reads while it runs."""
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", PACKAGE, *command], cwd=cwd, env=env, stdout=output,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def jobs_of(sweep: Path, env: dict[str, str]) -> dict[str, str]:
    """The SLURM jobs of the search in `sweep` (their batch scripts lie in it), with their states."""
    return {
        job: state
        for job, state, script in queue(env, "%i", "%T", "%o")
        if script.startswith(str(sweep))
    }


def wait_until(condition: Callable[[], object], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout:.0f} s: {what}")
        time.sleep(0.2)


# A trial's job as the search sees it: it holds the trial's folder, then writes its metrics.
HOLDS_THEN_FINISHES = """
import importlib, sys, time
from pathlib import Path
folder = Path(sys.argv[2])
with importlib.import_module(sys.argv[1] + ".run.lock").hold(folder):
    print("held", flush=True)
    time.sleep(1)
    (folder / "metrics.json").write_text('{"val/acc": 0.75}')
"""


def sweeper(sweep: Path) -> _impl.OptunaSweeperImpl:
    """The sweeper of a search that maximizes val/acc in `sweep`, its study in memory."""
    impl = _impl.OptunaSweeperImpl(
        storage=None, study_name="search", direction="maximize", n_trials=2, n_jobs=1,
        seed=None, pruner=None, params=None, max_failures_in_a_row=3,
    )  # fmt: skip
    impl.config = OmegaConf.create({"optimized_metric": "val/acc"})
    OmegaConf.update(impl.config, "hydra.sweep.dir", str(sweep))
    return impl


def refused(folder: Path) -> JobReturn:
    """How a trial's job ends that found its folder held by another live job."""
    job = JobReturn()
    job.status, job._return_value = JobStatus.FAILED, FolderInUse(f"{folder} is in use")
    return job


def test_a_trial_whose_job_found_its_folder_held_waits_for_the_holder_and_takes_its_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial's job of an earlier launch had waited in the queue, and took the folder first
    (here a process of this machine, as a joblib worker left by a killed driver is)."""
    import optuna

    monkeypatch.setattr(_impl, "WAIT_POLL_S", 0.1)
    folder = tmp_path / "sweep" / "0"
    holding = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THEN_FINISHES, PACKAGE, str(folder)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holding.stdout is not None and holding.stdout.readline() == "held\n"
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    with caplog.at_level(logging.INFO):
        state = sweeper(tmp_path / "sweep")._tell(study, trial, refused(folder), {})
    assert holding.wait(timeout=30) == 0
    assert state == optuna.trial.TrialState.COMPLETE
    assert study.trials[0].value == 0.75
    (waited,) = [
        r.getMessage() for r in caplog.records if "waiting for it to end" in r.getMessage()
    ]
    assert f"Trial 0 is still running as process {holding.pid} on " in waited, waited
    recorded = json.loads((folder / "job_status.json").read_text())
    assert recorded == {"status": "COMPLETED"}, "the summary says what the study says"


def test_a_trial_whose_folder_holder_left_no_result_is_launched_again_then_failed(
    tmp_path: Path,
) -> None:
    """A holder that ended without a result (cancelled, killed): the trial is launched again to
    resume in its folder; refused again and again (a lock whose holder this machine cannot see),
    it is marked failed, not launched for ever."""
    import optuna

    folder = tmp_path / "sweep" / "0"
    folder.mkdir(parents=True)
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    search, refusals = sweeper(tmp_path / "sweep"), {}
    told = [search._tell(study, trial, refused(folder), refusals) for _ in range(3)]
    assert told == [None, None, optuna.trial.TrialState.FAIL]
    assert study.trials[0].state == optuna.trial.TrialState.FAIL


@pytest.mark.slurm
@pytest.mark.slow
def test_a_search_run_again_after_its_driver_was_killed_takes_the_result_of_the_job_left_running(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """Trial 0's job pauses after its first step while `paused-0` exists; the driver is killed
    (SIGKILL to its process group) meanwhile. The same command, run again, finds the job still
    running; it is let go on once the command has noticed it (it says it waits for the job; a
    command that launched trial 0 again instead found the folder held by it)."""
    import optuna

    sweep, storage = tmp_path / "search", f"sqlite:///{tmp_path / 'search.db'}"
    paused = tmp_path / "paused-0"
    paused.touch()
    # Quoted: the comma is oc.select's, not a sweep's.
    pause_path = "'" + str(tmp_path / "paused-") + "${oc.select:optuna_trial.number,none}'"
    command = [
        "--multirun", SEARCH, *PINNED, *QUICK, *TINY, "hydra.sweeper.n_trials=2",
        f"hydra.sweeper.storage={storage}", "hydra.sweeper.pruner.n_startup_trials=10",
        f"hydra.sweep.dir={sweep}", "allowed_targets=[tests.faults.PausedWhile]",
        "+callbacks.paused._target_=tests.faults.PausedWhile",
        f"+callbacks.paused.path={pause_path}",
    ]  # fmt: skip
    killed = start(command, tmp_path, slurm_cluster, tmp_path / "killed.log")
    lock = sweep / "0" / ".lock"
    wait_until(lambda: lock.is_file() and lock.read_text().strip(), "trial 0's job training")
    (orphan,) = [job for job, state in jobs_of(sweep, slurm_cluster).items() if state == "RUNNING"]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    log = tmp_path / "again.log"
    again = start(command, tmp_path, slurm_cluster, log)
    refused = sweep / "0" / "job_status.json"
    wait_until(
        lambda: (
            "waiting for it to end" in log.read_text()
            or (refused.is_file() and "in use" in refused.read_text())
        ),
        "the command run again waiting for trial 0's job, or launching it again",
    )
    paused.unlink()
    assert again.wait(timeout=600) == 0, log.read_text()[-5000:]
    said = log.read_text()

    results = OmegaConf.load(sweep / "optimization_results.yaml")
    study = optuna.load_study(study_name=str(results.study_name), storage=storage)
    trials = study.get_trials(deepcopy=False)
    metric = str(OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml").optimized_metric)
    recorded = [
        json.loads((sweep / str(trial.number) / "metrics.json").read_text())[metric]
        for trial in trials
    ]
    assert [trial.state.name for trial in trials] == ["COMPLETE", "COMPLETE"], (
        "trial 0 took its job's result, and no trial was sampled in its place"
    )
    assert [trial.value for trial in trials] == pytest.approx(recorded)
    better = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    assert results.best_value == pytest.approx(better(recorded))
    assert recorded[results.best_trial] == pytest.approx(better(recorded))
    rows = summary_rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [("0", "COMPLETED"), ("1", "COMPLETED")]
    assert [float(row[metric]) for row in rows] == pytest.approx(recorded)
    (waited,) = [line for line in said.splitlines() if "waiting for it to end" in line]
    assert f"SLURM job {orphan}" in waited, waited
    states = jobs_of(sweep, slurm_cluster)
    assert states[orphan] == "COMPLETED"
    assert len(states) == 2, f"trial 0 was not launched again: {states}"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_search_killed_just_after_submitting_waits_for_the_job_still_queued(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """The driver is killed as soon as it says it submitted trial 0's job, which SLURM holds
    pending for 15 s (`--begin`): the job has no folder lock yet, only its place in the queue.
    The same command, run again, asks SLURM about that job, says the trial is still in it, waits
    for it and takes its result; it submits nothing for trial 0 (it used to submit a second job,
    which found the folder held and ended FAILED)."""
    import optuna

    sweep, storage = tmp_path / "search", f"sqlite:///{tmp_path / 'search.db'}"
    command = [
        "--multirun", SEARCH, *PINNED, *QUICK, *TINY, "hydra.sweeper.n_trials=1",
        f"hydra.sweeper.storage={storage}", f"hydra.sweep.dir={sweep}",
        "+hydra.launcher.additional_parameters={begin:'now+15'}",
    ]  # fmt: skip
    first = tmp_path / "killed.log"
    killed = start(command, tmp_path, slurm_cluster, first)
    wait_until(
        lambda: "-> SLURM job" in first.read_text() or killed.poll() is not None,
        "trial 0's job submitted",
    )
    assert killed.poll() is None, first.read_text()[-3000:]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    (submitted,) = [line.split()[-1] for line in first.read_text().splitlines()
                    if "-> SLURM job" in line]  # fmt: skip
    assert jobs_of(sweep, slurm_cluster) == {submitted: "PENDING"}

    log = tmp_path / "again.log"
    again = start(command, tmp_path, slurm_cluster, log)
    assert again.wait(timeout=600) == 0, log.read_text()[-5000:]
    said = log.read_text()
    assert "-> SLURM job" not in said, "trial 0 was submitted a second time"
    assert f"trial 0 still pending as SLURM job {submitted}" in said, said[-3000:]
    (waited,) = [line for line in said.splitlines() if "waiting for it to end" in line]
    assert f"SLURM job {submitted}" in waited, waited
    assert jobs_of(sweep, slurm_cluster) == {submitted: "COMPLETED"}

    results = OmegaConf.load(sweep / "optimization_results.yaml")
    study = optuna.load_study(study_name=str(results.study_name), storage=storage)
    metric = str(OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml").optimized_metric)
    recorded = json.loads((sweep / "0" / "metrics.json").read_text())[metric]
    assert [(trial.state.name, trial.value) for trial in study.trials] == [("COMPLETE", recorded)]
    assert [(row["job"], row["status"]) for row in summary_rows(sweep)] == [("0", "COMPLETED")]
