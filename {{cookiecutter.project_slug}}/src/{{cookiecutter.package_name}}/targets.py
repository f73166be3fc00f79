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


# What Python's logging config may build (`class` of a handler, `()` of any entry) without listing.
LOGGING_CLASSES = frozenset({
    "logging.Filter", "logging.Formatter", "logging.FileHandler", "logging.NullHandler",
    "logging.StreamHandler", "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler",
    "colorlog.ColoredFormatter",
})  # fmt: skip


def logging_factories(config: Any) -> Iterable[tuple[str, str]]:
    """(config key, name) of every callable that `hydra.hydra_logging` and `hydra.job_logging`
    name for Python's `logging.config.dictConfig`, which imports and calls them."""
    for part in ("hydra_logging", "job_logging"):
        node = OmegaConf.select(config, f"hydra.{part}")
        plain = OmegaConf.to_container(node, resolve=False) if node is not None else None
        if not isinstance(plain, dict):
            continue
        for section in ("formatters", "filters", "handlers"):
            entries = plain.get(section)
            for name, entry in (entries if isinstance(entries, dict) else {}).items():
                for key in ("()", "class"):
                    if isinstance(entry, dict) and key in entry:
                        named = str(entry[key]).removeprefix("ext://")
                        yield f"hydra.{part}.{section}.{name}.{key}", named


def check_logging_configs() -> None:
    """Hydra configures logging as it composes the config, before any command checks anything:
    the callables that the logging configs name pass a check first (Hydra's own policy refuses
    the worst of them, but with a traceback and after making the run directory)."""
    import hydra._internal.hydra as hydra_app

    configure = hydra_app.configure_log
    if getattr(configure, "checks_targets", False):
        return

    def checked(log_config: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(log_config, DictConfig):
            root = log_config._get_root()
            allowed = LOGGING_CLASSES | {
                str(name) for name in OmegaConf.select(root, "allowed_targets") or ()
            }
            for key, name in logging_factories(root):
                if name not in allowed:
                    raise ConfigError(
                        f"{key}={name} in the config is not allowed: a logging config may name "
                        "logging's own handlers, formatters and filters, and the exact names "
                        f"listed in allowed_targets. If you trust that code, add it: "
                        f"'allowed_targets=[{name}]'."
                    )
        configure(log_config, *args, **kwargs)

    checked.checks_targets = True  # type: ignore[attr-defined]
    hydra_app.configure_log = checked
