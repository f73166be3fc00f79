"""`{{ cookiecutter.package_name }}-doctor`: what this machine has, what a run would pick, what looks wrong.

Prints one `name: value` line per field, then one `warning:` line per problem; `--json` prints the
same as one JSON object. The exit status is 1 when there is a warning, else 0. Arguments are config
overrides, as for the train command (e.g. `trainer=gpu trainer.devices=8`). Nothing here uses the
network, and a check that fails prints `unavailable (reason)` instead of stopping.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig

from ..data.base import auto_workers, check_loader_settings, usable_cores
from ..errors import ConfigError
from ..memory.plan import fit_warning, plan_memory
from ..run.machine import resolve_accelerator, resolve_precision
from ..run.plan import strategy_of
from ..run.settings import check_run_settings
from ..targets import allow

PACKAGE = "{{ cookiecutter.package_name }}"
GIB = 1024**3
MIN_FREE_GIB = 10
FP8_CAPABILITY = (8, 9)


def version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def unavailable(error: BaseException) -> str:
    return f"unavailable ({reason(error)})"


def driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, else from torch; None without a driver."""
    if shutil.which("nvidia-smi"):
        command = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            result = None
        if result and result.returncode == 0 and result.stdout.strip():
            return result.stdout.split()[0]
    query = getattr(torch.cuda, "driver_version", None)
    if callable(query):
        try:
            return str(query()) or None
        except Exception:
            return None
    return None


def cuda_devices() -> tuple[list[Any], str]:
    """The visible GPUs' properties, or none and why: torch warns, rather than raises, when CUDA
    cannot start (an old driver, a broken install), and that warning is the reason to show."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        why = str(caught[0].message).strip().splitlines() if caught else []
        return [], why[0] if why else "no GPU visible"
    try:
        return [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())], ""
    except Exception as error:
        return [], reason(error)


def nccl() -> tuple[bool, str]:
    if not (dist.is_available() and dist.is_nccl_available()):
        return False, "unavailable (this torch build has no NCCL)"
    try:
        return True, ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception as error:
        return True, unavailable(error)
{%- if cookiecutter.logger == "wandb" %}


def wandb_login() -> str:
    """Where the wandb key comes from, never the key itself."""
    from ..run.machine import wandb_login_present

    if os.environ.get("WANDB_API_KEY"):
        state = "logged in (key from WANDB_API_KEY)"
    elif wandb_login_present():
        state = f"logged in (key from {os.environ.get('NETRC', '~/.netrc')})"
    else:
        state = "not logged in: runs log offline"
    mode = os.environ.get("WANDB_MODE")
    return f"{state}; WANDB_MODE={mode}" if mode else state
{%- endif %}


def train_config(overrides: Sequence[str]) -> DictConfig:
    """The config the train command composes here, configs/local/default.yaml included."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(f"{PACKAGE}.configs", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def device_count(devices: Any, accelerator: str, gpus: int) -> int:
    """What `trainer.devices` means: a count, a list of indices, or -1 / auto for all of them."""
    if isinstance(devices, (list, ListConfig)):
        return len(devices)
    if str(devices) in ("-1", "auto"):
        return gpus if accelerator == "cuda" else 1
    return int(devices)


def strategy_name(strategy: Any, processes: int) -> str:
    if strategy == "auto":
        return "auto (one process)" if processes == 1 else "auto (DDP)"
    if isinstance(strategy, str):
        return strategy
    return str(strategy.get("_target_", strategy)).rsplit(".", 1)[-1]


def free_gib(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / GIB


def slurm_job() -> str:
    """The SLURM job this runs in, as SLURM describes it to its tasks, or why there is none."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return "not in a SLURM job" + (" (sbatch found)" if shutil.which("sbatch") else "")
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE") or "0"
    return (
        f"job {env['SLURM_JOB_ID']} on partition {env.get('SLURM_JOB_PARTITION', '?')}: "
        f"{env.get('SLURM_NNODES', '?')} nodes, {slurm_tasks_per_node() or '?'} tasks per node, "
        f"{gpus} GPUs per node"
    )


def slurm_tasks_per_node() -> int | None:
    """Tasks per node of this SLURM job (`2(x3)` and `4` forms), or None outside one."""
    value = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    try:
        return int(value.split("(")[0]) if value else None
    except ValueError:
        return None


def data_loader(data: Any, accelerator: str, devices: int) -> str:
    """The loader processes a run would use per training process, and why."""
    requested = data.get("num_workers", 0)
    pinned = "pinned memory" if accelerator == "cuda" else "no pinned memory (no CUDA)"
    if requested != "auto":
        return f"{requested} workers per process (data.num_workers={requested}), {pinned}"
    workers, why = auto_workers(accelerator, devices, usable_cores())
    return f"{workers} workers per process (data.num_workers=auto: {why}), {pinned}"


def diagnose(overrides: Sequence[str] = ()) -> tuple[dict[str, str], list[str]]:
    """The fields to print, in order, and the warnings."""
    fields: dict[str, str] = {}
    problems: list[str] = []
    check_software(fields, problems)
    gpus = check_gpus(fields, problems)
    try:
        cfg = train_config(overrides)
    except Exception as error:
        problems.append(f"the config does not compose: {reason(error)}")
        for name in ("disk_free", "accelerator", "precision", "strategy", "memory", "data_loader"):
            fields[name] = "unavailable (the config does not compose)"
        return fields, problems
    check_settings(cfg, problems)
    check_disk(cfg, fields, problems)
    check_run(cfg, gpus, fields, problems)
    for name in ("accelerator", "precision", "strategy", "memory", "data_loader"):
        fields.setdefault(name, "unavailable (see the warnings)")
    return fields, problems


def check_software(fields: dict[str, str], problems: list[str]) -> None:
    fields["python"] = f"{platform.python_version()} ({sys.executable})"
    fields["torch"] = torch.__version__
    fields["cuda_runtime"] = torch.version.cuda or (
        f"ROCm {torch.version.hip}" if torch.version.hip else "none (CPU-only build of torch)"
    )
    fields["driver"] = driver_version() or "none"
    fields["lightning"] = version("lightning")
    fields["hydra"] = version("hydra-core")
{%- if cookiecutter.logger == "csv" %}
    fields["logger"] = "csv (no package needed)"
{%- else %}
    logger = "{{ cookiecutter.logger }}"
{%- if cookiecutter.logger == "mlflow" %}
    installed = version("mlflow-skinny")
    if installed == "not installed":  # the whole of MLflow instead
        installed = version("mlflow")
{%- else %}
    installed = version(logger)
{%- endif %}
    fields["logger"] = f"{logger} {installed}"
    if installed == "not installed":
        problems.append(f"logger={logger} is the default but {logger} is not installed.")
{%- endif %}


@dataclass
class GPUs:
    devices: list[Any]
    native_bf16: bool
    capability: str  # the oldest one's, as words


def check_gpus(fields: dict[str, str], problems: list[str]) -> GPUs:
    driver = fields["driver"] if fields["driver"] != "none" else None
    gpus, no_gpu_reason = cuda_devices()
    fields["gpus"] = str(len(gpus)) if gpus else f"none ({no_gpu_reason})"
    for i, gpu in enumerate(gpus):
        fields[f"gpu_{i}"] = (
            f"{gpu.name}, {gpu.total_memory / GIB:.1f} GiB, "
            f"compute capability {gpu.major}.{gpu.minor}"
        )
    oldest = min(((gpu.major, gpu.minor) for gpu in gpus), default=None)
    native_bf16 = oldest is not None and (oldest >= (8, 0) or bool(torch.version.hip))
    capability = f"compute capability {oldest[0]}.{oldest[1]}" if oldest else "no GPU"
    if oldest is None:
        fields["bf16"] = fields["fp8"] = "n/a (no GPU)"
    else:
        fields["bf16"] = "yes" if native_bf16 else f"no ({capability}; emulated, slow)"
        fields["fp8"] = "yes" if oldest >= FP8_CAPABILITY else f"no ({capability}; needs 8.9)"
    has_nccl, fields["nccl"] = nccl()
    fields["slurm"] = slurm_job()
{%- if cookiecutter.logger == "wandb" %}
    try:
        fields["wandb_login"] = wandb_login()
    except Exception as error:
        fields["wandb_login"] = unavailable(error)
{%- endif %}

    if torch.version.cuda and not gpus:
        problems.append(
            f"torch is built for CUDA {torch.version.cuda} but cannot use a GPU ({no_gpu_reason}): "
            "check nvidia-smi and CUDA_VISIBLE_DEVICES."
        )
    if driver and not (torch.version.cuda or torch.version.hip):
        problems.append(
            f"NVIDIA driver {driver} is installed but torch {torch.__version__} is a CPU-only "
            "build: `pip uninstall torch`, then `make install` installs a CUDA build."
        )
    if len(gpus) > 1 and not has_nccl:
        problems.append(f"{len(gpus)} GPUs but no NCCL in this torch: multi-GPU runs will fail.")
    return GPUs(gpus, native_bf16, capability)


def check_settings(cfg: DictConfig, problems: list[str]) -> None:
    try:
        check_run_settings(cfg)
        data = cfg.get("data")
        if data is not None and "batch_size" in data and "num_workers" in data:
            check_loader_settings(data.batch_size, data.num_workers)
    except ConfigError as error:
        problems.append(f"a run would refuse this config: {error}")


def check_disk(cfg: DictConfig, fields: dict[str, str], problems: list[str]) -> None:
    try:
        log_dir = Path(str(cfg.paths.log_dir)).resolve()
        free = free_gib(log_dir)
        fields["disk_free"] = f"{free:.1f} GiB in {log_dir}"
        if free < MIN_FREE_GIB:
            problems.append(f"only {free:.1f} GiB free in {log_dir}: checkpoints need room.")
    except Exception as error:
        fields["disk_free"] = unavailable(error)


def check_run(cfg: DictConfig, gpus: GPUs, fields: dict[str, str], problems: list[str]) -> None:
    """What a run of this config would pick here, and whether it fits."""
    trainer = cfg.trainer
    try:
        accelerator = resolve_accelerator(str(trainer.accelerator))
        fields["accelerator"] = f"{accelerator} (trainer.accelerator={trainer.accelerator})"
        precision = resolve_precision(str(trainer.precision), accelerator)
        fields["precision"] = f"{precision} (trainer.precision={trainer.precision})"
        devices = device_count(trainer.devices, accelerator, len(gpus.devices))
        nodes = f" x {trainer.num_nodes} nodes" if trainer.num_nodes > 1 else ""
        fields["strategy"] = (
            f"{strategy_name(trainer.strategy, devices * trainer.num_nodes)}, "
            f"{devices} {accelerator} device{'s' if devices > 1 else ''}{nodes}"
        )
    except ConfigError as error:
        problems.append(str(error))
    except Exception as error:
        problems.append(f"cannot tell what a run would pick: {reason(error)}")
    else:
        if accelerator == "cuda" and precision.startswith("bf16") and not gpus.native_bf16:
            problems.append(
                f"precision {precision} on a GPU without native bf16 ({gpus.capability}): it is "
                "emulated and slow; use trainer.precision=16-mixed."
            )
        if accelerator == "cuda" and devices > len(gpus.devices):
            problems.append(
                f"trainer.devices asks for {devices} GPUs but {len(gpus.devices)} are visible."
            )
        try:
            plan = plan_memory(
                cfg.model, int(cfg.data.batch_size), precision,
                devices * int(cfg.trainer.num_nodes),
                strategy_of(cfg.trainer.get("strategy")).shards,
            )  # fmt: skip
            fields["memory"] = plan.summary()
            warning = fit_warning(plan, accelerator)
            if warning:
                problems.append(warning)
        except Exception as error:
            fields["memory"] = unavailable(error)
        fields["data_loader"] = data_loader(cfg.get("data") or {}, accelerator, devices)
        tasks = slurm_tasks_per_node()
        if tasks is not None and tasks != devices:
            problems.append(
                f"this SLURM job has {tasks} tasks per node but trainer.devices={devices}: "
                "Lightning needs one task per device (sbatch --ntasks-per-node="
                f"{devices}, or trainer.devices={tasks})."
            )


def render(fields: dict[str, str], problems: list[str]) -> str:
    labels = {name: name.replace("_", " ") + ":" for name in fields}
    width = max(len(label) for label in labels.values())
    lines = [f"{labels[name].ljust(width)} {value}" for name, value in fields.items()]
    lines += [f"warning: {problem}" for problem in problems]
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments as the other commands report bad input: one `error:` line, exit status 1."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"error: {message} (see {self.prog} --help).\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=f"{PACKAGE}-doctor",
        description="Check this machine for training: versions, GPUs, bf16 and FP8, NCCL, disk, "
        "and the accelerator, precision and strategy a run would pick. Exit status 1 when "
        "there is a warning.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("overrides", nargs="*", help=f"config overrides, as for {PACKAGE}-train")
    args = parser.parse_args(argv)
    try:  # bad input, as for every command: one line, exit status 1, nothing built
        allow(train_config(args.overrides))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        print(f"error: the config does not compose: {reason(error)}", file=sys.stderr)
        return 1
    fields, problems = diagnose(args.overrides)
    if args.json:
        print(json.dumps({**fields, "warnings": problems}, indent=2))
    else:
        print(render(fields, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
