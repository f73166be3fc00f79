"""A SLURM sweep as its user sees it, on the local cluster of scripts/local_slurm.py: the sweep
lines of the docs as written, each job's id and state changes while the sweep waits, and a job
that `scancel` ends (the other jobs are waited for; the same command then trains that job only)."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.run.lock import (
    FolderInUse,
)
from {{ cookiecutter.package_name }}.sweeps.queued import (
    QUEUED_FILE,
    queued_job,
    record_queued,
)
from {{ cookiecutter.package_name }}.sweeps.returns import (
    RETURN_FILE,
    JobFailed,
    UnreadableReturn,
    read_job_return,
    write_job_return,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    collect_jobs,
    failures,
    record_job_ended_outside,
    record_job_status,
)

from .fuzzing import CASES, mutate_bytes, mutated_json_text
from .helpers import PACKAGE, PROJECT_ROOT, run_cli
from .test_slurm import QUICK, TINY, queue, summary_rows

PROGRESS = re.compile(r"Job #(\d+) \(SLURM (\S+)\): ([A-Z_]+)(.*)$")


def documented_slurm_sweeps() -> list[str]:
    """Every `<package>-train ... hydra/launcher=slurm ...` line in a code block of the README
    and the docs, as written (its comment removed)."""
    lines = []
    for page in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        in_block = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
            elif in_block and line.startswith(f"{PACKAGE}-train ") and "launcher=slurm" in line:
                lines.append(line.split(" #")[0].strip())
    return lines


def arguments(line: str) -> list[str]:
    """The documented command line as this test runs it: `python -m <package> <overrides>`."""
    command, *overrides = shlex.split(line)
    assert command == f"{PACKAGE}-train", line
    return ["-m", PACKAGE, *overrides]


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.slurm
@pytest.mark.slow
def test_a_documented_gpu_sweep_on_cpu_nodes_ends_naming_trainer_cpu(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """The local cluster has no GPU: each documented sweep that asks for one is refused in one
    line that says which override makes its jobs CPU-only, and the docs give that line too."""
    documented = documented_slurm_sweeps()
    asking_for_gpus = [line for line in documented if "trainer=cpu" not in line]
    assert asking_for_gpus, documented
    for line in asking_for_gpus:
        result = run_cli(*arguments(line), cwd=tmp_path, env=slurm_cluster)
        assert result.returncode == 1, result.stderr[-3000:]
        said = error_line(result.stderr)
        assert "trainer=cpu" in said and "GPU" in said, said
        # Other test files' jobs come and go on the shared cluster: only this test's count.
        ours = [job for job, folder in queue(slurm_cluster, "%i", "%Z") if str(tmp_path) in folder]
        assert ours == [], "no job was submitted"
        assert not (tmp_path / "logs").exists(), "nothing was written"
        cpu_line = " ".join([*line.split()[:3], "trainer=cpu", *line.split()[3:]])
        cpu_line = re.sub(r" hydra\.launcher\.partition=\S+", "", cpu_line)
        assert cpu_line in documented, f"the docs give no CPU line beside: {line}"


def read(stream: Iterable[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


class Sweep:
    """A sweep command running in the background, its output read as it comes."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, env={**os.environ, **env}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.stdout),
                                  (self.process.stderr, self.stderr))
        ]  # fmt: skip
        for reader in self.readers:
            reader.start()

    def wait_for_line(self, pattern: str, timeout: float = 180.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.stdout):
                found = re.search(pattern, line)
                if found:
                    return found
            assert self.process.poll() is None, "".join(self.stdout + self.stderr)[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"no line {pattern!r} in {timeout:.0f} s: {''.join(self.stdout)}")

    def end(self, timeout: float = 300.0) -> tuple[int, str, str]:
        try:
            code = self.process.wait(timeout)
        finally:
            self.process.kill()
        for reader in self.readers:
            reader.join(timeout=10)
        return code, "".join(self.stdout), "".join(self.stderr)


def wait_until(condition: Callable[[], object], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.2)


def progress(output: str) -> dict[int, list[str]]:
    """Job number -> the states its progress lines gave, in order (reasons and counts after)."""
    states: dict[int, list[str]] = {}
    for line in output.splitlines():
        found = PROGRESS.search(line)
        if found:
            states.setdefault(int(found[1]), []).append(found[3] + found[4])
    return states


@pytest.mark.slurm
@pytest.mark.slow
def test_a_cancelled_job_is_named_the_others_finish_and_the_same_command_trains_it_alone(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """The docs' CPU sweep, one job at a time (array_parallelism=1): job #1 waits while #0 runs;
    `scancel` of #0 while it trains (held at a step while a file exists). The sweep
    prints each job's id and every state change, waits for #1, ends with one `error:` line naming
    #0 as CANCELLED (exit 1) and its summary says so. The same command again trains #0 only and
    ends 0."""
    (line,) = [
        line for line in documented_slurm_sweeps()
        if "trainer=cpu" in line and "model.optimizer.lr=" in line
    ]  # fmt: skip
    quick = [o for o in QUICK if o not in ("hydra/launcher=slurm", "trainer=cpu")]
    hold = tmp_path / "hold"
    held = ["allowed_targets=[tests.faults.PausedWhile]",
            "+callbacks.paused._target_=tests.faults.PausedWhile", f"+callbacks.paused.path={hold}"]  # fmt: skip
    args = [*arguments(line), *quick, *TINY, "hydra.launcher.array_parallelism=1", *held]
    hold.touch()
    sweep = Sweep(args, tmp_path, slurm_cluster)
    submitted = {
        number: sweep.wait_for_line(rf"#{number} : .* -> SLURM job (\S+)$")[1] for number in (0, 1)
    }
    sweep.wait_for_line(r"Job #1 \(SLURM \S+\): PENDING \(\w+\)")
    sweep.wait_for_line(r"Job #0 \(SLURM \S+\): RUNNING")
    wait_until(lambda: list(tmp_path.glob("logs/train/multiruns/*/0/train.log")), "#0 to train")
    subprocess.run(["scancel", submitted[0]], env=slurm_cluster, check=True, timeout=30)
    # Held until SLURM has ended it: a run let go at once could finish in SLURM's grace period.
    sweep.wait_for_line(r"Job #0 \(SLURM \S+\): CANCELLED")
    hold.unlink()
    code, stdout, stderr = sweep.end()

    assert code == 1, (stdout + stderr)[-5000:]
    said = error_line(stderr)
    assert "#0 (model.optimizer.lr=0.001) CANCELLED" in said and submitted[0] in said, said
    status = {row["overrides"]: row["status"] for row in summary_rows(tmp_path)}
    assert status == {
        "model.optimizer.lr=0.001": "CANCELLED",
        "model.optimizer.lr=0.003": "COMPLETED",
    }
    finished = next(tmp_path.glob("logs/train/multiruns/*/1"))
    assert (finished / "metrics.json").is_file(), "the sweep waited for #1"
    states = progress(stdout)
    assert [state.split()[0] for state in states[0]] == ["RUNNING", "CANCELLED"], states
    assert [state.split()[0] for state in states[1]] == ["PENDING", "RUNNING", "COMPLETED"], states
    assert states[1][2] == "COMPLETED (2 of 2 jobs ended)", states
    lines = [PROGRESS.search(line) for line in stdout.splitlines()]
    assert {(found[1], found[2]) for found in lines if found} == {
        ("0", submitted[0]),
        ("1", submitted[1]),
    }
    repeated = Counter((found[1], found[3]) for found in lines if found)
    assert max(repeated.values()) == 1, repeated

    stamps = {path: path.stat().st_mtime_ns for path in finished.rglob("*.ckpt")}
    assert stamps
    again = run_cli(*args, cwd=tmp_path, env=slurm_cluster)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {row["status"] for row in summary_rows(tmp_path)} == {"COMPLETED"}
    assert {path: path.stat().st_mtime_ns for path in finished.rglob("*.ckpt")} == stamps
    assert "already finished" in (finished / "train.log").read_text()
    assert (finished.parent / "0" / "metrics.json").is_file()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_cancelled_while_pending_is_reported_cancelled_at_once(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """Both jobs of the docs' CPU sweep held pending for 20 s (`--begin`); `scancel` of #1 while
    it waits. SLURM then keeps no record of that array task at all: the sweep reports it
    CANCELLED at its next look at the queue, before #0 has even started (it used to call it
    LOST two minutes later), and ends as soon as #0 does, naming #1 in its error line."""
    (line,) = [
        line for line in documented_slurm_sweeps()
        if "trainer=cpu" in line and "model.optimizer.lr=" in line
    ]  # fmt: skip
    quick = [o for o in QUICK if o not in ("hydra/launcher=slurm", "trainer=cpu")]
    pending = "+hydra.launcher.additional_parameters={begin:'now+20'}"
    args = [*arguments(line), *quick, *TINY, pending]
    sweep = Sweep(args, tmp_path, slurm_cluster)
    submitted = {
        number: sweep.wait_for_line(rf"#{number} : .* -> SLURM job (\S+)$")[1] for number in (0, 1)
    }
    subprocess.run(["scancel", submitted[1]], env=slurm_cluster, check=True, timeout=30)
    cancelled = time.monotonic()
    sweep.wait_for_line(r"Job #1 \(SLURM \S+\): CANCELLED", timeout=30)
    assert time.monotonic() - cancelled < 15
    assert not [line for line in sweep.stdout if re.search(r"Job #0 .*RUNNING", line)], (
        "#1 was reported before #0 started"
    )
    sweep.wait_for_line(r"Job #0 \(SLURM \S+\): COMPLETED", timeout=240)
    completed = time.monotonic()
    code, stdout, stderr = sweep.end()
    assert time.monotonic() - completed < 20, "the sweep ended once #0 had"
    assert code == 1, (stdout + stderr)[-5000:]
    said = error_line(stderr)
    assert "#1 (model.optimizer.lr=0.003) CANCELLED" in said and submitted[1] in said, said
    assert "LOST" not in stdout + stderr


def test_a_job_cancelled_before_it_started_is_in_the_summary(tmp_path: Path) -> None:
    """`scancel` of a job still pending: it never made its folder; the launcher records its
    overrides and SLURM's state there, and the summary and the error line name it."""
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text("- seed=1\n- trainer=cpu\n")
    record_job_status(tmp_path / "0", "COMPLETED")
    reason = "SLURM job 7_1 ended CANCELLED; the same command runs it again"
    record_job_ended_outside(tmp_path / "1", ["seed=2", "trainer=cpu"], "CANCELLED", reason)
    rows = collect_jobs(tmp_path)
    assert [(row["job"], row["overrides"], row["status"]) for row in rows] == [
        (0, "seed=1", "COMPLETED"),
        (1, "seed=2", "CANCELLED"),
    ]
    line = failures([rows[1]], 2, tmp_path)
    assert line.startswith("1 of 2 jobs did not complete: #1 (seed=2) CANCELLED. Job #1: SLURM"), (
        line
    )


def job_return(job_dir: Path, status: JobStatus, value: Any) -> JobReturn:
    """What Hydra's run of a job gives the launcher in the job."""
    returned = JobReturn(
        overrides=["seed=1"], status=status,
        hydra_cfg=OmegaConf.create(dict(hydra=dict(runtime=dict(output_dir=str(job_dir))))),
    )  # fmt: skip
    returned.return_value = value
    return returned


class TrialPruned(Exception):
    """Named as Optuna's, which the sweeper tells apart by its name."""


def test_a_jobs_return_comes_back_as_json_with_its_value_or_its_errors_kind(
    tmp_path: Path,
) -> None:
    cases: list[tuple[JobStatus, Any]] = [
        (JobStatus.COMPLETED, 0.8125), (JobStatus.COMPLETED, None),
        (JobStatus.FAILED, FolderInUse("logs/x is in use by process 7")),
        (JobStatus.FAILED, TrialPruned("pruned at step 4")),
        (JobStatus.FAILED, RuntimeError("boom")),
    ]  # fmt: skip
    for index, (status, value) in enumerate(cases):
        job_dir = tmp_path / str(index)
        job_dir.mkdir()
        write_job_return(job_return(job_dir, status, value))
        back = read_job_return(job_dir, ["seed=1"])
        assert back.status == status and back.overrides == ["seed=1"]
        assert back.hydra_cfg is not None
        assert back.hydra_cfg.hydra.runtime.output_dir == str(job_dir)
        if status == JobStatus.COMPLETED:
            assert back.return_value == value
            continue
        error = back._return_value
        assert type(error).__name__ == type(value).__name__ or isinstance(error, JobFailed)
        assert str(value) in str(error)
    assert isinstance(read_job_return(tmp_path / "2", [])._return_value, FolderInUse)


def test_the_launcher_reads_no_pickle_a_job_left_and_no_record_but_its_own(tmp_path: Path) -> None:
    """submitit's result pickle (here one that would run code) marks the job finished and is
    never unpickled; a record that is a link, a pipe, too large or mutated at random is one
    UnreadableReturn, never another exception or a hang."""
    from hydra_plugins.{{ cookiecutter.package_name }}_slurm_launcher._jobs import (
        Finished,
        ended_as,
    )
    from hydra_plugins.{{ cookiecutter.package_name }}_slurm_launcher.launcher import (
        SlurmLauncher,
    )

    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    pickled = tmp_path / "7_0_result.pkl"
    pickled.write_bytes(pickle.dumps(("success", RunsCode())))

    def results() -> None:
        raise AssertionError("the launcher unpickled the job's result")

    job = SimpleNamespace(
        _sub_jobs=[], paths=SimpleNamespace(result_pickle=pickled), results=results, job_id="7"
    )
    job_dir = tmp_path / "0"
    job_dir.mkdir()
    write_job_return(job_return(job_dir, JobStatus.COMPLETED, 0.5))
    result = ended_as(job, "COMPLETED")
    assert isinstance(result, Finished)
    launcher = SlurmLauncher.__new__(SlurmLauncher)
    assert launcher.returned(job, 0, ["seed=1"], job_dir, result).return_value == 0.5
    assert not marker.exists()

    valid = (job_dir / RETURN_FILE).read_bytes()
    record = job_dir / RETURN_FILE
    record.unlink()
    record.symlink_to("/etc/passwd")
    with pytest.raises(UnreadableReturn, match="cannot be read"):
        read_job_return(job_dir, [])
    record.unlink()
    os.mkfifo(record)
    with pytest.raises(UnreadableReturn, match="not a regular file"):
        read_job_return(job_dir, [])
    record.unlink()
    record.write_bytes(b" " * (2 << 20))
    with pytest.raises(UnreadableReturn, match="holds more than"):
        read_job_return(job_dir, [])
    rng = random.Random(12)
    for case in range(CASES):
        changed = json.loads(valid)
        record.write_bytes(
            mutated_json_text(changed, rng) if case % 2 else mutate_bytes(valid, rng)
        )
        try:
            read_job_return(job_dir, [])
        except UnreadableReturn as error:
            assert "\n" not in str(error), error


def test_a_trials_queued_job_record_is_only_ever_a_job_id_or_nothing(tmp_path: Path) -> None:
    """What a search run again reads of a trial's folder to ask SLURM about its job: the id as
    written; a link (to a valid record elsewhere), a pipe, a file too large or one mutated at
    random gives an id of the form SLURM writes, or None, never an exception or a hang."""
    folder = tmp_path / "0"
    record_queued(folder, "4242_7")
    assert queued_job(folder) == "4242_7"
    valid = (folder / QUEUED_FILE).read_bytes()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(valid)
    record = folder / QUEUED_FILE
    record.unlink()
    record.symlink_to(elsewhere)
    assert queued_job(folder) is None
    record.unlink()
    os.mkfifo(record)
    assert queued_job(folder) is None
    record.unlink()
    record.write_bytes(b'{"slurm_job": "1"}' + b" " * (2 << 20))
    assert queued_job(folder) is None
    rng = random.Random(7)
    for case in range(CASES):
        changed = json.loads(valid)
        record.write_bytes(
            mutated_json_text(changed, rng) if case % 2 else mutate_bytes(valid, rng)
        )
        found = queued_job(folder)
        assert found is None or re.fullmatch(r"\d+(_\d+)?", found), found
