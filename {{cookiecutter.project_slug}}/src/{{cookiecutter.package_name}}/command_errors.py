"""Errors met before a run starts (an override Hydra cannot parse, a key that does not exist, a
config file that is not YAML, a folder that cannot be written) as one `error:` line, exit code 1.
HYDRA_FULL_ERROR=1 still shows Hydra's own report with its stack trace. No torch here."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import yaml
from hydra._internal import utils as hydra_utils
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .errors import ConfigError

NOT_WRITABLE = {
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST,
}  # fmt: skip
# Errors that say what is wrong with a folder's path where one is being made.
NOT_MAKEABLE = {errno.ELOOP, errno.ENAMETOOLONG}
HYDRA_FOOTERS = ("Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc")
APPEND_HINT = "To append to your config"
GRAMMAR_PAGE = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def lines_of(text: str) -> list[str]:
    """The lines of a message, each ending as a sentence, without Hydra's footers."""
    return [
        line if line.endswith((".", ":", "!", "?")) else f"{line}."
        for line in (raw.strip() for raw in text.splitlines())
        if line and not line.startswith(HYDRA_FOOTERS)
    ]


def without_worker_trace(message: str) -> str:
    """A DataLoader worker's error arrives as "Caught ... in DataLoader worker process N." and the
    worker's traceback; its own message is the last line."""
    if "Original Traceback" not in message:
        return message
    last = message.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


ELSEWHERE = "write elsewhere with paths.log_dir=<folder>"
# What to do about a file or folder that cannot be written, by the error's number.
WRITE_ADVICE = {
    errno.ENOSPC: f"free space there, or {ELSEWHERE}",
    errno.EDQUOT: f"free space within your quota, or {ELSEWHERE}",
    errno.ENOTDIR: f"a file stands where a folder must: move it, or {ELSEWHERE}",
    errno.EEXIST: f"a file stands where a folder must: move it, or {ELSEWHERE}",
    errno.ELOOP: f"a symbolic link on the way leads back to itself: remove the loop, or {ELSEWHERE}",
    errno.ENAMETOOLONG: "a name in it is longer than the file system allows: give a shorter "
    "run_name=... or paths.log_dir=<folder>",
    errno.EFBIG: (
        "the file system (FAT32: 4 GiB) or the process's file-size limit (ulimit -f) takes no "
        f"file this large: raise the limit, or {ELSEWHERE}"
    ),
    errno.EIO: f"the disk failed: check it (dmesg), or {ELSEWHERE}",
    errno.EMFILE: "this process has too many files open: raise the limit (ulimit -n) and run the "
    "same command again",
    errno.ENFILE: "the system has too many files open: close some and run the same command again",
    errno.EROFS: f"the file system is read-only: {ELSEWHERE}",
}


def not_writable(error: OSError) -> str:
    where = f" {error.filename}" if error.filename else ""
    reason = error.strerror or os.strerror(error.errno or 0)
    todo = WRITE_ADVICE.get(error.errno or 0, f"make it writable, or {ELSEWHERE}")
    return f"cannot write{where} ({reason}): {todo}."


def raised_making_a_folder(error: BaseException) -> bool:
    """Whether `error` came from making a folder (its innermost Python frame is a mkdir)."""
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return trace is not None and trace.tb_frame.f_code.co_name in ("mkdir", "makedirs")


def file_being_read(error: BaseException) -> str | None:
    """The config file Hydra was reading when `error` was raised (its file source's `full_path`)."""
    trace = error.__traceback__
    while trace is not None:
        path = trace.tb_frame.f_locals.get("full_path")
        if isinstance(path, str):
            return path
        trace = trace.tb_next
    return None


EXPECTED = (
    ("bool", "true or false"), ("int", "a whole number"), ("float", "a number"),
    ("list", "a list, e.g. [a,b]"), ("str", "text"),
)  # fmt: skip


def schema_error(error: BaseException) -> str | None:
    """A value of the wrong type, or a key that is no setting, in the project's own settings
    (configs/schema.py), as Hydra found it while composing (a config file's, as the context)."""
    cause = error.__cause__ or error.__context__
    schema = getattr(cause, "object_type", None)
    if not isinstance(cause, (ValidationError, ConfigKeyError)) or not cause.full_key:
        return None
    if not (dataclasses.is_dataclass(schema) and schema.__module__.endswith("configs.schema")):
        return None
    if isinstance(cause, ConfigKeyError):
        found = re.match(r"In '([^']+)'", str(error))
        where = f", set in {found.group(1)}.yaml," if found else ""
        return (
            f"{cause.full_key}{where} is not a setting of this command: check the spelling "
            "(--cfg job prints every key; configs/schema.py lists the settings)."
        )
    types = {item.name: str(item.type) for item in dataclasses.fields(schema)}
    typed = types.get(str(cause.key), "")
    expected = next((words for name, words in EXPECTED if typed.startswith(name)), None)
    if expected is None:
        return None
    nothing = ", or null" if "None" in typed else ""
    return f"{cause.full_key}={cause.value!r}: use {expected}{nothing}."


def one_line(error: BaseException) -> str | None:
    """The one line that reports `error`, or None for an error that is a bug (kept as a trace)."""
    if isinstance(error, ConfigError):
        return str(error)
    cause = error.__cause__
    if isinstance(cause, OSError) and cause.filename:
        return not_writable(cause)  # logging's "Unable to configure handler 'file'"
    if isinstance(error, UnicodeDecodeError):
        where = file_being_read(error) or "a config file"
        return (
            f"{where} is not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8."
        )
    if isinstance(error, ValueError) and str(error).startswith("Config group override must be"):
        return f"an override has no key ({error}): write key=value, e.g. seed=1."
    if isinstance(error, RuntimeError) and str(error).startswith("Invalid plugin"):
        return (
            f"{error}: choose a launcher by its config (hydra/launcher=local_gpus or slurm) and "
            "a sweeper by hparams_search=..., not by a _target_."
        )
    if isinstance(error, OverrideParseException):
        problem = lines_of(error.message)[0].rstrip(".") if error.message.strip() else "?"
        return (
            f"cannot parse the override {error.override!r} ({problem}). Quote a value holding "
            f"special characters, e.g. key='a=b c' (see {GRAMMAR_PAGE})."
        )
    if isinstance(error, MissingConfigException) and error.options:
        what = lines_of(str(error))[0]
        return f"{what} Choose one of: {', '.join(sorted(error.options))}."
    if isinstance(error, HydraException) and schema_error(error):
        return schema_error(error)
    if isinstance(error, HydraException):
        parts = lines_of(str(error))
        cause = error.__cause__
        if isinstance(cause, OmegaConfBaseException):
            parts += [line for line in lines_of(str(cause)) if ":" not in line and "=" not in line]
        appends = [part for part in parts if part.startswith(APPEND_HINT)]
        if appends:
            new_key = appends[0].removeprefix(APPEND_HINT).strip().rstrip(".")
            parts = [part for part in parts if part not in appends]
            parts.append(
                f"Check the spelling (--cfg job prints every key); to add a key, {new_key}."
            )
        return " ".join(parts)
    if isinstance(error, OmegaConfBaseException):
        what = lines_of(str(error))[0]
        return what + " Check the interpolations (${name}) in the command and the configs."
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
        return f"{where} is not valid YAML ({error.problem or error.context}): fix or remove it."
    if isinstance(error, OSError) and error.errno in NOT_WRITABLE:
        return not_writable(error)
    if isinstance(error, OSError) and error.errno in NOT_MAKEABLE and raised_making_a_folder(error):
        return not_writable(error)
    if isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:
        return (
            f"{error.filename}: a name in this path is longer than the file system allows "
            f"({error.strerror}): give a shorter one."
        )
    if isinstance(error, OSError) and error.errno == errno.ENOENT and raised_making_a_folder(error):
        return (
            f"cannot make the folder {error.filename} ({error.strerror}): no folder can be made "
            "there; write elsewhere with paths.log_dir=<folder>."
        )
    return None


def first_rank() -> bool:
    """Whether this process is the first of a distributed run (or the only process)."""
    distributed = sys.modules.get("torch.distributed")  # imported by the run, if it is one
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return bool(distributed.get_rank() == 0)
    return (os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0") == "0"


def report_in_one_line(
    original: Callable[[Any], Any], clean_up: Callable[[], None]
) -> Callable[[Any], Any]:
    def run_and_report(func: Any) -> Any:
        def reported_in_one_line() -> Any:
            try:
                return func()
            except Exception as error:
                line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else one_line(error)
                if line is None:
                    raise  # Hydra's own report
                clean_up()
                print(f"error: {line}", file=sys.stderr)
                sys.exit(1)

        return original(reported_in_one_line)

    return run_and_report


def install(clean_up: Callable[[], None]) -> None:
    """Hydra reports errors from parsing, composing and starting a job through one function;
    `clean_up` removes what the failed start wrote (a run directory Hydra made)."""
    if not getattr(hydra_utils.run_and_report, "one_line", False):
        replacement = report_in_one_line(hydra_utils.run_and_report, clean_up)
        replacement.one_line = True  # type: ignore[attr-defined]
        hydra_utils.run_and_report = replacement  # type: ignore[assignment]
