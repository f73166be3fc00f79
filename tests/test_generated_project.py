"""Baked projects pass their own lint, type check and tests, installed into this venv with
--no-deps and run in subprocesses with the outer pytest's environment removed. One of them is not
a fresh bake: it was baked from an older template commit, edited and then `cruft update`d. The
default project's tests that it marks `slow` (full experiments, the kill and signal harnesses,
the clusters) run in a test of their own, marked `project_slow`: `make test-all` and CI run it,
`make test` does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import CRUFT_ANSWERS, Bake
from .helpers import INNER_DURATIONS, run

UPDATED_BY_CRUFT = "vision-tensorboard-py310-cruft-updated"
# The defaults (both examples) run every fast test. The other bakes run the tests whose code or
# configs change with the answers and their example's own tests: the kill, signal, sweep and
# cluster harnesses are the same code in every bake and run once, in the defaults' slow tests.
ANSWER_DEPENDENT = [
    "test_command_line.py", "test_configs.py", "test_errors.py", "test_doctor.py",
    "test_targets.py", "test_bench.py", "test_package_layers.py", "test_runs.py",
]  # fmt: skip
COMBINATIONS = {
    "defaults": ({}, "not slow and not gpu", []),
    UPDATED_BY_CRUFT: (
        CRUFT_ANSWERS,
        "not slow and not gpu",
        [*ANSWER_DEPENDENT, "test_vision.py", "test_use_vision.py", "test_image_folder.py"],
    ),
    "language-csv-py313": (
        {"examples": "language", "logger": "csv", "python_version": "3.13", "dockerfile": "no"},
        "not slow and not gpu",
        [*ANSWER_DEPENDENT, "test_language.py", "test_use_language.py"],
    ),
}


def check(result: subprocess.CompletedProcess[str], what: str) -> None:
    """A failed step shows its output's end and, for pytest, the start of its failures."""
    failures = result.stdout.find("= FAILURES =")
    first = result.stdout[failures : failures + 16000] if failures >= 0 else ""
    output = f"{first}\n[...]\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"{what} failed:\n{output}"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMBINATIONS))
def test_generated_project_passes_its_own_checks(
    bake: Bake, mypy_cache: Path, tmp_path: Path, request: pytest.FixtureRequest, case: str
) -> None:
    answers, markers, test_files = COMBINATIONS[case]
    if case == UPDATED_BY_CRUFT:
        project = tmp_path / "updated"
        shutil.copytree(request.getfixturevalue("cruft_updated").project, project, symlinks=True)
    else:
        result = bake(**answers)
        assert result.exit_code == 0, result.exception
        project = Path(result.project_path)
    python = sys.executable

    install(project)
    check(run([python, "-m", "ruff", "check", "."], project), "ruff check")
    check(run([python, "-m", "ruff", "format", "--check", "."], project), "ruff format")
    check(run([python, "-m", "mypy"], project, MYPY_CACHE_DIR=str(mypy_cache)), "mypy")
    if not (project / ".git").exists():
        check(run(["git", "init", "--quiet"], project), "git init")
    check(run(["git", "add", "--all"], project), "git add")
    hooks = run(
        [python, "-m", "pre_commit", "run", "--all-files"],
        project,
        MYPY_CACHE_DIR=str(mypy_cache),
        PRE_COMMIT_HOME=str(tmp_path / "pre-commit"),
    )
    check(hooks, "pre-commit (the same ruff and mypy, offline)")
    run_tests(project, markers, test_files)


@pytest.mark.slow
@pytest.mark.project_slow
def test_the_default_projects_slow_tests_pass(bake: Bake) -> None:
    """Full experiments, runs killed and signalled in every phase, SLURM, torchrun and Optuna
    under faults: the same code in every bake, so run once, in the defaults (both examples)."""
    result = bake()
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)
    install(project)
    tests = run_tests(project, "slow and not gpu", [])
    if os.geteuid() == 0 and shutil.which("slurmctld"):
        assert "no local SLURM cluster" not in tests.stdout, "the SLURM tests ran"


def install(project: Path) -> None:
    """The baked project into this venv, editable, without its dependencies (they are here)."""
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."]
    check(run(pip, project), "pip install")


def run_tests(
    project: Path, markers: str, test_files: list[str]
) -> subprocess.CompletedProcess[str]:
    """The project's pytest on two processes (this machine's cores); a test file stays on one,
    sharing its fixtures."""
    parallel = ["-p", "xdist", "-n", "2", "--dist", "loadfile"]
    tests = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers,
         "--durations=12", *parallel, *(f"tests/{name}" for name in test_files)],
        project,
    )  # fmt: skip
    slowest = tests.stdout.find("slowest 12 durations")
    if slowest >= 0:  # shown at the end of the outer run (conftest.py), to size the suites
        INNER_DURATIONS.append(f"{project.name}, -m {markers!r}:\n{tests.stdout[slowest:]}")
    check(tests, "pytest")
    assert " passed" in tests.stdout and " failed" not in tests.stdout
    print(f"{project}, -m {markers!r}: {tests.stdout.strip().splitlines()[-1]}")  # pytest -rP
    return tests
