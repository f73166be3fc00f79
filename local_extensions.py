"""Jinja filters of this template; cookiecutter and cruft load this file as `local_extensions`."""

import json
import logging
from typing import Any

from cookiecutter import generate, hooks
from cookiecutter.exceptions import FailedHookException
from cookiecutter.utils import simple_filter


@simple_filter
def toml_string(value: object) -> str:
    """A TOML basic string. Jinja's `tojson` writes characters outside the BMP (an emoji) as JSON
    surrogate pairs, which TOML rejects; TOML takes them as they are."""
    return json.dumps(str(value), ensure_ascii=False)


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


refusals_in_one_line()
