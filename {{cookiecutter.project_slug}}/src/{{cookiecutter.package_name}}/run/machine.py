"""Settings that depend on the machine: accelerator, precision and matmul precision, and
whether wandb has a login (without importing Lightning or wandb, so the doctor answers quickly)."""

from __future__ import annotations

import logging
import netrc
import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from ..errors import PACKAGE, ConfigError
from ..models.fp8 import RECIPES, fp8_layers, import_torchao
from .plan import Strategy

log = logging.getLogger(__name__)

FP8_ON_CPU = "FP8_ON_CPU_FOR_TESTS"  # torch._scaled_mm has a CPU kernel: tests run FP8 there
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")


def resolve_accelerator(requested: str) -> str:
    """`auto` becomes `cuda`, `mps` or `cpu`, and `gpu` becomes `cuda` (one name for what the
    checks below compare); an unavailable accelerator is a config error."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if requested in ("gpu", "cuda") and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ConfigError(
                f"trainer.accelerator={requested} but torch {torch.__version__} is a CPU build. "
                "Use trainer=cpu, or on a machine with an NVIDIA GPU install a CUDA build of "
                "torch (make install)."
            )
        raise ConfigError(
            f"trainer.accelerator={requested} but torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}) sees no GPU: this machine has none, its driver is not "
            "loaded, or CUDA_VISIBLE_DEVICES hides them (nvidia-smi tells which). Use trainer=cpu "
            "here."
        )
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator=mps but MPS is not available; use trainer=cpu.")
    return "cuda" if requested == "gpu" else requested


def resolve_precision(requested: str, accelerator: str) -> str:
    """`auto` picks bf16-mixed on GPUs that support it, 16-mixed on older GPUs, 32 elsewhere."""
    requested = str(requested)
    if requested not in PRECISIONS:
        raise ConfigError(f"trainer.precision={requested} is not one of {', '.join(PRECISIONS)}.")
    on_cuda = accelerator in ("gpu", "cuda")
    if requested == "auto":
        if on_cuda:
            return (
                "bf16-mixed"
                if torch.cuda.is_bf16_supported(including_emulation=False)
                else "16-mixed"
            )
        return "32-true"
    if accelerator == "cpu" and requested in ("16-mixed", "16-true"):
        raise ConfigError(
            f"trainer.precision={requested} does not work on CPU (16-mixed silently runs as "
            "bf16, 16-true gives NaN losses); use bf16-mixed or 32-true."
        )
    if accelerator == "cpu" and requested.startswith("bf16") and not cpu_has_fast_bf16():
        log.warning(
            "trainer.precision=%s on this CPU runs many times slower than 32-true: it has no "
            "bf16 matrix instructions (AMX or AVX512-BF16). Use 32-true on this machine.",
            requested,
        )
    if (
        on_cuda
        and requested.startswith("bf16")
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"trainer.precision={requested} but {torch.cuda.get_device_name()} has no bf16 "
            "support; use 16-mixed or 32-true."
        )
    return requested


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices natively (x86 AMX or AVX512-BF16, ARM BF16), from
    /proc/cpuinfo; True where that cannot be read, so that no warning rests on a guess."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    lines = [line for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))]
    features = {word for line in lines for word in line.partition(":")[2].split()}
    return not lines or bool(features & {"amx_bf16", "avx512_bf16", "bf16"})


# Lines third-party libraries print on every run that tell a user of this project nothing.
NOISE = (
    "Tip: For seamless cloud",  # Lightning advertising litlogger and litmodels
    "Trainer already configured with model summary callbacks",
)
NOISY_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning on torch 2.10+
    # Testing or resuming in a run directory other than the one that saved the checkpoint:
    # ModelCheckpoint's ranking of that run's files means nothing here, as it says.
    r"The dirpath has changed from",
    # callbacks.ExactResume resumes the loader mid-epoch, which Lightning cannot see.
    r"You're resuming from a checkpoint that ended before the epoch ended",
    r"torch.distributed.nn.functional.all_gather is deprecated",  # Lightning on torch 2.13
    # Any run on a machine with SLURM's client installed, a login node included; the SLURM
    # launcher (hydra/launcher=slurm) starts its jobs as they should be started.
    r"The `srun` command is available on your system but is not used",
)


class DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(noise in message for noise in NOISE)


def is_global_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def check_fp8(recipe: Any, strategy: Strategy, accelerator: str, net: torch.nn.Module) -> None:
    """`model.fp8` (`recipe`) where it can work, or one line saying why not; the layers it leaves
    in high precision are listed. `net` may be on the meta device."""
    if not recipe:
        return
    if recipe not in RECIPES:
        raise ConfigError(f"model.fp8={recipe!r}: use {', '.join(RECIPES)} or null.")
    if strategy.kind == "fsdp":
        raise ConfigError(
            "model.fp8 runs on one device or under strategy=model_parallel (FSDP2, which "
            "all-gathers the weights in float8), not under FSDP1 (strategy=fsdp)."
        )
    if accelerator == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ConfigError(
                f"model.fp8 needs a GPU of compute capability 8.9 or newer (H100, H200, L4, L40S, "
                f"B200); {torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}. "
                "Remove model.fp8 (bf16-mixed is the fastest here)."
            )
    elif accelerator != "cpu" or os.environ.get(FP8_ON_CPU) != "1":
        raise ConfigError(
            f"model.fp8 needs a GPU of compute capability 8.9 or newer; this run is on {accelerator}. "
            "Remove model.fp8, or run on such a GPU (trainer=gpu)."
        )
    try:
        import_torchao()
    except ImportError as error:
        raise ConfigError(
            f"model.fp8 needs torchao ({error}): pip install '{PACKAGE}[fp8]'"
        ) from error
    converted, kept = fp8_layers(net)
    if not converted:
        raise ConfigError(
            "model.fp8: no Linear layer of model.net has dimensions that are multiples of 16 "
            "(float8 matrix products need them); widen the network or remove model.fp8."
        )
    if is_global_zero():
        log.info(
            "FP8 (%s): %d Linear layers in float8; in high precision: %s",
            recipe, len(converted), ", ".join(kept) or "none",
        )  # fmt: skip


def use_hydra_logging_only() -> None:
    """`import lightning` gives the "lightning" logger a console handler of its own; under Hydra,
    whose root handlers already print (and write the run's log file), each line would print twice.
    Lines and warnings in NOISE are dropped where they are made."""
    logging.getLogger("lightning").handlers.clear()
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        source = logging.getLogger(name)
        if not any(isinstance(f, DropNoise) for f in source.filters):
            source.addFilter(DropNoise())
    for pattern in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def configure_matmul_precision(setting: str | None) -> None:
    """TF32 tensor cores for float32 matmuls (`high`) unless the config says otherwise."""
    if setting:
        torch.set_float32_matmul_precision(setting)


def wandb_login_present() -> bool:
    """True when wandb has an API key: the environment, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False
