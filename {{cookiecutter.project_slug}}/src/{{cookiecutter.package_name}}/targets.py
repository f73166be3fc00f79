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


MAX_INTERPOLATION_DEPTH = 32


def interpolated_targets(
    node: DictConfig | ListConfig, where: str = "", depth: int = 0
) -> Iterable[tuple[str, str]]:
    """The `_target_`s that interpolations under `node` produce once resolved: a resolver such as
    `oc.create` or `oc.decode`, or a reference to a node outside `node` (`${hydra:...}`), can
    build a `_target_` that no config spells out, and instantiation resolves them all."""
    if depth > MAX_INTERPOLATION_DEPTH:
        raise ConfigError(
            f"{where or 'the config'} nests interpolations more than {MAX_INTERPOLATION_DEPTH} "
            "deep: untangle the interpolations that refer to each other."
        )
    container: Any = node  # keys of either kind, indexed alike
    if isinstance(node, DictConfig):
        children = [(key, f"{where}.{key}" if where else str(key)) for key in container]
    else:
        children = [(index, f"{where}[{index}]") for index in range(len(node))]
    for key, path in children:
        child = container._get_node(key)  # the node itself, not its resolved value
        if OmegaConf.is_interpolation(container, key):
            try:
                value = container[key]
            except Exception:  # unresolvable here, so it cannot build anything either
                continue
            if isinstance(value, (dict, list)):
                value = OmegaConf.create(value)
            if isinstance(value, (DictConfig, ListConfig)):
                yield from named_targets(value, path)
                yield from interpolated_targets(value, path, depth + 1)
        elif isinstance(child, (DictConfig, ListConfig)):
            yield from interpolated_targets(child, path, depth)


def check_targets(
    node: Any, extra_allowed: Iterable[str] = (), source: str = "the config", where: str = ""
) -> None:
    allowed = shipped_targets() | {str(name) for name in extra_allowed}
    if not isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.create(node)  # as `instantiate` sees it: interpolations become live
    for key, target in (*named_targets(node, where), *interpolated_targets(node, where)):
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
            allowed = OmegaConf.select(config, "allowed_targets") or ()
            check_targets(config.hydra.callbacks, allowed, where="hydra.callbacks")
        build(self, config)

    checked.checks_targets = True  # type: ignore[attr-defined]
    Callbacks.__init__ = checked  # type: ignore[method-assign]
