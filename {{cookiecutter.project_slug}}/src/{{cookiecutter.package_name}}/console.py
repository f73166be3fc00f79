"""What every console script sets up when it is imported, before Hydra composes a config: Hydra's
errors in one line, the `_target_` checks of Hydra's own callbacks and logging configs, the
run-name resolver, a ConfigStore that is not copied on every config-group listing; and the
removal of a run directory that a failed command made. No torch here."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
from typing import Any, NoReturn

from hydra.core.config_store import ConfigStore

from . import command_errors
from .run import record as run_record
from .run.names import register_run_name_resolver
from .targets import check_hydra_callbacks, check_logging_configs


def share_config_store_when_copied() -> None:
    """Hydra deep-copies its config repository, and with it the ConfigStore singleton, each time it
    lists a config group: `--help` copied every registered launcher and sweeper config 108 times,
    most of its run time. The copy only guards the repository's list of sources, so the store can
    stay the one live instance (as Hydra's own fix for lazily registered configs wants)."""
    ConfigStore.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]


share_config_store_when_copied()


def report_flag_errors_in_one_line() -> None:
    """Hydra's own flags (`--cfg`, `--info`, ...) are read by argparse, which answers a bad one
    with its usage and exit code 2: here it is one `error:` line and exit code 1."""
    hydra_main = importlib.import_module("hydra.main")  # the module, not `hydra.main` the function
    if getattr(hydra_main.get_args_parser, "one_line", False):
        return
    build = hydra_main.get_args_parser

    def parser() -> argparse.ArgumentParser:
        made = build()

        def error(message: str) -> NoReturn:
            print(f"error: {message}; --help lists the flags.", file=sys.stderr)
            sys.exit(1)

        made.error = error
        return made

    parser.one_line = True  # type: ignore[attr-defined]
    setattr(hydra_main, "get_args_parser", parser)  # noqa: B010 (a module found at run time)


report_flag_errors_in_one_line()


def report_missing_package_as_an_error() -> None:
    """`--cfg job -p KEY` with a KEY the config lacks: Hydra writes its own line and exits with 1;
    here that line is an `error:` line like every other."""
    from hydra._internal.hydra import Hydra

    show = Hydra.show_cfg
    if getattr(show, "one_line", False):
        return

    def show_cfg(self: Hydra, *args: Any, **kwargs: Any) -> None:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                show(self, *args, **kwargs)
        finally:
            text = said.getvalue()
            if text.startswith("package '") and text.rstrip().endswith("not found in config"):
                text = f"error: {text.rstrip()}; --cfg job shows the keys it has.\n"
            sys.stderr.write(text)

    show_cfg.one_line = True  # type: ignore[attr-defined]
    Hydra.show_cfg = show_cfg  # type: ignore[method-assign]


report_missing_package_as_an_error()


HYDRA_START_FILES = (
    ".hydra",
    "train.log",
    "eval.log",
    "predict.log",
    "export.log",
    "serve.log",
    "bench.log",
    "prepare.log",
    "debug.log",
    "run_overrides.json",
    "wandb_run_id.txt",
    "tracking.json",
    ".lock",
)


def remove_unused_run_dir(run_dir: str | None = None) -> None:
    """A run directory holding only what a command writes before it starts training (Hydra's
    `.hydra/` and log, the recorded overrides) was made by the command that failed: it goes, with
    the folders above it that it leaves empty, so bad input leaves nothing behind. (`run_dir`:
    the job's, once Hydra has forgotten it.)"""
    import logging
    import shutil
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from .run import lock as run_lock

    try:
        folder = Path(run_dir or HydraConfig.get().runtime.output_dir)
    except Exception:  # no Hydra run (a test composing configs), or no output directory
        return
    here = Path.cwd().resolve()
    made_by_hydra = (folder / ".hydra").is_dir() or run_dir is not None  # (or about to be)
    if not (made_by_hydra and folder.is_dir()) or folder.resolve() in (here, *here.parents):
        return  # never the folder the command runs in (hydra.run.dir=.), nor one above it
    if any(
        path.name not in HYDRA_START_FILES and not (path.is_dir() and not any(path.iterdir()))
        for path in folder.iterdir()
    ):
        return  # an empty folder (what a logger left once its files were removed) is no output
    if run_lock.holder(folder) is not None:
        return  # another process's live run
    for handler in list(logging.getLogger().handlers):
        if isinstance(handler, logging.FileHandler):  # removed too: an emit would reopen the file
            logging.getLogger().removeHandler(handler)
            handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    for parent in folder.parents:
        if parent == Path.cwd() or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


register_run_name_resolver()
run_record.keep_what_hydra_replaces()
command_errors.install(clean_up=remove_unused_run_dir)
check_hydra_callbacks()
check_logging_configs()
