"""Bake an answer matrix; each bake has the exact file set, no template syntax left, files that
parse, nothing of an option that was not chosen, and code that passes its own ruff settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import Bake
from .helpers import (
    CHOICES,
    TEMPLATE,
    answers_with,
    expected_files,
    leftover_template_syntax,
    parse_structured_files,
    project_files,
    run,
    tomllib,
)

MATRIX = {
    "defaults": {},
    "vision-tensorboard-py310": {
        "examples": "vision",
        "logger": "tensorboard",
        "python_version": "3.10",
        "license": "Apache-2.0",
        "github_actions": "no",
        "dockerfile": "no",
    },
    "language-csv-py313": {
        "examples": "language",
        "logger": "csv",
        "python_version": "3.13",
        "license": "BSD-3-Clause",
    },
    "no-license-py312": {
        "license": "none",
        "python_version": "3.12",
        "dockerfile": "no",
        "logger": "mlflow",
    },
    "unicode-name": {"project_name": "Ünïcødé Prøjekt für Ñeural Nets"},
    "quotes-and-backslashes": {
        "project_name": "Dr. O'Brien's \"Best\" Model",
        "author_name": 'Seán O\'Brien "Jr."',
        "description": 'Says "hi", uses \\backslashes\\ and {curly} braces & <tags>.',
    },
    "very-long-name": {"project_name": "An Extremely Long Project Name " * 8},
    "no-email": {"author_email": ""},
    "emoji-description": {"description": "Trains fast \U0001f680 and writes \u00fcmlauts"},
    "longest-package-name": {"package_name": "long_" * 12 + "name"},
}


def test_matrix_covers_every_choice() -> None:
    for field, values in CHOICES.items():
        chosen = {answers_with(**answers)[field] for answers in MATRIX.values()}
        assert chosen == set(values), f"{field}: {set(values) - chosen} never baked"


@pytest.mark.parametrize("case", list(MATRIX))
def test_bake(bake: Bake, case: str) -> None:
    result = bake(**MATRIX[case])
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)
    stored = json.loads((project / ".cookiecutter.json").read_text())
    answers = answers_with(**MATRIX[case])
    for field, value in answers.items():
        assert stored[field] == value

    package = stored["package_name"]
    assert package.isidentifier() and package.isascii()
    assert project.name == stored["project_slug"]
    assert project_files(project) == expected_files(answers, package)
    assert leftover_template_syntax(project) == []

    parsed = parse_structured_files(project)
    metadata = parsed["pyproject.toml"]["project"]
    assert metadata["name"] == stored["project_slug"]
    assert metadata["description"] == stored["description"]
    assert metadata["authors"][0]["name"] == stored["author_name"]
    assert "torch>=2.6" in metadata["dependencies"]
    assert f"{package}-train" in metadata["scripts"]

    assert_unchosen_options_absent(project, answers, parsed)
    for lint in (["check", "--no-cache", "."], ["format", "--no-cache", "--check", "."]):
        linted = run([sys.executable, "-m", "ruff", *lint], project, timeout=120)
        assert linted.returncode == 0, f"ruff {lint[0]}:\n{linted.stdout}{linted.stderr}"


def assert_unchosen_options_absent(project: Path, answers: dict[str, str], parsed: dict) -> None:
    dependencies = " ".join(parsed["pyproject.toml"]["project"]["dependencies"])
    text = {
        path: path.read_text()
        for path in project.rglob("*")
        if path.suffix in (".py", ".yaml", ".toml")
    }
    # Every logger's config is in every bake; only the chosen one's package is a dependency.
    for logger in ("wandb", "tensorboard", "mlflow"):
        assert [p.name for p in (project / "src").glob(f"*/configs/logger/{logger}.yaml")]
        if logger != answers["logger"]:
            assert logger not in dependencies
    if answers["examples"] == "vision":
        assert not [p for p, t in text.items() if "gpt" in t.lower() or "stdlib_text" in t]
    if answers["examples"] == "language":
        assert not [p for p, t in text.items() if "digits" in t or "mnist" in t.lower()]
    readme = (project / "README.md").read_text()
    if answers["dockerfile"] == "no":
        assert "docker" not in readme.lower()
    if answers["github_actions"] == "no":
        assert not (project / ".github").exists()
    license_text = parsed["pyproject.toml"]["project"].get("license")
    assert license_text == (None if answers["license"] == "none" else answers["license"])


def test_every_dependency_a_bake_can_name_is_in_the_dev_requirements(bake: Bake) -> None:
    """Baked projects are installed into this venv with --no-deps, and CI builds the venv from
    requirements-dev.txt alone: a dependency missing there fails only on a fresh machine."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lines = (TEMPLATE / "requirements-dev.txt").read_text().splitlines()
    listed = {
        canonicalize_name(Requirement(line).name)
        for line in (line.split("#")[0].strip() for line in lines)
        if line
    }
    for answers in ({}, {"logger": "tensorboard"}, {"logger": "csv", "examples": "vision"}):
        result = bake(**answers)
        assert result.exit_code == 0, result.exception
        project = tomllib.loads((Path(result.project_path) / "pyproject.toml").read_text())
        named = list(project["project"]["dependencies"])
        named += [
            d for extra in project["project"]["optional-dependencies"].values() for d in extra
        ]
        missing = {canonicalize_name(Requirement(d).name) for d in named} - listed - {"torch"}
        assert missing == set(), f"{answers}: add {sorted(missing)} to requirements-dev.txt"


def test_no_template_text_file_looks_binary() -> None:
    """cookiecutter copies files that binaryornot calls binary without rendering them; its
    heuristic has misjudged short text files (a Makefile) before."""
    from binaryornot.check import is_binary

    project_template = TEMPLATE / "{{cookiecutter.project_slug}}"
    misjudged = [
        str(path.relative_to(project_template))
        for path in project_template.rglob("*")
        if path.is_file() and path.suffix != ".gz" and is_binary(str(path))
    ]
    assert misjudged == []


def test_post_generation_hook_runs_again_cleanly(bake: Bake) -> None:
    """cruft re-runs the post-generation hook on `cruft update`: a second run changes nothing."""
    from cookiecutter.environment import StrictEnvironment

    result = bake(examples="vision", logger="csv", dockerfile="no", license="none")
    project = Path(result.project_path)
    before = project_files(project)
    context = {"cookiecutter": json.loads((project / ".cookiecutter.json").read_text())}
    hook = (TEMPLATE / "hooks" / "post_gen_project.py").read_text()
    rendered = StrictEnvironment(context=context).from_string(hook).render(**context)
    second = run([sys.executable, "-c", rendered], cwd=project, timeout=60)
    assert second.returncode == 0, second.stderr
    assert project_files(project) == before
