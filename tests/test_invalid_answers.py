"""Bad answers stop generation with one line naming the field, the value and the rule; exit 1;
nothing is left on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import TEMPLATE, run

INVALID = {
    "stdlib-shadow": ("package_name", "os"),
    "starts-with-digit": ("package_name", "1abc"),
    "dash": ("package_name", "a-b"),
    "code-injection": ("package_name", "x; import os"),
    "keyword": ("package_name", "class"),
    "dependency-shadow": ("package_name", "torch"),
    "uppercase": ("package_name", "MyPackage"),
    "quote-injection": ("package_name", 'x"""; import os; """'),
    "bad-slug": ("project_slug", "-bad slug-"),
    "bad-email": ("author_email", "not-an-email"),
    "newline-in-description": ("description", "line one\nline two"),
    "empty-name": ("project_name", " "),
    "quote-in-email": ("author_email", 'a"b@example.com'),
    "space-in-email": ("author_email", "a b@example.com"),
    "shadows-a-dependency-of-a-dependency": ("package_name", "tqdm"),
    "too-long-for-its-own-lint": ("package_name", "p" * 65),
}


def run_cookiecutter(output_dir: Path, **answers: str) -> subprocess.CompletedProcess[str]:
    overrides = [f"{key}={value}" for key, value in answers.items()]
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(output_dir)]
    return run([*command, str(TEMPLATE), *overrides], cwd=output_dir, timeout=120)


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_answer_is_rejected(tmp_path: Path, case: str) -> None:
    field, value = INVALID[case]
    result = run_cookiecutter(tmp_path, **{field: value})
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()  # the hook's line only: no traceback after it
    assert line.startswith(f"ERROR: {field}=") and line.endswith(f"a valid {field}.")
    assert list(tmp_path.iterdir()) == [], "a rejected bake must leave nothing on disk"


def test_valid_defaults_from_the_command_line(tmp_path: Path) -> None:
    result = run_cookiecutter(tmp_path)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["lightning-hydra-project"]
    assert "lightning_hydra_project-train" in result.stdout


def test_every_module_of_the_dependency_closure_is_refused_as_a_package_name() -> None:
    """The hook's list against what this venv, which holds the generated project's dependencies
    and dev tools, can import from their distributions."""
    import importlib.metadata
    import re

    from packaging.requirements import Requirement

    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    listed = set(re.findall(r'"([a-z_][a-z0-9_]*)"', hook[hook.index("DEPENDENCY_MODULES") :]))
    roots = ["torch", "lightning", "torchmetrics", "hydra-core", "hydra-joblib-launcher"]
    roots += ["hydra-submitit-launcher", "optuna", "wandb", "tensorboard", "pytest", "ruff", "mypy"]
    roots += ["matplotlib"]
    seen: set[str] = set()
    modules: set[str] = set()
    while roots:
        name = re.sub(r"[-_.]+", "-", roots.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        distribution = importlib.metadata.distribution(name)
        for requirement in map(Requirement, distribution.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                roots.append(requirement.name)
        top_level = distribution.read_text("top_level.txt") or ""
        modules |= {line.strip() for line in top_level.split()}
    importable = {m for m in modules if re.fullmatch(r"[a-z][a-z0-9_]*", m)}
    assert importable and importable <= listed, sorted(importable - listed)
