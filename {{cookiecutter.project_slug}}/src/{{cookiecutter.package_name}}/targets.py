"""Which classes and functions a config may name in `_target_`. Hydra imports and calls whatever a
config names, and a checkpoint's stored config is a config too, so every `_target_`, at any depth,
is checked before anything is imported: it must be a name that the project's own config files use
(or name in a comment, as an option), or one that the user lists in `allowed_targets`, exactly.
No prefix admits a whole module: `torch` alone holds functions that compile and run source code."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
NAMED_TARGET = re.compile(r"_target_\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_.]*)")


@functools.cache
def shipped_targets(config_dir: Path = CONFIG_DIR) -> frozenset[str]:
    """Every `_target_` written in the config files, values and comments alike."""
    return frozenset(
        name
        for path in sorted(config_dir.rglob("*.yaml"))
        for name in NAMED_TARGET.findall(path.read_text(encoding="utf-8"))
    )


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


def check_targets(node: Any, extra_allowed: Iterable[str] = (), source: str = "the config") -> None:
    allowed = shipped_targets() | {str(name) for name in extra_allowed}
    for key, target in named_targets(node):
        if target not in allowed:
            raise ConfigError(
                f"{key}={target} in {source} is not allowed: `_target_` may name only what the "
                "project's configs name, and the exact names listed in allowed_targets. If you "
                f"trust that code, add it: 'allowed_targets=[{target}]'."
            )


def check_hydra_callbacks() -> None:
    """Hydra builds the callbacks under `hydra.callbacks` before a run starts, and before the
    recipes check anything: their `_target_`s pass the same check first, in every command."""
    from hydra._internal.callbacks import Callbacks

    build = Callbacks.__init__
    if getattr(build, "checks_targets", False):
        return

    def checked(self: Callbacks, config: DictConfig | None = None) -> None:
        if config is not None and OmegaConf.select(config, "hydra.callbacks"):
            callbacks = {"callbacks": OmegaConf.select(config, "hydra.callbacks")}
            allowed = OmegaConf.select(config, "allowed_targets") or ()
            check_targets(OmegaConf.create({"hydra": callbacks}), allowed)
        build(self, config)

    checked.checks_targets = True  # type: ignore[attr-defined]
    Callbacks.__init__ = checked  # type: ignore[method-assign]
