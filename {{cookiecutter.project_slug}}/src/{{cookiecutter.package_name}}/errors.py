"""Errors that the command line reports in one line (exit code 1) instead of a traceback."""

from __future__ import annotations

import importlib

from .data.errors import ConfigError

PACKAGE = __name__.rpartition(".")[0]  # the import name, for messages that name commands


class TrainingError(Exception):
    """Training cannot go on (e.g. non-finite losses): the message says why and what to try."""


def raised_by_a_spawned_process(error: BaseException) -> Exception | None:
    """The project's error that a process started by `strategy=ddp_spawn` raised. torch hands the
    parent only the child's traceback, as text whose last line is `<module>.<class>: <message>`;
    only classes of this package are looked up."""
    if type(error).__name__ != "ProcessRaisedException":
        return None
    lines = str(error).strip().splitlines()
    name, _, message = (lines[-1] if lines else "").partition(": ")
    module, _, class_name = name.rpartition(".")
    if not module.startswith(f"{PACKAGE}."):
        return None
    try:
        found = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError):
        return None
    if isinstance(found, type) and issubclass(found, (ConfigError, TrainingError)):
        return found(message)
    return None
