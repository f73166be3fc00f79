"""Run directories named by the command, not the clock, so the same command finds its run again.
Imported by the CLI before Hydra starts: no torch here."""

from __future__ import annotations

import hashlib
import os
import re

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
MAX_LENGTH = 100
SWEEP_NAME_VARIABLE = "{{ cookiecutter.package_name | upper }}_SWEEP_NAME"


DIGESTED = re.compile(r"-[0-9a-f]{10}$")


def safe_name(name: str) -> str:
    """`name` as one folder name: characters other than ASCII letters, numerals and `._=,+-` become
    `_`, a leading `.` too (no `..` out of runs/); where that changed it, it is long, or it ends
    as such a name does (`-` and ten hexadecimal characters), a digest of the original is added,
    so distinct names stay distinct folders."""
    safe = UNSAFE.sub("_", name)
    safe = "_" + safe[1:] if safe.startswith(".") else safe
    if safe == name and len(name) <= MAX_LENGTH and not DIGESTED.search(name):
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{safe[: MAX_LENGTH - 11]}-{digest}"


def run_name(explicit: str | None, override_dirname: str) -> str:
    """`run_name` when given; else the overrides (`key=value,...`, sorted by Hydra); `default`
    for no overrides. Made safe as a folder name by `safe_name`."""
    if explicit:
        return safe_name(str(explicit))
    return safe_name(override_dirname) if override_dirname else "default"


def identifying(overrides: list[str] | tuple[str, ...], excluded: list[str]) -> list[str]:
    """The overrides that change what is trained, sorted: those whose key is not in `excluded`
    (Hydra's `override_dirname.exclude_keys`)."""
    return sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in set(excluded))


def pasteable(argument: str) -> str:
    """A path the project printed, pasted back as a value (`ckpt_path=runs/lr=0.1,seed=2/...`), or
    a non-ASCII value, quoted so that Hydra's override grammar takes it as it is. A value already
    quoted or holding grammar of its own is left as typed."""
    key, equals, value = argument.partition("=")
    if argument.startswith("-") or not equals or not value or value[0] in "'\"[{$":
        return argument
    if any(c in value for c in "'\"\\"):
        return argument
    if "=" in value:
        return f"{key}='{value}'"
    if not value.isascii():
        return f"{key}=" + ",".join(f"'{part}'" for part in value.split(","))
    return argument


def verbatim(argument: str, keys: tuple[str, ...]) -> str:
    """`key=<any text>` for the given keys (a prompt), quoted so that Hydra reads the text as it
    is: no grammar, no interpolation."""
    key, equals, value = argument.partition("=")
    if not equals or key not in keys:
        return argument
    # Hydra keeps a backslash as it is, except in a run before a quote (or the closing quote).
    value = re.sub(r"(\\+)(?='|$)", lambda run: run.group(1) * 2, value)
    return f"{key}='" + value.replace("'", "\\'").replace("${", "\\${") + "'"


def resolve_run_name(*, _root_: DictConfig) -> str:
    """`${run_name:}` in hydra.run.dir: this command's run name."""
    return run_name(_root_.get("run_name"), HydraConfig.get().job.override_dirname)


def resolve_sweep_name(*, _root_: DictConfig) -> str:
    """`${sweep_name:}` in hydra.sweep.dir: `run_name`, else the multirun's overrides as typed
    (sorted), so the same sweep command finds its jobs' run directories again. Hydra resolves the
    sweep directory again inside each job, with that job's overrides, so the sweep's name is kept
    in the environment, which launchers pass on to their jobs."""
    cached = os.environ.get(SWEEP_NAME_VARIABLE)
    if cached:
        return cached
    excluded = list(_root_.hydra.job.config.override_dirname.exclude_keys)
    overrides = ",".join(identifying([str(o) for o in _root_.hydra.overrides.task], excluded))
    name = run_name(_root_.get("run_name"), overrides)
    os.environ[SWEEP_NAME_VARIABLE] = name
    return name


def gpus_per_node(*, _root_: DictConfig) -> int | None:
    """`${gpus_per_node:}` in the SLURM launcher: trainer.devices, and no GPU request for a CPU
    run (trainer.accelerator=cpu), so CPU partitions need no override."""
    trainer = _root_.trainer
    if str(trainer.accelerator) == "cpu":
        return None
    devices = trainer.devices
    if isinstance(devices, ListConfig):
        return len(devices)
    try:
        return int(devices)
    except ValueError:
        raise ValueError(
            f"trainer.devices={devices}: a SLURM job asks for a number of GPUs per node, give it "
            "as trainer.devices=<GPUs per node>"
        ) from None


def register_run_name_resolver() -> None:
    OmegaConf.register_new_resolver("run_name", resolve_run_name, replace=True)
    OmegaConf.register_new_resolver("sweep_name", resolve_sweep_name, replace=True)
    OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node, replace=True)
