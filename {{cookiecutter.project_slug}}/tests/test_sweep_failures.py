"""Multiruns and Optuna searches whose jobs fail: settings every job shares are refused before the
first job, a search stops after a few failed trials in a row, another search never takes a
study's folder, and a failed job leaves the sweep's summary and one `error:` line (exit code 1).
Each runs the real command line in a subprocess."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.run.lock import (
    held,
    hold,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    collect_jobs,
    record_job_status,
    write_summary,
)

from .helpers import PACKAGE, run_cli
from .test_scale_out import PINNED, QUICK, SEARCH, SHORT_RUN, assert_picture, summary_rows
from .test_slurm import TINY

FAST = [*QUICK, "trainer.max_epochs=1"]


def error_line(stderr: str) -> str:
    """The one line a failed command writes to stderr."""
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


def search(tmp_path: Path, *overrides: str) -> list[str]:
    """An Optuna search command with its study in tmp_path/search.db and its folder tmp_path/sweep."""
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    return [
        "-m", PACKAGE, "--multirun", SEARCH, *FAST, f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides,
    ]  # fmt: skip


def study_states(tmp_path: Path) -> dict[str, list[str]]:
    """Each study in tmp_path/search.db, by name, with the states of its trials."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'search.db'}"
    return {
        name: [t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials]
        for name in optuna.get_all_study_names(storage)
    }


@pytest.mark.parametrize("sweeper", ["basic", "optuna"])
def test_settings_that_every_job_shares_are_refused_before_any_job(
    tmp_path: Path, sweeper: str
) -> None:
    sweep = search(tmp_path) if sweeper == "optuna" else ["-m", PACKAGE, "--multirun", *FAST]
    result = run_cli(*sweep, "seed=abc", "model.optimizer.lr=0.001,0.002", cwd=tmp_path)
    assert result.returncode == 1
    assert error_line(result.stderr).startswith("error: seed='abc': use a whole number")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no sweep folder, no study"


def test_a_value_that_one_job_of_a_grid_cannot_use_is_refused_before_any_job(
    tmp_path: Path,
) -> None:
    result = run_cli(
        "-m", PACKAGE, "--multirun", *FAST, "model.optimizer.lr=0.001,-1", "seed=1,2",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert line.startswith("error: job #2 (model.optimizer.lr=-1,seed=1) would be refused"), line
    assert "model.optimizer.lr=-1: use a positive" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no job ran, nothing written"


@pytest.mark.parametrize(
    "setting",
    [
        "hydra.sweeper.n_trials=0",
        "hydra.sweeper.n_jobs=-1",
        "hydra.sweeper.max_failures_in_a_row=0",
    ],
)
def test_search_settings_it_cannot_use_are_refused_before_anything_is_written(
    tmp_path: Path, setting: str
) -> None:
    result = run_cli(*search(tmp_path), setting, cwd=tmp_path)
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(f"error: {setting}: use a whole number of 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no sweep folder, no study"


def test_a_search_whose_trials_all_fail_stops_after_three_in_a_row(tmp_path: Path) -> None:
    result = run_cli(
        *search(tmp_path, "data.batch_size=0", "hydra.sweeper.n_trials=5"), cwd=tmp_path
    )
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "3 of 3 jobs failed" in line and "data.batch_size=0" in line, line
    assert "3 trials in a row failed" in result.stdout
    assert list(study_states(tmp_path).values()) == [["FAIL"] * 3]
    assert [row["status"] for row in summary_rows(tmp_path / "sweep")] == ["FAILED"] * 3
    assert_picture(tmp_path / "sweep" / "summary.png")


def test_another_search_is_refused_the_folder_of_a_study(tmp_path: Path) -> None:
    """Other study settings (here the direction) make another study, which would number its
    trials from 0 again in the folder of the first."""
    first = run_cli(
        *search(tmp_path, *PINNED, *SHORT_RUN, "hydra.sweeper.n_trials=1"), cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    sweep_dir = tmp_path / "sweep"
    folder = sorted(str(p) for p in sweep_dir.rglob("*"))
    recorded = (sweep_dir / "0" / ".hydra" / "overrides.yaml").read_text()
    studies = study_states(tmp_path)

    refused = []
    for direction in ("maximize", "minimize"):
        other = run_cli(
            *search(tmp_path, *PINNED, *SHORT_RUN, "hydra.sweeper.n_trials=1"),
            f"hydra.sweeper.direction={direction}", cwd=tmp_path,
        )  # fmt: skip
        if other.returncode == 0:  # the first study's own direction: it is complete already
            continue
        assert other.returncode == 1
        refused.append(error_line(other.stderr))
    (line,) = refused
    assert "hydra.sweeper.direction" in line and "hydra.sweep.dir=" in line, line
    assert sorted(str(p) for p in sweep_dir.rglob("*")) == folder
    assert (sweep_dir / "0" / ".hydra" / "overrides.yaml").read_text() == recorded
    assert study_states(tmp_path) == studies, "no second study in the storage"


def test_a_failed_job_leaves_the_summary_and_one_error_line(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "-m", PACKAGE, "--multirun", *FAST, "data.batch_size=0,32",
        f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "1 of 2 jobs failed" in line and "#0 (data.batch_size=0)" in line, line
    assert [row["status"] for row in summary_rows(sweep_dir)] == ["FAILED", "COMPLETED"]
    assert_picture(sweep_dir / "summary.png")
    assert_fits_a_terminal(sweep_dir / "summary.md")


def assert_fits_a_terminal(summary: Path) -> None:
    lines = summary.read_text().splitlines()
    assert max(len(line) for line in lines) <= TERMINAL, "\n".join(lines)


# What a sweep's summary.md fits: a terminal's width.
TERMINAL = 100
METRICS = {
    "val/acc": 0.912345, "val/loss": 0.2871234, "test/acc": 0.9051, "test/loss": 0.30123456,
    "train/loss": 0.1876543, "perf/samples_per_sec": 12345.678, "perf/tflops": 0.0123456,
}  # fmt: skip


def test_a_sweeps_summary_md_holds_each_jobs_parameters_and_objective_in_a_terminals_width(
    tmp_path: Path,
) -> None:
    """summary.md is the table to read in a terminal: job, parameters, status and the optimized
    metric; every metric and each run directory stay in summary.csv."""
    sweep_dir = tmp_path / "logs" / "train" / "multiruns" / "lr=0.001,0.003,seed=1,2"
    jobs = [["model.optimizer.lr=0.001", "seed=1"], ["model.optimizer.lr=0.0030001", "seed=2"]]
    for number, overrides in enumerate(jobs):
        job = sweep_dir / str(number)
        (job / ".hydra").mkdir(parents=True)
        written = OmegaConf.create([*overrides, "trainer=cpu"])  # trainer=cpu, in both: left out
        OmegaConf.save(written, job / ".hydra" / "overrides.yaml")
        (job / "metrics.json").write_text(json.dumps(METRICS))
        record_job_status(job, "COMPLETED")
    write_summary(sweep_dir, collect_jobs(sweep_dir), "val/acc")
    assert_fits_a_terminal(sweep_dir / "summary.md")
    header, divider, *rows = (sweep_dir / "summary.md").read_text().splitlines()[:4]
    assert header.split() == ["|", "job", "|", "overrides", "|", "status", "|", "val/acc", "|"]
    assert set(divider) == {"|", " ", "-"} and len(divider) == len(header)
    assert [row.split() for row in rows] == [
        ["|", "0", "|", "lr=0.001", "seed=1", "|", "COMPLETED", "|", "0.912", "|"],
        ["|", "1", "|", "lr=0.003", "seed=2", "|", "COMPLETED", "|", "0.912", "|"],
    ]
    csv_rows = summary_rows(sweep_dir)
    assert [row["run_dir"] for row in csv_rows] == [str(sweep_dir / "0"), str(sweep_dir / "1")]
    assert all(float(row[name]) == value for row in csv_rows for name, value in METRICS.items())


def test_a_failed_trial_fails_the_search_after_its_summary(tmp_path: Path) -> None:
    """Trials sampled from batch sizes 0 (which fails) and 16: with the sampler's seed 1 the
    second of three is 0 (each trial is sampled with the seed plus its number)."""
    pinned = [o for o in PINNED if not o.startswith("data.batch_size=")]
    result = run_cli(
        *search(tmp_path, *pinned, *SHORT_RUN, "model.optimizer.lr=0.003", "hydra.sweeper.seed=1",
                "hydra.sweeper.n_trials=2", "data.batch_size=choice(0,16)"),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    ((name, states),) = study_states(tmp_path).items()
    assert states.count("COMPLETE") == 2 and states.count("FAIL") == 1, states
    line = error_line(result.stderr)
    assert f"1 of {len(states)} jobs failed" in line and "data.batch_size=0" in line, line
    sweep_dir = tmp_path / "sweep"
    rows = summary_rows(sweep_dir)
    assert [row["status"] for row in rows] == [
        "COMPLETED" if state == "COMPLETE" else "FAILED" for state in states
    ]
    assert OmegaConf.load(sweep_dir / "optimization_results.yaml").study_name == name
    assert_picture(sweep_dir / "summary.png")


def test_a_search_is_refused_the_folder_of_another_sweep(tmp_path: Path) -> None:
    (tmp_path / "sweep" / "0" / ".hydra").mkdir(parents=True)
    result = run_cli(*search(tmp_path, "model.optimizer.lr=0.001,0.002"), cwd=tmp_path)
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "holds the jobs of another sweep" in line and "hydra.sweep.dir=" in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".hydra", "0", "sweep"]


def test_a_study_kept_in_memory_is_refused_the_folder_of_its_last_launch(tmp_path: Path) -> None:
    """A new study numbers its trials from 0 again: it would train over the last launch's."""
    command = search(tmp_path, "data.batch_size=0", "hydra.sweeper.storage=null")
    assert run_cli(*command, cwd=tmp_path).returncode == 1  # three trials, failed
    folder = sorted(str(p) for p in tmp_path.rglob("*"))
    again = run_cli(*command, cwd=tmp_path)
    assert again.returncode == 1
    line = error_line(again.stderr)
    assert "holds trials up to #2" in line and "hydra.sweep.dir=" in line, line
    assert sorted(str(p) for p in tmp_path.rglob("*")) == folder


def test_a_search_on_a_study_file_that_another_search_holds_is_refused_before_touching_it(
    tmp_path: Path,
) -> None:
    """Whatever its sweep folder: the lock is the study file's own (`<file>.lock`)."""
    database = tmp_path / "search.db"
    with held(Path(f"{database}.lock"), "a study", "this test", "elsewhere"):
        result = run_cli(*search(tmp_path, "hydra.sweeper.n_trials=1"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert f"the study storage sqlite:///{database} is in use by process {os.getpid()}" in line
    assert "hydra.sweeper.storage=sqlite:///<file>" in line, line
    assert not database.exists() and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_two_searches_started_at_once_on_one_study_file_run_one(tmp_path: Path) -> None:
    """Ten times, two drivers started together on a fresh study file, each with a sweep folder of
    its own: one runs the search, the other is refused in one line before it writes anything;
    the study holds n_trials trials, never more."""
    import optuna

    for attempt in range(10):
        folder = tmp_path / str(attempt)
        storage = f"sqlite:///{folder / 'search.db'}"
        commands = [
            [sys.executable, *search(folder, "hydra.sweeper.n_trials=1", *TINY),
             f"hydra.sweep.dir={folder / f'sweep{index}'}"]
            for index in range(2)
        ]  # fmt: skip
        drivers = [
            subprocess.Popen(
                command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            for command in commands
        ]
        ended = [(driver.wait(timeout=300), driver.communicate()[1]) for driver in drivers]
        codes = sorted(code for code, _ in ended)
        assert codes == [0, 1], (attempt, ended)
        (refusal,) = [stderr for code, stderr in ended if code == 1]
        assert "the study storage" in error_line(refusal) and "in use by process" in refusal
        (name,) = optuna.get_all_study_names(storage)
        trials = optuna.load_study(study_name=name, storage=storage).trials
        assert [trial.state.name for trial in trials] == ["COMPLETE"], (attempt, trials)
        assert len(list(folder.glob("sweep*/0/.hydra"))) == 1, "the refused search made no job"


def test_a_search_started_beside_itself_is_refused_before_it_touches_the_study(
    tmp_path: Path,
) -> None:
    """Its trials left running are the other launch's, not a crash's: they stay as they are."""
    import optuna

    with hold(tmp_path / "sweep"):  # this process stands for the search already running
        storage = f"sqlite:///{tmp_path / 'search.db'}"
        result = run_cli(*search(tmp_path, "hydra.sweeper.n_trials=1"), cwd=tmp_path)
        assert result.returncode == 1
        assert f"in use by process {os.getpid()}" in error_line(result.stderr)
        assert "hydra.sweep.dir=<folder>" in result.stderr
        (name,) = optuna.get_all_study_names(storage)
        study = optuna.load_study(study_name=name, storage=storage)
        running = study.ask()
        again = run_cli(*search(tmp_path, "hydra.sweeper.n_trials=1"), cwd=tmp_path)
        assert again.returncode == 1
    assert study.trials[running.number].state == optuna.trial.TrialState.RUNNING
    assert not list((tmp_path / "sweep").glob("*/.hydra"))


def study_of(completed: int, pruned: int = 1) -> Any:
    """A study of `completed` trials with a value and `pruned` ones stopped after reporting,
    numbered in turn from 0 (a pruned one third)."""
    import optuna

    study = optuna.create_study(direction="maximize")
    space = {
        "lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
        "dropout": optuna.distributions.FloatDistribution(0.0, 0.5),
    }
    states = ["COMPLETE"] * completed
    for _ in range(pruned):
        states.insert(min(2, len(states)), "PRUNED")
    for number, state in enumerate(states):
        params = {"lr": 1e-4 * (1 + number), "dropout": 0.05 * number}
        if state == "COMPLETE":
            trial = optuna.trial.create_trial(
                params=params, distributions=space, value=0.5 + 0.1 * (number % 3)
            )
        else:
            trial = optuna.trial.create_trial(
                params=params, distributions=space, state=optuna.trial.TrialState.PRUNED,
                intermediate_values={10: 0.3, 20: 0.2},
            )  # fmt: skip
        study.add_trial(trial)
    return study


@pytest.mark.parametrize(("completed", "drawn"), [(3, False), (5, True)])
def test_parameter_importances_are_drawn_from_five_completed_trials_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, completed: int, drawn: bool
) -> None:
    """From fewer, a ranking of the parameters is noise: one log line says why it is missing."""
    from hydra_plugins.{{ cookiecutter.package_name }}_optuna_sweeper._impl import (
        draw_study,
    )

    with caplog.at_level(logging.INFO):
        draw_study(study_of(completed), tmp_path, "val/acc")
    assert_picture(tmp_path / "optimization_history.png")
    assert (tmp_path / "param_importances.png").is_file() == drawn
    reasons = [r.getMessage() for r in caplog.records if "param_importances" in r.getMessage()]
    if drawn:
        assert_picture(tmp_path / "param_importances.png")
        assert reasons == []
    else:
        assert reasons == [
            "param_importances.png not drawn: 3 trials completed, and ranking the parameters "
            "takes 5."
        ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "all drawn"


def test_the_history_numbers_trials_in_whole_numbers_and_shows_the_pruned_ones() -> None:
    import matplotlib.pyplot as plt

    from hydra_plugins.{{ cookiecutter.package_name }}_optuna_sweeper._impl import (
        draw_history,
    )

    figure = draw_history(study_of(3), "val/acc")
    (axes,) = figure.axes
    figure.canvas.draw()
    ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    lines = {line.get_label(): line for line in axes.get_lines()}
    pruned = next(line for label, line in lines.items() if label.startswith("pruned"))
    assert list(pruned.get_xdata()) == [2] and list(pruned.get_ydata()) == [0.2]
    assert pruned.get_marker() != lines["completed"].get_marker()
    assert list(lines["completed"].get_xdata()) == [0, 1, 3]
    assert list(lines["best so far"].get_ydata()) == pytest.approx([0.5, 0.6, 0.6])
    assert axes.get_xlabel() == "trial" and axes.get_ylabel() == "val/acc"
    plt.close(figure)
