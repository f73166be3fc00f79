"""The cluster path against a real scheduler: a single-node SLURM started by scripts/local_slurm.py
(once per test worker), CPU jobs with gloo. Skipped, with the reason, where it cannot start."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .helpers import PACKAGE, PROJECT_ROOT, run_cli
from .killing import SMALL_RUN, assert_same_outcome
from .test_scale_out import PINNED, SEARCH
from .test_scale_out import SHORT_RUN as SEARCH_RUN

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

QUICK = ["hydra/launcher=slurm", "trainer=cpu", "logger=csv", "extras.print_config=false",
         "callbacks.progress_bar=null"]  # fmt: skip
{%- if cookiecutter.examples == "language" %}
TINY = ["model.net.n_layer=1", "data.max_bytes=100000", "trainer.max_steps=4",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]  # fmt: skip
{%- else %}
TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1"]  # fmt: skip
{%- endif %}


def summary_rows(cwd: Path) -> list[dict[str, str]]:
    (summary,) = (cwd / "logs" / "train" / "multiruns").glob("*/summary.csv")
    with summary.open() as handle:
        return list(csv.DictReader(handle))


def queue(env: dict[str, str], *columns: str) -> list[list[str]]:
    listed = subprocess.run(
        ["squeue", "--noheader", "--states=all", f"--format={'|'.join(columns)}"],
        env=env, capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return [line.split("|") for line in listed.stdout.splitlines()]


def test_a_sweep_of_two_jobs_completes_and_is_summarized(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """trainer=cpu needs no GPU override: the launcher asks for no GPU."""
    result = run_cli(
        "-m", PACKAGE, "-m", *QUICK, *TINY, "seed=1,2", cwd=tmp_path, env=slurm_cluster
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert sorted(row["overrides"] for row in rows) == ["seed=1", "seed=2"]
    assert {row["status"] for row in rows} == {"COMPLETED"}
    assert all((tmp_path / row["run_dir"] / "metrics.json").is_file() for row in rows)
    polls = result.stdout + result.stderr
    assert polls.count("accounting is off") == 1 and "Bypassing sacct" not in polls


def test_a_failing_job_fails_the_sweep_and_is_named(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    result = run_cli(
        "-m", PACKAGE, "-m", *QUICK, *TINY, "data.batch_size=32,0", cwd=tmp_path,
        env=slurm_cluster,
    )  # fmt: skip
    assert result.returncode != 0
    status = {row["overrides"]: row["status"] for row in summary_rows(tmp_path)}
    assert status == {"data.batch_size=32": "COMPLETED", "data.batch_size=0": "FAILED"}
    assert "data.batch_size=0" in result.stdout + result.stderr


def test_a_job_that_can_never_start_ends_the_sweep_with_the_reason(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """More CPUs per task than the node has: SLURM accepts the job and leaves it pending."""
    env = {**slurm_cluster, "SLURM_UNSCHEDULABLE_AFTER_S": "5"}

    def refused(setting: str) -> str:
        result = run_cli(
            "-m", PACKAGE, "-m", *QUICK, *TINY, "seed=1", setting, cwd=tmp_path, env=env
        )  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        return line

    started = time.monotonic()
    line = refused("hydra.launcher.cpus_per_task=512")
    assert "Reason=PartitionConfig" in line and "hydra.launcher.cpus_per_task" in line
    assert time.monotonic() - started < 90
    assert not [job for job in queue(env, "%T") if job[0] in ("PENDING", "RUNNING")]
    # More memory than the node has: sbatch refuses the job outright.
    line = refused("hydra.launcher.mem_gb=100000")
    assert "sbatch refused" in line and "Memory specification" in line and "mem_gb" in line


def test_one_job_of_two_tasks_is_one_ddp_run(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "-m", *QUICK, *TINY, "seed=1", "strategy=ddp", "trainer.devices=2",
        cwd=tmp_path, env=slurm_cluster,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = summary_rows(tmp_path)
    run_dir = tmp_path / row["run_dir"]
    assert sorted(p.name for p in run_dir.glob("metrics-rank*.json")) == [
        "metrics-rank0.json",
        "metrics-rank1.json",
    ]


def sbatch(
    cwd: Path, env: dict[str, str], *args: str, options: tuple[str, ...] = (), tasks: int = 2
) -> str:
    """`sbatch scripts/slurm.sbatch` on the CPU node, two tasks (DDP); returns the job id."""
    cwd.mkdir(parents=True, exist_ok=True)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--ntasks-per-node={tasks}", "--gpus-per-node=0",
         "--cpus-per-task=1", *options, str(PROJECT_ROOT / "scripts" / "slurm.sbatch"), *args],
        cwd=cwd, env={**env, "TRAINER": "cpu"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return submitted.stdout.strip().split(";")[0]


def wait_for(job: str, env: dict[str, str], timeout: float = 300.0) -> str:
    """The job's final state. A requeued job waits for its begin time (about two minutes after
    the requeue); the test lets it start 3 s from when it sees it waiting. (At once is too soon:
    slurmd refuses a start in the second of the requeue, whose job credential it revoked, and the
    job ends FAILED.)"""
    deadline = time.monotonic() + timeout
    moved = 0.0
    while time.monotonic() < deadline:
        states = {row[0]: row[1:] for row in queue(env, "%i", "%T", "%r")}
        state, reason = states.get(job, ["UNKNOWN", ""])
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if state == "PENDING" and reason == "BeginTime" and time.monotonic() > moved + 10:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], env=env)
            moved = time.monotonic()
        time.sleep(1)
    raise AssertionError(f"job {job} did not end within {timeout:.0f} s")


def test_the_sbatch_script_runs_two_tasks_in_its_run_directory(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    job = sbatch(tmp_path, slurm_cluster, "logger=csv", "extras.print_config=false", *TINY)
    state = wait_for(job, slurm_cluster)
    assert state == "COMPLETED", next(tmp_path.glob(f"*-{job}.out")).read_text()[-3000:]
    run_dir = tmp_path / "logs" / "train" / "runs" / f"slurm-{job}"
    assert (run_dir / "metrics.json").is_file()
    assert (run_dir / "metrics-rank1.json").is_file(), "two tasks, one DDP run"


def test_a_preempted_job_saves_requeues_and_finishes_as_if_never_stopped(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`scancel --signal=USR1` while it trains: a checkpoint at a step boundary, `scontrol
    requeue`, the same job resumes in its run directory and ends with the weights, optimizer
    state, batches and metrics of the same job left alone."""
    command = [*SMALL_RUN, "+callbacks.slow._target_=tests.faults.SlowSteps",
               "+callbacks.slow.seconds=0.5", "callbacks.preemption.sync_every_n_steps=1"]  # fmt: skip
    reference = sbatch(tmp_path / "reference", slurm_cluster, *command)
    preempted = sbatch(tmp_path / "preempted", slurm_cluster, *command)
    batches = tmp_path / "preempted" / "batches.txt.rank0"
    for _ in range(600):
        if batches.is_file() and len(batches.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", preempted], env=slurm_cluster, check=True)
    assert wait_for(reference, slurm_cluster) == "COMPLETED"
    assert wait_for(preempted, slurm_cluster) == "COMPLETED"
    (output,) = (tmp_path / "preempted").glob(f"*-{preempted}.out")
    log = output.read_text()
    assert "Requeued SLURM job" in log and "Resuming from" in log, log[-3000:]
    (stopped, *_) = [line for line in log.splitlines() if "Stopped: SIGUSR1" in line]
    assert "after training" not in stopped, "stopped while it trained"
    runs = [tmp_path / name / "logs" / "train" / "runs" for name in ("reference", "preempted")]
    for runs_dir, job in zip(runs, (reference, preempted), strict=True):
        assert [p.name for p in runs_dir.iterdir()] == [f"slurm-{job}"]
    assert_same_outcome(tmp_path / "reference", tmp_path / "preempted")
    last = next(runs[1].iterdir()) / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["exact_resume"]["fit_finished"]


def test_an_optuna_search_through_slurm_is_continued_by_the_same_command(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    import optuna
    from omegaconf import OmegaConf

    storage = f"sqlite:///{tmp_path / 'search.db'}"
    for n_trials in (2, 3):
        result = run_cli(
            "-m", PACKAGE, "-m", SEARCH, *PINNED, *QUICK, *SEARCH_RUN,
            f"hydra.sweeper.n_trials={n_trials}", f"hydra.sweeper.storage={storage}",
            "hydra.sweeper.pruner.n_startup_trials=10", f"hydra.sweep.dir={tmp_path / 'search'}",
            cwd=tmp_path, env=slurm_cluster,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        said = result.stdout + result.stderr
        assert said.count("accounting is off") == 1, "once per command, not once per batch"
    results = OmegaConf.load(tmp_path / "search" / "optimization_results.yaml")
    study = optuna.load_study(study_name=str(results.study_name), storage=storage)
    trials = study.get_trials(deepcopy=False)
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 3
    assert len({tuple(sorted(trial.params.items())) for trial in trials}) == 3
    for trial in trials:
        assert (tmp_path / "search" / str(trial.number) / "metrics.json").is_file()


def test_a_job_warned_before_its_time_limit_requeues_and_finishes_as_if_never_stopped(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`sbatch --time=1 --signal=USR1@55`: SLURM signals the job 55 s before its one-minute limit
    (its controller checks every 30 s or so: anywhere from 5 to 35 s in, while it starts or
    trains); the run saves and requeues itself, as often as that takes, and ends as the same job
    with no time limit does."""
    command = [*SMALL_RUN, "+callbacks.slow._target_=tests.faults.SlowSteps",
               "+callbacks.slow.seconds=4", "callbacks.preemption.sync_every_n_steps=1"]  # fmt: skip
    # One task each, so that both jobs fit on the two-core node at once.
    reference = sbatch(tmp_path / "reference", slurm_cluster, *command, tasks=1)
    limited = sbatch(tmp_path / "limited", slurm_cluster, *command, tasks=1,
                     options=("--time=1", "--signal=USR1@55"))  # fmt: skip
    assert wait_for(reference, slurm_cluster, timeout=600) == "COMPLETED"
    assert wait_for(limited, slurm_cluster, timeout=600) == "COMPLETED"
    (output,) = (tmp_path / "limited").glob(f"*-{limited}.out")
    log = output.read_text()
    assert "Stopped: SIGUSR1" in log and "Requeued SLURM job" in log, log[-3000:]
    assert_same_outcome(tmp_path / "reference", tmp_path / "limited")


def test_the_local_cluster_refuses_in_one_line_where_it_cannot_start(tmp_path: Path) -> None:
    """Without its daemons on PATH (or, for a user other than root, at all)."""
    script = PROJECT_ROOT / "scripts" / "local_slurm.py"
    result = subprocess.run(
        [sys.executable, str(script), "start", str(tmp_path / "cluster")],
        env={"PATH": str(Path(sys.executable).parent)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and ("apt-get install" in line or "sudo" in line)
