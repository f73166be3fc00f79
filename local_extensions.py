"""Jinja filters of this template; cookiecutter and cruft load this file as `local_extensions`."""

import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import yaml
from cookiecutter import generate, hooks, prompt
from cookiecutter.exceptions import FailedHookException
from cookiecutter.utils import simple_filter
from jinja2 import Environment
from jinja2.ext import Extension


@simple_filter
def toml_string(value: object) -> str:
    """A TOML basic string. Jinja's `tojson` writes characters outside the BMP (an emoji) as JSON
    surrogate pairs, which TOML rejects; TOML takes them as they are."""
    return json.dumps(str(value), ensure_ascii=False)


@simple_filter
def yaml_string(value: object) -> str:
    """A double-quoted YAML scalar that every YAML reader (PyYAML, OmegaConf, YAML 1.2) reads back
    as the same string: a plain `yes`, `null`, `1.10`, `0x1F` or `#x` would become true, None,
    1.1, 31 or a comment."""
    dumped = yaml.safe_dump(str(value), default_style='"', allow_unicode=True, width=math.inf)
    return dumped.rstrip("\n")


def dependency_modules() -> list[str]:
    """The import names of the generated project's dependency closure, as
    `python -m tests.dependency_modules` wrote them beside the hook that refuses them."""
    text = (Path(__file__).resolve().parent / "hooks" / "dependency_modules.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


class DependencyModules(Extension):
    """`dependency_modules()` in the template's Jinja: hooks/pre_gen_project.py runs in its own
    process, from a rendered copy, and cannot find the template's files by itself."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.globals["dependency_modules"] = dependency_modules


def refusals_in_one_line() -> None:
    """On an answer that hooks/pre_gen_project.py refuses, cookiecutter logs a traceback and
    prints "Hook script failed" after the hook's own `ERROR:` line, which says all there is to
    say. Loaded with this file, in the cookiecutter process: the refusal exits with code 1, the
    project directory removed as before, and the hook's line alone on the console."""
    original = generate.run_hook_from_repo_dir
    if getattr(original, "one_line", False):
        return

    def run_hook_from_repo_dir(*args: Any, **kwargs: Any) -> None:
        hook_name = kwargs.get("hook_name", args[1] if len(args) > 1 else None)
        if hook_name != "pre_gen_project":
            return original(*args, **kwargs)
        hooks_log = logging.getLogger(hooks.__name__)
        was_disabled, hooks_log.disabled = hooks_log.disabled, True
        try:
            return original(*args, **kwargs)
        except FailedHookException:
            raise SystemExit(1) from None
        finally:
            hooks_log.disabled = was_disabled

    run_hook_from_repo_dir.one_line = True  # type: ignore[attr-defined]
    generate.run_hook_from_repo_dir = run_hook_from_repo_dir


def refuse(field: str, value: object, rule: str) -> NoReturn:
    """The line hooks/pre_gen_project.py prints for a bad answer, then exit 1."""
    print(f"ERROR: {field}={value!r} {rule}. Answer again with a valid {field}.", file=sys.stderr)
    raise SystemExit(1)


def template_strings() -> set[str]:
    """Every string of the template's cookiecutter.json: the template's own derived defaults
    (`{{ cookiecutter.project_name | slugify ... }}`) are templates, the user's answers are not.
    Read each time from every template folder on sys.path (cookiecutter and cruft put the
    template's there), since one process may render several templates (cruft update renders two
    commits) while it imports this module once."""
    strings: set[str] = set()

    def collect(value: object) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from collect(key)
                yield from collect(item)
        elif isinstance(value, list):
            for item in value:
                yield from collect(item)

    for folder in {Path(__file__).resolve().parent, *map(Path, sys.path)}:
        try:
            strings.update(collect(json.loads((folder / "cookiecutter.json").read_text("utf-8"))))
        except (OSError, ValueError):
            continue
    return strings


def field_being_rendered() -> str:
    """The answer's name: the `key` of cookiecutter's prompt_for_config or
    prompt_choice_for_config, a few frames up."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            break
        key = frame.f_locals.get("key")
        if isinstance(key, str):
            return key
        frame = frame.f_back
    return "answer"


def answers_are_never_templates() -> None:
    """Cookiecutter renders each answer given with --no-input, --extra-context, cruft's
    --extra-context or the user config as a Jinja template before any hook sees it:
    `{{ 7*7 }}` in a name became 49, `{#` a traceback. Here such an answer is refused with the
    hook's one line before it is rendered; nothing has been written yet. The template's own
    derived defaults are rendered as before."""
    original = prompt.render_variable
    if getattr(original, "one_line", False):
        return

    def render_variable(env: Any, raw: Any, cookiecutter_dict: dict[str, Any]) -> Any:
        if isinstance(raw, str):
            syntax = (env.variable_start_string, env.block_start_string, env.comment_start_string)
            if any(start in raw for start in syntax) and raw not in template_strings():
                refuse(
                    field_being_rendered(),
                    raw,
                    f"contains Jinja syntax ({', '.join(syntax)}), which cannot appear in an "
                    "answer (cookiecutter would run it as a template)",
                )
        return original(env, raw, cookiecutter_dict)

    render_variable.one_line = True  # type: ignore[attr-defined]
    prompt.render_variable = render_variable


def project_folder_is_one_name() -> None:
    """Cookiecutter makes the project's folder before the pre_gen_project hook runs: a
    project_slug of `a/b` left `a/` behind, `../x` made a folder outside the output directory and
    one over 255 bytes ended in a traceback. The folder's name is checked before it is made."""
    original = generate.render_and_create_dir
    if getattr(original, "one_line", False):
        return

    def render_and_create_dir(
        dirname: str,
        context: dict[str, Any],
        output_dir: Any,
        environment: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not Path(dirname).is_absolute():  # the project's folder; the ones inside are absolute
            name = environment.from_string(dirname).render(**context)
            separators = {"/", "\\", "\0"}
            if (
                name in ("", ".", "..")
                or any(separator in name for separator in separators)
                or len(name.encode("utf-8", "surrogatepass")) > 255
            ):
                named = re.fullmatch(r"\{\{\s*cookiecutter\.(\w+)\s*\}\}", dirname)
                field = named.group(1) if named else "project_slug"
                refuse(
                    field,
                    context.get("cookiecutter", {}).get(field, name),
                    "must be one folder name: no '/' or '\\', not '.' or '..', at most 255 bytes",
                )
        return original(dirname, context, output_dir, environment, *args, **kwargs)

    render_and_create_dir.one_line = True  # type: ignore[attr-defined]
    generate.render_and_create_dir = render_and_create_dir


def typed_answers_reach_the_hook() -> None:
    """A typed answer that is not UTF-8 (`caf\\xe9` from a Latin-1 terminal) is read as text with
    its bad bytes kept as lone surrogates, which hooks/pre_gen_project.py then refuses in one line,
    instead of a UnicodeDecodeError traceback in the prompt."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (OSError, ValueError):
            pass


refusals_in_one_line()
answers_are_never_templates()
project_folder_is_one_name()
typed_answers_reach_the_hook()
