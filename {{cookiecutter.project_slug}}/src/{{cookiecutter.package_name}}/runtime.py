"""Settings that depend on the machine: accelerator, precision and matmul precision{% if cookiecutter.logger == "wandb" %}, and
whether wandb has a login (without importing Lightning or wandb, so the doctor answers quickly){% endif %}."""

from __future__ import annotations

import logging
{%- if cookiecutter.logger == "wandb" %}
import netrc
import os
from urllib.parse import urlparse
{%- endif %}

import torch

from .errors import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true")


def resolve_accelerator(requested: str) -> str:
    """`auto` becomes `cuda`, `mps` or `cpu`; an unavailable accelerator is a config error."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if requested in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={requested} but no CUDA GPU is visible to torch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Use trainer=cpu, or install a CUDA build of torch."
        )
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator=mps but MPS is not available; use trainer=cpu.")
    return requested


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


def use_hydra_logging_only() -> None:
    """`import lightning` gives the "lightning" logger a console handler of its own; under Hydra,
    whose root handlers already print (and write the run's log file), each line would print twice."""
    logging.getLogger("lightning").handlers.clear()


def configure_matmul_precision(setting: str | None) -> None:
    """TF32 tensor cores for float32 matmuls (`high`) unless the config says otherwise."""
    if setting:
        torch.set_float32_matmul_precision(setting)
{%- if cookiecutter.logger == "wandb" %}


def wandb_login_present() -> bool:
    """True when wandb has an API key: the environment, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False
{%- endif %}
