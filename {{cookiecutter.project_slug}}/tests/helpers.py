"""Helpers shared by the tests: composing configs as the command line would, reading results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from . import warm_start

PACKAGE = "{{ cookiecutter.package_name }}"
CONFIG_MODULE = f"{PACKAGE}.configs"
PROJECT_ROOT = Path(__file__).parents[1]
CONFIG_DIR = PROJECT_ROOT / "src" / PACKAGE / "configs"

ComposeFn = Callable[..., DictConfig]


def compose_config(config_name: str, overrides: list[str], run_dir: Path) -> DictConfig:
    """The config a command line would compose, with its run directory under `run_dir`."""
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.root_dir = str(run_dir)
        cfg.paths.output_dir = str(run_dir / "run")
        del cfg.hydra
    return cfg


def read_metrics(cfg: DictConfig) -> dict[str, float]:
    return json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())


def checkpoints(cfg: DictConfig) -> list[Path]:
    return sorted((Path(cfg.paths.output_dir) / "checkpoints").glob("*.ckpt"))


def assert_checkpoints_load_safely(cfg: DictConfig) -> None:
    """Every checkpoint the run wrote loads with weights_only=True and carries its run config."""
    written = checkpoints(cfg)
    assert written, "the run wrote no checkpoint"
    for path in written:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        assert set(checkpoint["run_config"]) == {"data", "model"}


# Commands run one after another in one interpreter, each as its console script would run: its
# own sys.argv and Hydra, its exit code and what it wrote to stderr (the file descriptor: logging
# and warnings too). A command's start (torch, Lightning) is paid once.
COMMANDS_IN_ONE_PROCESS = """
import json, os, sys, tempfile
from hydra.core.global_hydra import GlobalHydra
from {package} import cli
commands, output, results = json.loads(sys.argv[1]), sys.argv[2], []
for entry, *args in commands:
    GlobalHydra.instance().clear()
    sys.argv = [entry, *args]
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        stderr = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            getattr(cli, entry)()
            code = 0
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
        finally:
            sys.stderr.flush()
            os.dup2(stderr, 2)
            os.close(stderr)
        captured.seek(0)
        results.append([code, captured.read().decode(errors="replace")])
with open(output, "w") as written:
    json.dump(results, written)
"""


def run_commands(
    commands: list[tuple[str, ...]], cwd: Path, results: Path
) -> list[subprocess.CompletedProcess[str]]:
    """Each `(entry, *args)` (an entry is a function of `cli`: train, evaluate, predict, export,
    ...) as its console script would run it, all in one process; `results` is a file to write."""
    script = COMMANDS_IN_ONE_PROCESS.format(package=PACKAGE)
    ran = run_cli("-c", script, json.dumps(commands), str(results), cwd=cwd)
    assert ran.returncode == 0 and results.is_file(), ran.stderr[-3000:]
    return [
        subprocess.CompletedProcess(list(command), code, "", stderr)
        for command, (code, stderr) in zip(commands, json.loads(results.read_text()), strict=True)
    ]


def run_cli(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    input: str | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`python <args>`; its standard input is `input`, or nothing. Without input it is forked
    from a process that has imported torch and Hydra (tests/warm_start.py) unless `fresh`: a
    test of what a command imports, or of its start, asks for a new interpreter."""
    environment = {**os.environ, **(env or {})}
    forked = None
    if not (fresh or input):
        forked = warm_start.start(list(args), cwd, environment, env, merged=False, session=False)
    if forked is None:
        return subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
            input="" if input is None else input,
        )
    try:
        stdout, stderr = forked.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(forked.pid, signal.SIGKILL)
        forked.communicate()
        raise
    return subprocess.CompletedProcess(forked.args, forked.wait(), stdout, stderr or "")
