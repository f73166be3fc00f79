"""Which classes and functions a config may name in `_target_`. Hydra imports whatever a config
names, and a checkpoint's stored config is a config too, so every `_target_` is checked against an
allowlist before anything is imported."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError

ALWAYS_ALLOWED = (__package__ or "", "torch", "lightning", "torchmetrics", "datetime.timedelta")


def named_targets(node: Any, where: str = "") -> Iterable[tuple[str, str]]:
    """(config key, `_target_` value) for every `_target_` under `node`, without resolving it."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "_target_":
                yield path, str(value)
            else:
                yield from named_targets(value, path)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from named_targets(value, f"{where}[{index}]")


def is_allowed(target: str, allowed: Iterable[str]) -> bool:
    return any(target == prefix or target.startswith(prefix + ".") for prefix in allowed)


def check_targets(node: Any, extra_allowed: Iterable[str] = (), source: str = "the config") -> None:
    allowed = [*ALWAYS_ALLOWED, *extra_allowed]
    for key, target in named_targets(node):
        if not is_allowed(target, allowed):
            raise ConfigError(
                f"{key}={target} in {source} is not allowed: `_target_` may name only "
                f"{', '.join(allowed)}. If you trust that code, add its module to the list: "
                f"'allowed_targets=[{target.rsplit('.', 1)[0]}]'."
            )
