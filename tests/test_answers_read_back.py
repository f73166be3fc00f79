"""Every answer reads back as the same string wherever the bake writes it into YAML, TOML, JSON or
Python: `yes`, `null`, `1.10` or `#x` written bare into YAML would read back as true, None, 1.1 or
nothing.

A bake with plain marker answers finds where each answer lands (a value or key of a parsed file,
a string constant of a Python file); the same places of a bake with hostile answers must hold the
hostile text exactly, as PyYAML, OmegaConf (the Hydra configs), tomllib, json and ast read it.
"""

from __future__ import annotations

import ast
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from .helpers import CHOICES, TEMPLATE, tomllib

HOSTILE = ["yes", "null", "1.10", "~", "true", "0x1F", "1e3", "on", "'quoted'", "a: b", "#x"]
# Where the answers' rules allow them: a slug is a distribution name, a package an identifier.
VALID_SLUGS = {"yes", "null", "1.10", "true", "0x1F", "1e3", "on"}
VALID_PACKAGES = {"yes", "null", "true", "on"}
MARKERS = {
    "project_name": "Zzname",
    "project_slug": "zzslug",
    "package_name": "zzpkg",
    "description": "Zzdescription",
    "author_name": "Zzauthor",
}
LOGGERS = CHOICES["logger"]

Places = dict[tuple[str, str], Any]


def hostile_answers(value: str) -> dict[str, str]:
    return {
        "project_name": value,
        "project_slug": value if value in VALID_SLUGS else "hostile-slug",
        "package_name": value if value in VALID_PACKAGES else "hostile_pkg",
        "description": value,
        "author_name": value,
    }


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """Every scalar of a parsed document, by its path of keys and indices."""
    if isinstance(value, dict):
        return {
            key: scalar
            for name, item in value.items()
            for key, scalar in flatten(item, f"{path}/{name}").items()
        }
    if isinstance(value, list):
        return {
            key: scalar
            for index, item in enumerate(value)
            for key, scalar in flatten(item, f"{path}/{index}").items()
        }
    return {path: value}


def places(project: Path) -> Places:
    """(file, path) -> value, for every scalar of the YAML, TOML and JSON files (the Hydra configs
    also as OmegaConf reads them) and every string constant of the Python files."""
    found: Places = {}
    for file in sorted(project.rglob("*")):
        relative = str(file.relative_to(project))
        if file.suffix in (".yaml", ".yml"):
            found |= {
                (relative, p): v for p, v in flatten(yaml.safe_load(file.read_text())).items()
            }
            if "/configs/" in relative:
                loaded = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
                found |= {(f"omegaconf:{relative}", p): v for p, v in flatten(loaded).items()}
        elif file.suffix == ".toml":
            found |= {(relative, p): v for p, v in flatten(tomllib.loads(file.read_text())).items()}
        elif file.suffix == ".json":
            found |= {(relative, p): v for p, v in flatten(json.loads(file.read_text())).items()}
        elif file.suffix == ".py":
            constants = [
                node.value
                for node in ast.walk(ast.parse(file.read_text()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
            ]
            found |= {(relative, f"constant {i}"): v for i, v in enumerate(constants)}
    return found


def substitute(text: str, answers: dict[str, str]) -> str:
    for field, marker in MARKERS.items():
        text = text.replace(marker, answers[field])
    return text


def bake(cookies_session: Any, **answers: str) -> Path:
    result = cookies_session.bake(extra_context=answers, template=str(TEMPLATE))
    assert result.exit_code == 0, result.exception
    return Path(result.project_path)


@cache
def marker_places(logger: str, cookies_session: Any) -> Places:
    """Where the marker answers land: the places whose path or value holds a marker."""
    found = places(bake(cookies_session, logger=logger, **MARKERS))
    return {
        (file, path): value
        for (file, path), value in found.items()
        if any(
            marker in f"{path} {value if isinstance(value, str) else ''}"
            for marker in MARKERS.values()
        )
    }


@pytest.mark.parametrize("value", HOSTILE)
def test_every_answer_reads_back_as_written(cookies_session: Any, value: str) -> None:
    logger = LOGGERS[HOSTILE.index(value) % len(LOGGERS)]
    answers = hostile_answers(value)
    expected_places = marker_places(logger, cookies_session)
    assert {
        ("pyproject.toml", "/project/name"),
        ("pyproject.toml", "/project/description"),
        ("pyproject.toml", "/project/authors/0/name"),
        (".cookiecutter.json", "/project_name"),
    } <= set(expected_places), "the marker bake must find where the answers land"
    package_dir = f"src/{MARKERS['package_name']}/configs"
    assert ("omegaconf:" + package_dir + "/hydra/default.yaml", "/help/app_name") in expected_places
    if logger == "wandb":
        assert (package_dir + "/logger/wandb.yaml", "/wandb/project") in expected_places

    found = places(bake(cookies_session, logger=logger, **answers))
    wrong = {}
    for (file, path), marker_value in expected_places.items():
        place = (substitute(file, answers), substitute(path, answers))
        expected = [
            substitute(marker_value, answers) if isinstance(marker_value, str) else marker_value
        ]
        if file.startswith("deploy/"):  # names derived from the slug, as Kubernetes takes them
            slug = answers["project_slug"].lower()
            derived = slug.replace("_", "-").replace(".", "-")[:40].strip("-")
            expected += [
                substitute(marker_value.replace(MARKERS["project_slug"], name), answers)
                for name in (slug, derived)
            ]
        if place not in found or found[place] not in expected:
            wrong[place] = found.get(place, "<missing>")
    assert wrong == {}, f"{value!r} did not read back: {wrong}"
