"""The generated project's GitHub Actions workflow passes actionlint (any finding fails), runs the
project's fast tests on every Python version it supports, and keeps its lint and type checks."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import Bake
from .helpers import DEFAULTS

WORKFLOW = Path(".github") / "workflows" / "ci.yaml"
# requirements-dev.txt installs actionlint (a wheel that ships its binary) on these machines only.
HAS_ACTIONLINT_WHEEL = sys.platform == "linux" and platform.machine() == "x86_64"


def actionlint() -> str:
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which(
        "actionlint"
    )
    if found is None:
        if HAS_ACTIONLINT_WHEEL:
            pytest.fail("actionlint is missing: pip install -r requirements-dev.txt")
        pytest.skip("no actionlint wheel for this platform")
    return found


def lint(workflow: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [actionlint(), "-no-color", str(workflow)],
        capture_output=True, text=True, timeout=120, cwd=workflow.parents[2],
    )  # fmt: skip


def baked_workflow(bake: Bake, **answers: str) -> Path:
    result = bake(**answers)
    assert result.exit_code == 0, result.exception
    return Path(result.project_path) / WORKFLOW


@pytest.mark.parametrize(
    "answers",
    [
        {},
        {"logger": "csv", "python_version": "3.13"},
        {"logger": "tensorboard", "python_version": "3.10"},
    ],
    ids=["defaults", "csv-3.13", "tensorboard-3.10"],
)
def test_the_workflow_passes_actionlint(bake: Bake, answers: dict[str, str]) -> None:
    checked = lint(baked_workflow(bake, **answers))
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


def test_actionlint_finds_a_broken_workflow(bake: Bake) -> None:
    """The check can fail: a misspelt matrix key in an expression is a finding."""
    workflow = baked_workflow(bake)
    text = workflow.read_text()
    assert "matrix.python-version" in text
    workflow.write_text(text.replace("matrix.python-version", "matrix.pyhton-version", 1))
    checked = lint(workflow)
    assert checked.returncode == 1 and "pyhton-version" in checked.stdout, checked.stdout


def steps_run(job: dict[str, Any]) -> list[str]:
    return [str(step.get("run", "")).strip() for step in job["steps"]]


def test_fast_tests_run_on_every_supported_python_and_lint_and_types_are_checked(
    bake: Bake,
) -> None:
    workflow = baked_workflow(bake)
    jobs = yaml.safe_load(workflow.read_text())["jobs"]
    supported = sorted(DEFAULTS["python_version"], key=lambda v: tuple(map(int, v.split("."))))
    assert jobs["test"]["strategy"]["matrix"]["python-version"] == supported
    assert jobs["test"]["strategy"]["fail-fast"] is False
    assert "make test" in steps_run(jobs["test"])
    assert {"make lint", "make typecheck"} <= set(steps_run(jobs["lint"]))
    pyproject = (workflow.parents[2] / "pyproject.toml").read_text()
    assert f'requires-python = ">={supported[0]}"' in pyproject
