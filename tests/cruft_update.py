"""Bake a project with cruft from an older commit of the template, edit it as its user would, then
bring it up to the current template with `cruft update`.

The template lives in a temporary git repository of two commits: "older" (the current template
with one file removed, one config value and one README line changed) and "current" (the template
as it is in this checkout). Git and cookiecutter read only the settings given here, never the
user's, and nothing reaches the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cookiecutter.main import cookiecutter

from .helpers import TEMPLATE, run

PROJECT_TEMPLATE = "{{cookiecutter.project_slug}}"
PACKAGE_TEMPLATE = "{{cookiecutter.package_name}}"
GIT_SETTINGS = {
    "user.name": "test",
    "user.email": "test@example.com",
    "commit.gpgsign": "false",
    "tag.gpgsign": "false",
    "init.defaultBranch": "main",
}
GIT_DATE = "2024-01-01T00:00:00+00:00"


@dataclass(frozen=True)
class Edit:
    """Replace `before` by `after` in the file at `path` (`{package}` stands for the package)."""

    path: str
    before: str
    after: str

    def in_project(self, package: str) -> str:
        return self.path.format(package=package)

    def in_template(self) -> str:
        return f"{PROJECT_TEMPLATE}/{self.path.format(package=PACKAGE_TEMPLATE)}"


REMOVED_FILE = "docs/benchmarks.md"
OLDER_TEMPLATE = (
    Edit(
        "src/{package}/configs/callbacks/early_stopping.yaml", "  patience: 10\n", "  patience: 5\n"
    ),
    Edit(
        "README.md",
        "Every run is one command; every choice (data, model, accelerator, precision, logger) is a "
        "config.\n",
        "Every run is one command, configured by Hydra.\n",
    ),
)
USER_EDIT = Edit(
    "src/{package}/configs/trainer/default.yaml", "max_epochs: 10\n", "max_epochs: 25\n"
)
USER_README_SECTION = "\n## Our lab's notes\n\nWe train on the shared GPU box; see NOTES.md.\n"
USER_FILE = "NOTES.md"
USER_FILE_TEXT = "# Notes\n\nRuns to repeat after the next template update.\n"


@dataclass(frozen=True)
class UpdatedProject:
    """A project baked from the older template, edited by its user and updated to the current one."""

    project: Path
    template_repo: Path
    older_commit: str
    current_commit: str
    answers: dict[str, str]
    package: str
    created: subprocess.CompletedProcess[str]
    check_before: subprocess.CompletedProcess[str]
    updated: subprocess.CompletedProcess[str]
    env: dict[str, str]

    @property
    def user_edited(self) -> set[str]:
        return {USER_EDIT.in_project(self.package), "README.md"}

    def cruft(self, *args: str) -> subprocess.CompletedProcess[str]:
        return cruft(self.project, self.env, *args)


def isolated_env(root: Path) -> dict[str, str]:
    """Environment for git and cookiecutter: only these settings, fixed dates, no prompts."""
    config = root / "cookiecutterrc.json"
    config.write_text(
        json.dumps(
            {
                "cookiecutters_dir": str(root / "cookiecutters"),
                "replay_dir": str(root / "replay"),
                "default_context": {},
            }
        )
    )
    env = {
        "COOKIECUTTER_CONFIG": str(config),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_DATE": GIT_DATE,
        "GIT_COMMITTER_DATE": GIT_DATE,
        "GIT_CONFIG_COUNT": str(len(GIT_SETTINGS)),
    }
    for index, (key, value) in enumerate(GIT_SETTINGS.items()):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env


def succeeded(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if result.returncode != 0:
        command = " ".join(map(str, result.args))
        raise AssertionError(f"{command} failed:\n{result.stdout}\n{result.stderr}")
    return result


def git(directory: Path, env: dict[str, str], *args: str) -> str:
    return succeeded(run(["git", *args], directory, timeout=120, **env)).stdout.strip()


def cruft(directory: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "cruft", *args], directory, timeout=300, **env)


def commit_all(directory: Path, env: dict[str, str], message: str) -> str:
    git(directory, env, "add", "--all")
    git(directory, env, "commit", "--quiet", "--message", message)
    return git(directory, env, "rev-parse", "HEAD")


def replace_once(path: Path, before: str, after: str) -> None:
    text = path.read_text()
    if text.count(before) != 1:
        raise AssertionError(
            f"{path} no longer holds {before!r} exactly once: update tests/cruft_update.py"
        )
    path.write_text(text.replace(before, after))


def template_files() -> list[str]:
    """The template's tracked and untracked, not ignored, files (read-only git)."""
    listed = subprocess.run(
        [
            "git",
            "-C",
            str(TEMPLATE),
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    ).stdout
    return sorted({name for name in listed.split("\0") if name and (TEMPLATE / name).is_file()})


def template_repository(repo: Path, env: dict[str, str]) -> tuple[str, str]:
    """A git repository of the template with an older commit and the current one on top."""
    names = template_files()
    for name in names:
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TEMPLATE / name, target)
    git(repo, env, "init", "--quiet")
    current = {name: (repo / name).read_bytes() for name in names}

    removed = repo / PROJECT_TEMPLATE / REMOVED_FILE
    if not removed.is_file():
        raise AssertionError(f"{removed} is gone from the template: update tests/cruft_update.py")
    removed.unlink()
    for edit in OLDER_TEMPLATE:
        replace_once(repo / edit.in_template(), edit.before, edit.after)
    older = commit_all(repo, env, "Older template")

    for name, content in current.items():
        (repo / name).write_bytes(content)
    return older, commit_all(repo, env, "Current template")


def edit_as_user(project: Path, package: str, env: dict[str, str]) -> None:
    replace_once(project / USER_EDIT.in_project(package), USER_EDIT.before, USER_EDIT.after)
    with (project / "README.md").open("a") as readme:
        readme.write(USER_README_SECTION)
    (project / USER_FILE).write_text(USER_FILE_TEXT)
    commit_all(project, env, "User's own changes")


def bake_older_then_update(tmp_path: Path, **answers: str) -> UpdatedProject:
    """`cruft create` from the older template commit, commit it with the user's edits on top, then
    `cruft update` to the current commit; stdin is /dev/null, so any prompt fails the run."""
    env = isolated_env(tmp_path)
    repo = tmp_path / "template"
    repo.mkdir()
    older, current = template_repository(repo, env)

    output = tmp_path / "projects"
    output.mkdir()
    create = ["create", str(repo), "--checkout", older, "--no-input", "--output-dir", str(output)]
    created = succeeded(cruft(tmp_path, env, *create, "--extra-context", json.dumps(answers)))
    (project,) = output.iterdir()
    context = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    package = context["package_name"]

    git(project, env, "init", "--quiet")
    commit_all(project, env, "Bake from the template")
    edit_as_user(project, package, env)

    check_before = cruft(project, env, "check", "--checkout", current)
    update = ["update", "--checkout", current, "--skip-apply-ask", "--allow-untracked-files"]
    updated = succeeded(cruft(project, env, *update))
    return UpdatedProject(
        project=project,
        template_repo=repo,
        older_commit=older,
        current_commit=current,
        answers={key: value for key, value in context.items() if not key.startswith("_")},
        package=package,
        created=created,
        check_before=check_before,
        updated=updated,
        env=env,
    )


def bake_current(tmp_path: Path, env: dict[str, str], **answers: str) -> Path:
    """A fresh cookiecutter bake of this checkout's template with the same answers."""
    config = env["COOKIECUTTER_CONFIG"]
    output = tmp_path / "fresh"
    baked = cookiecutter(
        str(TEMPLATE),
        no_input=True,
        extra_context=answers,
        output_dir=str(output),
        config_file=config,
    )
    return Path(baked)
