"""A project baked with cruft from an older template and then edited by its user takes the current
template's changes with `cruft update`: exactly those changes, merged with the user's own, and the
result is what a fresh bake of the current template gives with the same answers."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import yaml

from .conftest import CRUFT_ANSWERS as ANSWERS
from .cruft_update import (
    OLDER_TEMPLATE,
    REMOVED_FILE,
    USER_EDIT,
    USER_FILE,
    USER_FILE_TEXT,
    USER_README_SECTION,
    UpdatedProject,
    bake_current,
    git,
)
from .helpers import BINARY_SUFFIXES, answers_with, expected_files, project_files

CONFLICT_MARKERS = ("<<<<<<< ", "=======\n", ">>>>>>> ")
CONFIG_EDIT, README_EDIT = OLDER_TEMPLATE


@pytest.fixture(scope="module")
def updated(cruft_updated: UpdatedProject) -> UpdatedProject:
    return cruft_updated


@pytest.fixture(scope="module")
def fresh(updated: UpdatedProject, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake_current(tmp_path_factory.mktemp("fresh"), updated.env, **ANSWERS)


def files(project: Path) -> set[str]:
    return {name for name in project_files(project) if Path(name).parts[0] != ".git"}


def executable(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXUSR)


def before_update(updated: UpdatedProject, name: str) -> str:
    """The file as the user last committed it, from the older template."""
    return git(updated.project, updated.env, "show", f"HEAD:{name}")


def test_removed_file_comes_back_as_the_current_template_renders_it(
    updated: UpdatedProject, fresh: Path
) -> None:
    """A file the older template lacked is added, with the current template's rendering."""
    committed = git(updated.project, updated.env, "ls-tree", "-r", "--name-only", "HEAD")
    assert REMOVED_FILE not in committed.splitlines()
    restored = updated.project / REMOVED_FILE
    assert restored.read_bytes() == (fresh / REMOVED_FILE).read_bytes()


def test_changed_config_value_and_readme_line_follow_the_current_template(
    updated: UpdatedProject,
) -> None:
    """A config value and a README line the template changed take the current template's text."""
    config = CONFIG_EDIT.in_project(updated.package)
    older = yaml.safe_load(before_update(updated, config))
    now = yaml.safe_load((updated.project / config).read_text())
    assert older["early_stopping"]["patience"] == 5
    assert now["early_stopping"]["patience"] == 10

    assert README_EDIT.after in before_update(updated, "README.md")
    readme = (updated.project / "README.md").read_text()
    assert README_EDIT.before in readme
    assert README_EDIT.after not in readme


def test_user_edits_and_files_survive(updated: UpdatedProject, fresh: Path) -> None:
    """The user's config change, README section and own file are kept; the README merges both the
    template's change and the user's section."""
    config = (updated.project / USER_EDIT.in_project(updated.package)).read_text()
    assert yaml.safe_load(config)["max_epochs"] == 25
    assert (updated.project / USER_FILE).read_text() == USER_FILE_TEXT
    readme = (updated.project / "README.md").read_text()
    assert readme == (fresh / "README.md").read_text() + USER_README_SECTION


def test_cruft_json_records_the_current_commit(updated: UpdatedProject) -> None:
    """`.cruft.json` links the project to the current commit, with the answers it was baked with."""
    state = json.loads((updated.project / ".cruft.json").read_text())
    assert state["template"] == str(updated.template_repo)
    assert state["commit"] == updated.current_commit != updated.older_commit
    assert state["checkout"] == updated.current_commit
    context = state["context"]["cookiecutter"]
    assert context["_commit"] == updated.current_commit
    assert answers_with(**ANSWERS).items() <= context.items()
    assert updated.answers.items() <= context.items()
    assert "Good work! Project's cruft has been updated" in updated.updated.stdout


def test_no_rejected_hunks_or_conflict_markers(updated: UpdatedProject) -> None:
    """The update applied cleanly: no *.rej or *.orig files, no unmerged paths, no markers."""
    leftovers = [name for name in files(updated.project) if name.endswith((".rej", ".orig"))]
    assert leftovers == []
    assert git(updated.project, updated.env, "ls-files", "--unmerged") == ""
    marked = [
        f"{name}:{number}"
        for name in sorted(files(updated.project))
        if Path(name).suffix not in BINARY_SUFFIXES
        for number, line in enumerate((updated.project / name).open(), 1)
        if line.startswith(CONFLICT_MARKERS)
    ]
    assert marked == []


def test_update_changes_exactly_what_the_template_changed(updated: UpdatedProject) -> None:
    """Against the user's last commit the update touched only the template's changes and the
    cruft state."""
    changed = set(git(updated.project, updated.env, "diff", "--name-only", "HEAD").splitlines())
    assert git(updated.project, updated.env, "ls-files", "--others", "--exclude-standard") == ""
    template_changes = {edit.in_project(updated.package) for edit in OLDER_TEMPLATE}
    assert changed == {REMOVED_FILE, ".cruft.json"} | template_changes


def test_file_set_equals_a_fresh_bake(updated: UpdatedProject, fresh: Path) -> None:
    """The updated project holds the fresh bake's files plus the user's file and `.cruft.json`,
    so the post-generation hook's deletions held on update."""
    expected = expected_files(answers_with(**ANSWERS), updated.package)
    assert files(fresh) == expected
    assert files(updated.project) == expected | {USER_FILE, ".cruft.json"}


def test_files_not_edited_by_the_user_equal_a_fresh_bake(
    updated: UpdatedProject, fresh: Path
) -> None:
    """Every file the user did not edit is byte-identical to a fresh bake, executable bit too."""
    different = [
        name
        for name in sorted(files(fresh) - updated.user_edited)
        if (updated.project / name).read_bytes() != (fresh / name).read_bytes()
        or executable(updated.project / name) != executable(fresh / name)
    ]
    assert different == []


def test_cruft_check_is_out_of_date_before_and_up_to_date_after(updated: UpdatedProject) -> None:
    """`cruft check` failed against the current commit before the update and passes after it."""
    assert updated.check_before.returncode == 1
    assert "out of date" in updated.check_before.stdout
    after = updated.cruft("check", "--checkout", updated.current_commit)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "up to date" in after.stdout
