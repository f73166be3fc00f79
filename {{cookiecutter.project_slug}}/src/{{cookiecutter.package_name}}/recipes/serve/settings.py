"""The server's settings, each checked before the checkpoint is read, and the device it runs on."""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ...errors import ConfigError
from ...run.settings import check_whole, number


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    max_batch_size: int
    batch_timeout: float
    shutdown_timeout: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_k_classes: int
    request_bytes: int
    most_new_tokens: int
    image_pixels: int
    queued_requests: int
    compile_decode: bool = False
    connections: int = 64
    header_seconds: float = 10.0
    body_seconds: float = 30.0


def check_seconds(key: str, value: Any) -> float:
    if not number(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}={value!r}: use a number of seconds, 0 or more (e.g. 0.01).")
    return float(value)


# Files the process keeps open besides its connections: the model's, the logs', the listener.
OWN_FILES = 128


def connection_bound(given: Any) -> int:
    """How many connections may be open at once: `given`, or what the open-files limit leaves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (1 << 20 if soft == resource.RLIM_INFINITY else soft) - OWN_FILES
    if room < 1:
        raise ConfigError(
            f"this process may open {soft} files (ulimit -n), too few for a server: raise it "
            f"above {OWN_FILES}."
        )
    if given is None:
        return room
    check_whole("limits.connections", given, 1)
    if given > room:
        raise ConfigError(
            f"limits.connections={given} is more than the {room} this process can open (its "
            f"open-files limit {soft}, less {OWN_FILES} for its own files): lower it, raise "
            "ulimit -n, or use null."
        )
    return int(given)


def check_positive_seconds(key: str, value: Any) -> float:
    if not number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}={value!r}: use a number of seconds above 0 (e.g. 10).")
    return float(value)


def check_temperature(value: Any) -> str | None:
    """What is wrong with `value` as a temperature, or None."""
    if not number(value) or not math.isfinite(value) or value < 0:
        return "use a finite number, 0 (greedy) or more"
    return None


def check_settings(cfg: DictConfig) -> Settings:
    """Every setting, before the checkpoint is read."""
    host = cfg.host
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host={host!r}: give an address, e.g. 127.0.0.1 or 0.0.0.0.")
    check_whole("port", cfg.port, 0, allowed=())
    if cfg.port > 65535:
        raise ConfigError(f"port={cfg.port}: use 1 to 65535, or 0 for a free port.")
    check_whole("max_batch_size", cfg.max_batch_size, 1, allowed=())
    check_whole("shutdown_timeout", cfg.shutdown_timeout, 0, allowed=())
    limits = cfg.limits
    for key in ("request_bytes", "max_new_tokens", "image_pixels", "queued_requests"):
        check_whole(f"limits.{key}", limits.get(key), 1, allowed=())
    check_whole("max_new_tokens", cfg.max_new_tokens, 1, allowed=())
    if cfg.max_new_tokens > limits.max_new_tokens:
        raise ConfigError(
            f"max_new_tokens={cfg.max_new_tokens} is more than limits.max_new_tokens="
            f"{limits.max_new_tokens}: lower it, or raise the limit."
        )
    problem = check_temperature(cfg.temperature)
    if problem:
        raise ConfigError(f"temperature={cfg.temperature!r}: {problem}.")
    check_whole("top_k", cfg.top_k, 1)
    check_whole("top_k_classes", cfg.top_k_classes, 1, allowed=())
    return Settings(
        host=host.strip(), port=int(cfg.port), max_batch_size=int(cfg.max_batch_size),
        batch_timeout=check_seconds("batch_timeout", cfg.batch_timeout),
        compile_decode=bool(cfg.compile_decode),
        shutdown_timeout=int(cfg.shutdown_timeout),
        max_new_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
        top_k=None if cfg.top_k is None else int(cfg.top_k),
        top_k_classes=int(cfg.top_k_classes), request_bytes=int(limits.request_bytes),
        most_new_tokens=int(limits.max_new_tokens), image_pixels=int(limits.image_pixels),
        queued_requests=int(limits.queued_requests),
        connections=connection_bound(limits.connections),
        header_seconds=check_positive_seconds("limits.header_seconds", limits.header_seconds),
        body_seconds=check_positive_seconds("limits.body_seconds", limits.body_seconds),
    )  # fmt: skip


def resolve_device(requested: Any) -> torch.device:
    name = str(requested).strip()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={requested!r}: use auto, cpu, cuda or cuda:<index>.")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index is not None and device.index >= count) or count == 0:
            raise ConfigError(
                f"device={requested} but this machine has {count} usable GPU(s): use "
                f"{'cuda:0 to cuda:' + str(count - 1) if count else 'cpu'}, or device=auto."
            )
    return device
