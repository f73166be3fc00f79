from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .helpers import TEMPLATE

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
