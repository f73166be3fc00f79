"""Bad answers stop generation with one line naming the field, the value and the rule; exit 1;
nothing is left on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from . import dependency_modules
from .helpers import DEFAULTS, TEMPLATE, answers_with, clean_env, run

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
    # Jinja syntax in an answer: cookiecutter would render the answer as a template (`{{ 7*7 }}`
    # became 49, `{#` a traceback); local_extensions.py refuses it before that.
    "jinja-comment-in-author": ("author_name", "Bob {# Smith"),
    "jinja-expression-in-name": ("project_name", "A {{ 7*7 }}"),
    "jinja-statement-in-name": ("project_name", "{% raw %}x{% endraw %}"),
    "jinja-expression-in-slug": ("project_slug", "x{{ 7*7 }}"),
    "jinja-expression-in-package": ("package_name", "{{ 'os' }}"),
    "jinja-expression-in-description": ("description", "Computes {{ 7*7 }} things"),
    "jinja-statement-in-description": ("description", "{% if true %}x{% endif %}"),
    "jinja-comment-in-description": ("description", "a {# b #} c"),
    "jinja-expression-in-author": ("author_name", "{{ cookiecutter.project_name }}"),
    "jinja-comment-in-email": ("author_email", "a{#@example.com"),
    # re.IGNORECASE's [a-z] matches these two, and pip then fails on the name.
    "kelvin-sign-in-slug": ("project_slug", "\u212aelvin"),
    "long-s-in-slug": ("project_slug", "mi\u017f\u017f"),
    "kelvin-sign-in-package": ("package_name", "\u212aelvin"),
    "long-s-in-package": ("package_name", "mi\u017f\u017f"),
    "kelvin-sign-in-email": ("author_email", "\u212a@example.com"),
    "non-ascii-digit-in-slug": ("project_slug", "a\u0663"),
    # `$` lets one trailing newline through a match; the patterns are matched whole.
    "trailing-newline-in-email": ("author_email", "a@example.com\n"),
    "trailing-newline-in-slug": ("project_slug", "abc\n"),
    "slug-too-long-for-its-file-names": ("project_slug", "s" * 101),
    # The project's folder is made before the hook runs: these are refused before it is made.
    "slug-with-a-slash": ("project_slug", "a/b"),
    "slug-out-of-the-output-dir": ("project_slug", "../escaped-the-output-dir"),
    "slug-too-long-for-a-folder": ("project_slug", "s" * 300),
    # Names Python or the project holds: `__main__` is the running program (the console scripts
    # crash), the wheel leaves `__pycache__` out, Python reserves every `__x__` name, `site`
    # imports `sitecustomize` at every start; the project has its own `hydra_plugins`, `tests`.
    "dunder-main": ("package_name", "__main__"),
    "dunder-init": ("package_name", "__init__"),
    "dunder-pycache": ("package_name", "__pycache__"),
    "imported-by-site-at-every-start": ("package_name", "sitecustomize"),
    "the-projects-own-plugins-namespace": ("package_name", "hydra_plugins"),
    "the-projects-own-tests-package": ("package_name", "tests"),
    # Modules of the dependency closure that top_level.txt does not name, or that an older list
    # missed: the baked project's imports, ruff or pytest failed (hooks/dependency_modules.txt).
    "the-serve-commands-server": ("package_name", "starlette"),
    "the-serve-commands-runner": ("package_name", "uvicorn"),
    "the-tokenizer-library": ("package_name", "tokenizers"),
    "a-dev-dependency": ("package_name", "transformers"),
    "a-dev-dependency-of-the-manifest-tests": ("package_name", "jsonschema"),
    "pytests-own-package": ("package_name", "_pytest"),
    "in-every-venv": ("package_name", "pip"),
    # The standard library of a Python the project supports, which the one running cookiecutter
    # may not have (3.12 removed distutils; 3.11 added tomllib).
    "stdlib-of-python-3-10-and-3-11": ("package_name", "distutils"),
    "stdlib-of-python-3-11-on": ("package_name", "tomllib"),
    # A byte that is not UTF-8 (`caf\xe9` from a Latin-1 shell) reaches Python as a lone
    # surrogate; no file can hold it (it ended in a traceback and a half-written project).
    "latin-1-byte-in-description": ("description", "caf\udce9"),
    "latin-1-byte-in-name": ("project_name", "caf\udce9"),
    "latin-1-byte-in-slug": ("project_slug", "caf\udce9"),
    "latin-1-byte-in-author": ("author_name", "Jos\udce9"),
    "latin-1-byte-in-email": ("author_email", "jos\udce9@example.com"),
}

# A choice answer outside its list. Cookiecutter 2.7.1 checks it in generate_context, before it
# loads any code of the template (local_extensions.py is imported later, with the Jinja
# environment; a pre_prompt hook gets no answers and its failure prints to stdout): it exits 1
# with a traceback whose last line names the field, the value and the choices, writing nothing.
CHOICE_OUTSIDE_ITS_LIST = {
    "python-2": ("python_version", "2.7"),
    "neptune": ("logger", "neptune"),
    "no-examples": ("examples", "none"),
    "gpl": ("license", "GPL"),
    "maybe-github-actions": ("github_actions", "maybe"),
    "maybe-dockerfile": ("dockerfile", "maybe"),
}


def run_cookiecutter(output_dir: Path, **answers: str) -> subprocess.CompletedProcess[str]:
    overrides = [f"{key}={value}" for key, value in answers.items()]
    command = [sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(output_dir)]
    return run([*command, str(TEMPLATE), *overrides], cwd=output_dir, timeout=120)


def assert_refused_in_one_line(tmp_path: Path, field: str, value: str) -> None:
    result = run_cookiecutter(tmp_path, **{field: value})
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()  # the hook's line only: no traceback after it
    assert line.startswith(f"ERROR: {field}=") and line.endswith(f"a valid {field}.")
    assert list(tmp_path.iterdir()) == [], "a rejected bake must leave nothing on disk"


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_answer_is_rejected(tmp_path: Path, case: str) -> None:
    assert_refused_in_one_line(tmp_path, *INVALID[case])


def test_an_answer_does_not_escape_the_output_dir(tmp_path: Path) -> None:
    output = tmp_path / "output"
    output.mkdir()
    result = run_cookiecutter(output, project_slug="../escaped")
    assert result.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output"]
    assert list(output.iterdir()) == []


def test_a_typed_answer_with_jinja_syntax_is_refused_by_the_hook(tmp_path: Path) -> None:
    """Typed at the prompt, an answer is not rendered by cookiecutter; the hook refuses it all the
    same, so that no project stores an answer a later `cruft update` would render."""
    command = [sys.executable, "-m", "cookiecutter", "-o", str(tmp_path), str(TEMPLATE)]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=clean_env(),
        input="A {{ 7*7 }}\n" + "\n" * 30,  # the defaults for the other questions
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ERROR: project_name='A {{ 7*7 }}' contains Jinja syntax")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", list(CHOICE_OUTSIDE_ITS_LIST))
def test_choice_outside_its_list_is_refused_by_cookiecutter(tmp_path: Path, case: str) -> None:
    field, value = CHOICE_OUTSIDE_ITS_LIST[case]
    result = run_cookiecutter(tmp_path, **{field: value})
    assert result.returncode == 1
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    choices = DEFAULTS[field]
    assert last.startswith(f"ValueError: {value} provided for choice variable {field}, but the")
    assert all(repr(choice) in last for choice in choices)
    assert list(tmp_path.iterdir()) == [], "a rejected bake must leave nothing on disk"


@pytest.mark.xfail(
    strict=True,
    reason="cookiecutter 2.7.1 refuses a choice answer before any code of the template runs, with "
    "a traceback; the template cannot make it one line",
)
@pytest.mark.parametrize("case", list(CHOICE_OUTSIDE_ITS_LIST))
def test_choice_outside_its_list_in_one_line(tmp_path: Path, case: str) -> None:
    assert_refused_in_one_line(tmp_path, *CHOICE_OUTSIDE_ITS_LIST[case])


def test_valid_defaults_from_the_command_line(tmp_path: Path) -> None:
    result = run_cookiecutter(tmp_path)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["lightning-hydra-project"]
    assert "lightning_hydra_project-train" in result.stdout


def test_the_shipped_dependency_modules_are_not_stale() -> None:
    """hooks/dependency_modules.txt holds every module the closure of the generated project's
    requirements installs, as this venv (every dependency, extra and dev tool installed) has them:
    after a dependency changes, `python -m tests.dependency_modules` rewrites the list. A name a
    newer release no longer installs may stay (refusing it costs nothing); a missing one bakes a
    broken project."""
    computed = dependency_modules.dependency_modules()
    assert {"starlette", "uvicorn", "tokenizers", "_pytest", "jsonschema"} <= set(computed)
    missing = sorted(set(computed) - set(dependency_modules.shipped_modules()))
    assert not missing, f"stale: add {missing}: run python -m tests.dependency_modules"


def test_every_shipped_dependency_module_is_refused_as_a_package_name() -> None:
    """The hook as cookiecutter renders it refuses each name of the shipped list that a package
    name could spell."""
    hook = rendered_pre_gen_hook(answers_with(project_name="x"))
    names = [n for n in dependency_modules.shipped_modules() if n.islower() or n.startswith("_")]
    assert len(names) > 100
    allowed = [name for name in names if hook["package_name_problem"](name) is None]
    assert allowed == []


def rendered_pre_gen_hook(answers: dict[str, str]) -> dict[str, Any]:
    """The names hooks/pre_gen_project.py defines, rendered with the template's Jinja extensions
    as cookiecutter renders it (not run as a script)."""
    from cookiecutter.environment import StrictEnvironment

    context = {"cookiecutter": {**answers, "_extensions": DEFAULTS["_extensions"]}}
    text = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    source = StrictEnvironment(context=context).from_string(text).render(**context)
    names: dict[str, Any] = {"__name__": "rendered_pre_gen_project"}
    exec(compile(source, "pre_gen_project.py", "exec"), names)
    return names


def test_a_lone_surrogate_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A lone surrogate cannot come from a command line; a user config or a replay file (JSON
    escapes) can hand one to cookiecutter in its own process."""
    from cookiecutter.main import cookiecutter

    output = tmp_path / "output"
    output.mkdir()
    config = tmp_path / "config.yaml"  # the replay file goes here, not to the home folder
    config.write_text(f"replay_dir: {tmp_path / 'replay'}\ncookiecutters_dir: {tmp_path}\n")
    with pytest.raises(SystemExit) as refused:
        cookiecutter(
            str(TEMPLATE),
            no_input=True,
            output_dir=str(output),
            extra_context={"author_name": "A \ud800 B"},
            config_file=str(config),
        )
    assert refused.value.code == 1
    assert list(output.iterdir()) == []


def test_a_typed_answer_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    """Typed in a Latin-1 terminal into a strict UTF-8 reader (PYTHONIOENCODING makes this one
    strict): the answer reaches the hook, not a UnicodeDecodeError in the prompt."""
    command = [sys.executable, "-m", "cookiecutter", "-o", str(tmp_path), str(TEMPLATE)]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=clean_env(PYTHONIOENCODING="utf-8:strict"),
        input=b"caf\xe9\n" + b"\n" * 30,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 1
    (line,) = result.stderr.decode().strip().splitlines()
    assert line == (
        "ERROR: project_name='caf\\udce9' holds the byte 0xE9, which is not UTF-8 text. Answer "
        "again with a valid project_name."
    )
    assert list(tmp_path.iterdir()) == []
