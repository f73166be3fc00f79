from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .cruft_update import UpdatedProject, bake_older_then_update
from .helpers import INNER_DURATIONS, TEMPLATE

Bake = Callable[..., Any]


@pytest.fixture
def bake(cookies: Any) -> Bake:
    """Bake the template with these answers (pytest-cookies' Result: exit_code, project_path)."""

    def make(**answers: str) -> Any:
        return cookies.bake(extra_context=answers, template=str(TEMPLATE))

    return make


@pytest.fixture(scope="session")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for every baked project: torch's stubs are analysed once, not per bake."""
    return tmp_path_factory.mktemp("mypy-cache")


CRUFT_ANSWERS = {
    "examples": "vision",
    "logger": "tensorboard",
    "python_version": "3.10",
    "license": "none",
}


@pytest.fixture(scope="session")
def cruft_updated(tmp_path_factory: pytest.TempPathFactory) -> UpdatedProject:
    """A project baked by cruft from an older template commit, edited by its user, then updated to
    the current template (`tests/cruft_update.py`); shared by the update's own tests and the
    lint, type check and test run of the result."""
    return bake_older_then_update(tmp_path_factory.mktemp("cruft"), **CRUFT_ANSWERS)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for report in INNER_DURATIONS:
        terminalreporter.write_sep("=", "inside a baked project")
        terminalreporter.write_line(report.rstrip())
